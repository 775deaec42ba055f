"""``gpushare pilot report``, the render part: terminal text, JSON and one self-contained HTML page.

Why our own SVG: the page is opened from disk on an admin's machine, often with no network; so no script, no
CDN, no image files: three inline SVG plots (peak vs would-be cap, per-partition GPU-hours, wait-time
distribution) drawn here from the report document (gpushare.simulator.pilot_report.build).
"""

from __future__ import annotations

import html
import json
from typing import Any

W, H, PAD = 520, 300, 48


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False)


def _h(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _pm(stat: dict[str, Any] | None) -> str:
    if not stat:
        return "-"
    return f"{_h(stat['mean'])} ({_h(stat['min'])} to {_h(stat['max'])})"


def to_text(doc: dict[str, Any]) -> str:
    cov, share, safe, rec = doc["coverage"], doc["sharing"], doc["safety"], doc["recorded"]
    period = doc.get("period") or {}
    lines = [f"gpushare pilot report: {period.get('since', '?')} to {period.get('until', 'now')}"
             + "".join(f", {k} {period[k]}" for k in ("partition", "account") if period.get(k)), ""]
    lines.append(f"Coverage: {cov['jobs']} GPU jobs, {cov['with_estimate']} with an estimate ("
                 + (", ".join(f"{k} {v}" for k, v in cov["sources"].items()) or "none") + f"), "
                 f"{cov['without_estimate']} without (" + (", ".join(f"{k} {v}" for k, v in cov["reasons"].items())
                                                          or "none") + ")")
    lines.append(f"Would-be sharing: {share['jobs']} jobs; GPU-hours {share['gpu_hours_exclusive']:.1f} exclusive, "
                 f"{share['gpu_hours_shared']:.1f} as shares")
    for name, row in share["by_partition"].items():
        lines.append(f"  partition {name}: {row['jobs']} of {row.get('gpu_jobs', 0)} jobs, "
                     f"{row['gpu_hours_exclusive']:.1f} -> {row['gpu_hours_shared']:.1f} GPU-hours")
    for name, row in share["by_account"].items():
        lines.append(f"  account {name}: {row['jobs']} of {row.get('gpu_jobs', 0)} jobs, "
                     f"{row['gpu_hours_exclusive']:.1f} -> {row['gpu_hours_shared']:.1f} GPU-hours")
    err = safe["error_gib"]
    lines.append(f"Safety: {safe['eligible']} would-share jobs, {safe['measured']} with a measured peak; "
                 f"{safe['over_cap']} over their would-be cap (requeue cost {safe['requeue_gpu_hours']:.1f} GPU-hours); "
                 f"{safe['backstop_stops']} would-be backstop stops")
    lines.append(f"  estimate - peak (GiB): median {err['median']}, p90 |error| {err['p90_abs']}, "
                 f"worst under {err['worst_under']}")
    for row in safe["worst_under_by_script"]:
        lines.append(f"  under-estimated: {row['script']} {row['error_gib']:+.2f} GiB")
    lines.append(f"Recorded by Slurm: wait mean {_h(rec['wait_mean_s'])}, p95 {_h(rec['wait_p95_s'])}; "
                 f"JCT mean {_h(rec['jct_mean_s'])}, p95 {_h(rec['jct_p95_s'])}")
    spread = (doc.get("whatif") or {}).get("spread")
    if spread:
        a = spread["all"]
        lines.append(f"What-if (--policy live, {a['runs']} runs: seeds x utilisation models), mean (range): "
                     f"wait mean {_pm(a['wait_mean_s'])}, p95 {_pm(a['wait_p95_s'])}; "
                     f"JCT mean {_pm(a['jct_mean_s'])}, p95 {_pm(a['jct_p95_s'])}")
        for util, s in spread["by_util"].items():
            harm = s.get("jct_mean_vs_exclusive_pct")
            lines.append(f"  --util {util}: JCT mean {_pm(s['jct_mean_s'])}, wait mean {_pm(s['wait_mean_s'])}"
                         + (f"; mean JCT against whole GPUs (same simulated cluster) {harm['mean']:+.1f} % "
                            f"({harm['min']:+.1f} to {harm['max']:+.1f} %)" if harm else ""))
    else:
        lines.append("What-if: not run")
    lines += ["", "Advice:"] + [f"- {line}" for line in doc["advice"]]
    return "\n".join(lines) + "\n"


def _axes(title: str, x_label: str, y_label: str, x_max: float, y_max: float) -> list[str]:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(title)}">',
           f"<title>{html.escape(title)}</title>",
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#333"/>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{PAD}" y2="10" stroke="#333"/>',
           f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="12">{html.escape(x_label)}</text>',
           f'<text x="12" y="{H / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 12 {H / 2})">'
           f"{html.escape(y_label)}</text>"]
    for i in range(5):
        y = H - PAD - i * (H - PAD - 10) / 4
        out.append(f'<text x="{PAD - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{y_max * i / 4:.3g}</text>')
        if x_max:
            x = PAD + i * (W - PAD - 10) / 4
            out.append(f'<text x="{x:.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">'
                       f"{x_max * i / 4:.3g}</text>")
    return out


def _sx(v: float, top: float) -> float:
    return PAD + (W - PAD - 10) * (v / top if top else 0)


def _sy(v: float, top: float) -> float:
    return H - PAD - (H - PAD - 10) * (v / top if top else 0)


def scatter_svg(points: list[dict[str, Any]]) -> str:
    """Measured peak against would-be cap per job; the diagonal is peak = cap (above it: a requeue)."""
    top = max([1.0] + [max(p["cap_gib"], p["peak_gib"]) for p in points]) * 1.1
    out = _axes("Measured peak against would-be cap", "would-be cap (GiB)", "measured peak (GiB)", top, top)
    out.append(f'<line x1="{_sx(0, top)}" y1="{_sy(0, top)}" x2="{_sx(top, top):.1f}" y2="{_sy(top, top):.1f}" '
               'stroke="#999" stroke-dasharray="4 3"/>')
    for p in points:
        colour = "#c0392b" if p["over"] else "#2471a3"
        out.append(f'<circle class="point" cx="{_sx(p["cap_gib"], top):.1f}" cy="{_sy(p["peak_gib"], top):.1f}" r="4" '
                   f'fill="{colour}"><title>job {html.escape(str(p["job"]))}: peak {p["peak_gib"]:.2f} GiB, cap '
                   f'{p["cap_gib"]:.2f} GiB</title></circle>')
    out.append("</svg>")
    return "\n".join(out)


def bars_svg(by_partition: dict[str, dict[str, Any]]) -> str:
    """Per partition: GPU-hours the would-share jobs' whole GPUs held, and what their shares would have held."""
    names = list(by_partition)
    top = max([1e-9] + [row["gpu_hours_exclusive"] for row in by_partition.values()]) * 1.1
    out = _axes("GPU-hours per partition: exclusive against shared", "partition", "GPU-hours", 0, top)
    slot = (W - PAD - 10) / max(1, len(names))
    for i, name in enumerate(names):
        row = by_partition[name]
        x = PAD + i * slot + slot * 0.1
        for j, (key, colour) in enumerate((("gpu_hours_exclusive", "#7f8c8d"), ("gpu_hours_shared", "#27ae60"))):
            y = _sy(row[key], top)
            out.append(f'<rect class="bar" x="{x + j * slot * 0.4:.1f}" y="{y:.1f}" width="{slot * 0.38:.1f}" '
                       f'height="{H - PAD - y:.1f}" fill="{colour}"><title>{html.escape(name)} {key}: '
                       f'{row[key]:.2f}</title></rect>')
        out.append(f'<text x="{x + slot * 0.4:.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">'
                   f"{html.escape(name)}</text>")
    out.append("</svg>")
    return "\n".join(out)


def waits_svg(recorded: list[float], simulated: list[float]) -> str:
    """Distribution of waits (cumulative share of jobs), Slurm's recorded against the what-if's first run."""
    top = max([60.0] + recorded + simulated) / 3600 * 1.05
    out = _axes("Wait-time distribution", "wait (h)", "share of jobs", top, 1.0)
    for values, colour, label in ((recorded, "#2c3e50", "recorded"), (simulated, "#e67e22", "what-if")):
        if not values:
            continue
        ordered = sorted(values)
        points = [f"{_sx(0, top):.1f},{_sy(0, 1):.1f}"]
        for i, v in enumerate(ordered, 1):
            points.append(f"{_sx(v / 3600, top):.1f},{_sy((i - 1) / len(ordered), 1):.1f}")
            points.append(f"{_sx(v / 3600, top):.1f},{_sy(i / len(ordered), 1):.1f}")
        out.append(f'<polyline class="cdf" points="{" ".join(points)}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"><title>{label}</title></polyline>')
    out.append(f'<text x="{W - 110}" y="24" font-size="11" fill="#2c3e50">recorded</text>'
               f'<text x="{W - 110}" y="38" font-size="11" fill="#e67e22">what-if</text>')
    out.append("</svg>")
    return "\n".join(out)


def to_html(doc: dict[str, Any]) -> str:
    """One page, no script, no external resource."""
    text = html.escape(to_text(doc))
    safe, share = doc["safety"], doc["sharing"]
    advice = "".join(f"<li>{html.escape(line)}</li>" for line in doc["advice"])
    plots = [("Peak against would-be cap", scatter_svg(safe["points"]),
              f"{safe['over_cap']} of {safe['measured']} measured jobs above the diagonal (over their cap)"),
             ("Per partition", bars_svg({k: v for k, v in share["by_partition"].items() if v["jobs"]}),
              "grey: GPU-hours of the whole GPUs; green: what the shares would have held"),
             ("Waits", waits_svg(doc["recorded"]["waits_s"], (doc.get("whatif") or {}).get("waits_s") or []),
              "cumulative share of jobs by wait: Slurm's record and the what-if's first run")]
    figures = "".join(f"<figure><figcaption>{html.escape(title)}: {html.escape(note)}</figcaption>{svg}</figure>"
                      for title, svg, note in plots)
    data = html.escape(to_json({k: v for k, v in doc.items() if k != "recorded"}))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>gpushare pilot report</title><style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
            "figure{display:inline-block;margin:1em}pre{background:#f4f4f4;padding:1em;overflow-x:auto}"
            "</style></head><body><h1>gpushare pilot report</h1>"
            f"<h2>Advice</h2><ul>{advice}</ul><h2>Plots</h2>{figures}<h2>Summary</h2><pre>{text}</pre>"
            f"<details><summary>JSON document</summary><pre>{data}</pre></details></body></html>\n")
