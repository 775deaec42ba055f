"""``gpushare pilot report``: compute on hand-made jobs whose every count is known, the sacct rows it reads, the
what-if, and the HTML page (parsed here, and rendered by Debian's chromium where it is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpushare.simulator.pilot_cli import FIELDS, SEP, command, rows_to_jobs
from gpushare.simulator.pilot_render import to_html, to_text
from gpushare.simulator.pilot_report import Job, build, coverage, safety, sharing

H = 3600.0
NO_LINE = "no 'python train.py', torchrun or accelerate launch line found in the batch script"


def observe(would: str, **keys):
    return {"v": 1, "decision": "observe", "would": would, **keys}


def jobs() -> list[Job]:
    """Seven GPU jobs on A100-40GB (40 shards): three would have shared, four had no estimate."""
    t0 = 1_800_000_000.0
    a100 = {"gpu_type": "a100-40gb", "gpus": 1}
    return [
        Job("1", "small", "u1", "a", "gpu", "COMPLETED", t0, t0 + 600, t0 + 600 + 2 * H, **a100,
            record=observe("shared", new="gres:shard:10", est_gib=8.0, margin_gib=2.0, src="directive:mem",
                           run={"peak_gib": 6.0, "would": {"cap_gib": 10.0}})),
        Job("2", "big", "u2", "b", "gpu", "COMPLETED", t0, t0 + 1200, t0 + 1200 + H, **a100,
            record=observe("shared", new="gres:shard:5", est_gib=4.0, margin_gib=1.0, src="cache",
                           script="train_big.py",
                           run={"peak_gib": 7.0, "would": {"cap_gib": 5.0, "stop": "backstop", "over_gib": 7.0}})),
        Job("3", "async", "u1", "a", "big", "COMPLETED", t0 + 60, t0 + 60, t0 + 60 + 4 * H, **a100,
            record=observe("shared", new="gres:shard:22", est_gib=20.0, margin_gib=2.0, src="async",
                           run={"peak_gib": 19.0})),
        Job("4", "ddp", "u3", "a", "big", "COMPLETED", t0, t0 + 3000, t0 + 3000 + H, gpu_type="a100-40gb", gpus=2,
            record=observe("multi-gpu", why="2 GPUs per node are kept exclusive")),
        Job("5", "other", "u3", "b", "gpu", "COMPLETED", t0, t0 + 30, t0 + 30 + H, **a100,
            record={"v": 1, "decision": "out-of-scope", "why": "partition gpu is out of scope"}),
        Job("6", "shell", "u2", "b", "gpu", "FAILED", t0, t0 + 90, t0 + 90 + H, **a100,
            record=observe("exclusive", why=NO_LINE)),
        Job("7", "old", "u1", "a", "gpu", "COMPLETED", t0, t0 + 6000, t0 + 6000 + H, **a100),
    ]


def test_coverage_counts_sources_and_reasons():
    assert coverage(jobs()) == {
        "jobs": 7, "with_estimate": 3, "sources": {"async": 1, "cache": 1, "directive": 1},
        "without_estimate": 4, "reasons": {"multi-GPU kept whole": 1, "no gpushare record": 1,
                                           "no training line found": 1, "out of scope": 1}}


def test_would_be_sharing_by_partition_and_account():
    got = sharing(jobs())
    assert got["jobs"] == 3 and got["unknown_gpu_type"] == 0
    assert got["gpu_hours_exclusive"] == pytest.approx(7.0)  # 2 + 1 + 4 h on one GPU each
    assert got["gpu_hours_shared"] == pytest.approx(2 * 10 / 40 + 1 * 5 / 40 + 4 * 22 / 40)
    assert got["by_partition"] == {
        "big": {"jobs": 1, "gpu_hours_exclusive": 4.0, "gpu_hours_shared": 2.2, "gpu_jobs": 2},
        "gpu": {"jobs": 2, "gpu_hours_exclusive": 3.0, "gpu_hours_shared": 0.625, "gpu_jobs": 5}}
    assert {k: v["jobs"] for k, v in got["by_account"].items()} == {"a": 2, "b": 1}


def test_safety_over_cap_errors_and_backstop_stops():
    got = safety(jobs())
    assert (got["eligible"], got["measured"], got["over_cap"], got["backstop_stops"]) == (3, 3, 1, 1)
    assert got["over_cap_pct"] == 33.3 and got["requeue_gpu_hours"] == 1.0
    assert got["over"] == [{"job": "2", "peak_gib": 7.0, "cap_gib": 5.0, "requeue_gpu_hours": 1.0}]
    # estimate - peak: +2, -3, +1 GiB; job 3's cap is its estimate + margin (no node record of one)
    assert got["error_gib"] == {"n": 3, "median": 1.0, "p90_abs": 3.0, "worst_under": -3.0}
    assert got["worst_under_by_script"] == [{"script": "train_big.py", "error_gib": -3.0}]
    assert [(p["job"], p["cap_gib"], p["over"]) for p in got["points"]] == [
        ("1", 10.0, False), ("2", 5.0, True), ("3", 22.0, False)]


def test_advice_one_line_per_finding_and_the_what_if_spread():
    runs = [{"util": u, "seed": s, "wait_mean_s": 100.0 + s, "wait_p95_s": 200.0, "jct_mean_s": 1000.0 * (1 + s),
             "jct_p95_s": 3000.0, "exclusive_jct_mean_s": 1000.0 if u == "classes" else 2000.0}
            for u in ("carma-fit", "classes") for s in (0, 1)]
    doc = build(jobs(), runs, {"since": "7d"}, [1.0, 2.0])
    spread = doc["whatif"]["spread"]
    assert spread["all"]["runs"] == 4 and spread["all"]["jct_mean_s"] == {"mean": 1500.0, "min": 1000.0, "max": 2000.0}
    assert set(spread["by_util"]) == {"carma-fit", "classes"}
    # live against Exclusive: carma-fit -50 % and 0 %, classes 0 % and +100 %
    assert spread["by_util"]["carma-fit"]["jct_mean_vs_exclusive_pct"] == {"mean": -25.0, "min": -50.0, "max": 0.0}
    assert spread["all"]["jct_mean_vs_exclusive_pct"] == {"mean": 12.5, "min": -50.0, "max": 100.0}
    assert doc["recorded"]["wait_mean_s"] == pytest.approx((600 + 1200 + 0 + 3000 + 30 + 90 + 6000) / 7, abs=0.01)
    advice = doc["advice"]
    assert any(line.startswith("safety: raise the margin: 33.3 %") for line in advice)
    assert any(line.startswith("backstop: 1 job(s)") for line in advice)
    assert any("train_big.py" in line for line in advice)
    assert any(line.startswith("what-if: live's mean JCT") for line in advice)
    assert any(line.startswith("do-no-harm:") and "keep observing" in line for line in advice)
    text = to_text(doc)
    assert "Coverage: 7 GPU jobs, 3 with an estimate" in text and "--util classes" in text


def export(rows: list[dict[str, str]]) -> str:
    return "".join(SEP.join(row.get(f, "") for f in FIELDS) + "\n" for row in rows)


def test_sacct_rows_become_jobs_with_our_record():
    record = "gpushare:{`v`:1,`decision`:`observe`,`would`:`shared`,`new`:`gres:shard:5`,`est_gib`:4.0}"
    text = export([
        {"JobIDRaw": "11", "JobName": "t", "User": "u", "Account": "a", "Partition": "gpu", "State": "COMPLETED",
         "Submit": "2026-11-20T10:00:00", "Start": "2026-11-20T10:01:00", "End": "2026-11-20T11:01:00",
         "AllocTRES": "billing=1,cpu=1,gres/gpu:a100-40gb=1,gres/gpu=1,mem=1G,node=1",
         "SystemComment": 'gpushare:{"v":1,"run":{"peak_gib":3.5}}', "AdminComment": record},
        {"JobIDRaw": "12", "JobName": "cpu", "Partition": "cpu", "State": "COMPLETED", "AllocTRES": "cpu=1,node=1"},
    ])
    [job] = rows_to_jobs(text)
    assert (job.job_id, job.gpus, job.gpu_type, job.elapsed_s, job.wait_s) == ("11", 1, "a100-40gb", 3600.0, 60.0)
    assert job.decision == "shared" and job.run == {"peak_gib": 3.5} and job.record["est_gib"] == 4.0


def _rows_of(jobs_: list[Job]) -> str:
    from datetime import datetime

    def iso(t):
        return datetime.fromtimestamp(t).isoformat(timespec="seconds") if t is not None else "Unknown"

    from gpushare.slurm.record import render
    return export([{"JobIDRaw": j.job_id, "JobName": j.name, "User": j.user, "Account": j.account,
                    "Partition": j.partition, "State": j.state, "Submit": iso(j.submit), "Start": iso(j.start),
                    "End": iso(j.end), "AllocTRES": f"gres/gpu:{j.gpu_type}={j.gpus},gres/gpu={j.gpus}",
                    "AdminComment": render(j.record) or "" if j.record else ""} for j in jobs_])


def test_cli_json_with_the_what_if_and_the_html_page(tmp_path):
    path = tmp_path / "export.txt"
    path.write_text(_rows_of(jobs()))
    config = tmp_path / "gpushare.toml"
    config.write_text("")
    page = tmp_path / "pilot.html"
    result = CliRunner().invoke(command, ["report", "--from", str(path), "--json", "--seeds", "2", "--config",
                                          str(config), "--html", str(page)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["coverage"]["jobs"] == 7 and doc["safety"]["over_cap"] == 1
    assert sorted((r["util"], r["seed"]) for r in doc["whatif"]["runs"]) == [
        ("carma-fit", 0), ("carma-fit", 1), ("classes", 0), ("classes", 1)]
    assert len(doc["whatif"]["waits_s"]) == 7
    assert page.read_text().count("<svg") == 3
    only = CliRunner().invoke(command, ["report", "--from", str(path), "--json", "--no-what-if",
                                        "--partition", "big"])
    assert json.loads(only.output)["coverage"]["jobs"] == 2


class _Page(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "circle", "line", "rect", "polyline"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.count: dict[str, int] = {}
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1
        for name, value in attrs:
            if name in ("src", "href") or (value or "").startswith(("http:", "https:")) and name != "xmlns":
                self.errors.append(f"external reference {name}={value}")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def page_doc() -> dict:
    runs = [{"util": "carma-fit", "seed": 0, "wait_mean_s": 50.0, "wait_p95_s": 90.0, "jct_mean_s": 7000.0,
             "jct_p95_s": 15000.0}]
    return build(jobs(), runs, {"since": "7d"}, [0.0, 10.0, 20.0, 30.0, 3000.0])


def test_html_page_is_well_formed_self_contained_and_holds_the_three_plots():
    page = to_html(page_doc())
    parser = _Page()
    parser.feed(page)
    assert parser.errors == [] and parser.stack == []
    assert parser.count["svg"] == 3 and parser.count["circle"] == 3  # one point per measured would-share job
    assert parser.count["rect"] == 4  # two partitions with would-share jobs, two bars each
    assert parser.count["polyline"] == 2  # recorded and what-if waits
    assert "<script" not in page and 'fill="#c0392b"' in page  # job 2 over its cap, drawn red


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_page_renders_with_its_plots_in_headless_chromium(tmp_path):
    page = tmp_path / "pilot.html"
    page.write_text(to_html(page_doc()))
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 3 and dom.stdout.count("<circle") == 3
    shot = tmp_path / "shot.png"
    done = subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a drawn page, not a blank one


def test_the_admin_command_lists_pilot():
    from gpushare.cli import group

    result = CliRunner().invoke(group, ["pilot", "report", "--help"])
    assert result.exit_code == 0 and "--since" in result.output and Path(__file__).exists()


if __name__ == "__main__":  # docs/pilot-report-example.html: the page for the jobs above, with a real what-if
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "export.txt").write_text(_rows_of(jobs()))
        (Path(tmp) / "gpushare.toml").write_text("")
        out = CliRunner().invoke(command, ["report", "--from", str(Path(tmp) / "export.txt"),
                                           "--config", str(Path(tmp) / "gpushare.toml"), "--seeds", "3", "--nodes", "1",
                                           "--gpus-per-node", "2", "--gpu", "a100-40gb", "--html", sys.argv[1]])
        print(out.output, end="")
        sys.exit(out.exit_code)
