"""gpu-estimate on the public-scripts corpus: one row per case (ok / failed / timeout / skipped), a summary.

Each case's command (cases/<family>.toml, ``{src}``/``{work}`` filled in) runs in its work folder, one at
a time, as ``nice -n 10 gpu-estimate --gpu a100-40gb --json --no-cache --timeout T COMMAND``, with the
gpu-estimate of the stack's venv (``--python``: that venv's interpreter; the scripts run inside it, so it
must hold their packages). The corpus folder comes from recreate.py. A case is killed at T + 60 s. Offline:
no hub, no tracker. A case whose packages do not import in the stack, or whose files were not re-created,
is skipped with its reason.

Row: case, family, status, capture mode, wall seconds, load average at its start, peak allocated /
reserved / total GiB of the first target, and the failure's line. Last line:
``N/M estimated, K fake, median X s`` (M = cases run, the median over their wall times).

    python benchmarks/public_scripts/run.py [--only REGEX] [--python /var/tmp/pubcorpus-venv/bin/python]
                                            [--corpus DIR] [--json-out FILE] [--gpu a100-40gb]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recreate import DEFAULT_CORPUS, DEFAULT_PYTHON, OFFLINE_ENV, Case, git_blob_hash, load_cases  # noqa: E402

GIB = 2**30


def failure_line(stderr: str, stdout: str) -> str:
    """gpu-estimate's own message, else the traceback's last error line, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("gpu-estimate:"):
            return line[len("gpu-estimate:"):].strip()
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line):
            return line
    if lines:
        return lines[-1]
    out = stdout.strip().splitlines()
    return out[-1] if out else "no output"


def missing_packages(python: str, packages: list[str], memo: dict[tuple, bool],
                     case_env: dict[str, str] | None = None) -> list[str]:
    """The packages that do not import in the stack, under the case's own environment (its PYTHONPATH)."""
    missing = []
    env = dict(os.environ, **(case_env or {}))
    for name in packages:
        key = (name, tuple(sorted((case_env or {}).items())))
        if key not in memo:
            r = subprocess.run([python, "-c", f"import {name}"], capture_output=True, timeout=300, env=env)
            memo[key] = r.returncode == 0
        if not memo[key]:
            missing.append(name)
    return missing


def sources_ready(case: Case, corpus: Path) -> str | None:
    for path, blob in zip(case.files, case.blobs):
        f = case.src(corpus) / path
        if not f.is_file():
            return f"{path} not re-created (recreate.py)"
        if git_blob_hash(f.read_bytes()) != blob:
            return f"{path} differs from its pinned blob (recreate.py)"
    for spec in case.fixtures:
        if not (corpus / "fixtures" / spec.replace(":", ".") / ".fixture-done").is_file():
            return f"fixture {spec} not made (recreate.py)"
    return None


def run_case(case: Case, corpus: Path, estimator: str, gpu: str, bindir: str) -> dict:
    work = case.work(corpus)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **OFFLINE_ENV)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.setdefault("HF_HOME", str(work / ".hf-home"))
    env.setdefault("TORCH_HOME", str(work / ".torch-home"))
    # The warm worker's fingerprint: keep a worker started from another venv off this stack's cases.
    env["TORCH_GPUSHARE_PUBLIC_SCRIPTS_STACK"] = estimator
    env.update({k: case.expand(v, corpus) for k, v in case.env.items()})
    command = [case.expand(a, corpus) for a in case.command]
    argv = ["nice", "-n", "10", estimator, "--gpu", gpu, "--json", "--no-cache", "--timeout", str(case.timeout),
            *command]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=case.expand(case.cwd, corpus), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed = False
    try:
        out, err = proc.communicate(timeout=case.timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group this run started, nothing else
        out, err = proc.communicate()
        killed = True
    row: dict = {"name": case.name, "family": case.family, "wall_s": round(time.monotonic() - t0, 1),
                 "load": round(load, 2), "rc": proc.returncode, "command": command,
                 "stderr_tail": (err or "")[-4000:]}
    doc = None
    if out and out.lstrip().startswith("{"):
        try:
            doc = json.loads(out)
        except ValueError:
            doc = None
    if killed:
        row.update(status="timeout", error=f"killed at {case.timeout + 60} s")
    elif proc.returncode == 0 and doc and doc.get("targets"):
        target = doc["targets"][0]
        row.update(status="ok", mode=doc.get("mode"), fallback_reason=doc.get("fallback_reason"),
                   iterations=doc.get("iterations"), elapsed_s=doc.get("elapsed_s"),
                   allocated_gib=round(target["peak_allocated_bytes"] / GIB, 2),
                   reserved_gib=round(target["peak_reserved_bytes"] / GIB, 2),
                   total_gib=round(target["peak_total_bytes"] / GIB, 2),
                   request=(target.get("recommendation") or {}).get("request"))
    elif "time limit" in (err or "").lower():
        row.update(status="timeout", error=failure_line(err or "", out or ""))
    else:
        row.update(status="failed", error=failure_line(err or "", out or ""))
    return row


def print_row(row: dict) -> None:
    if row["status"] == "ok":
        note = f"{row.get('iterations')} steps"
        if row.get("fallback_reason"):
            note += f"; fallback: {row['fallback_reason']}"
        print(f"{row['name']:34} {row['family']:14} ok       {row['mode']:8} {row['wall_s']:7.1f} {row['load']:5.1f} "
              f"{row['allocated_gib']:7.2f} {row['reserved_gib']:7.2f} {row['total_gib']:7.2f}  {note[:160]}",
              flush=True)
    else:
        wall = f"{row['wall_s']:7.1f}" if "wall_s" in row else f"{'-':>7}"
        load = f"{row['load']:5.1f}" if "load" in row else f"{'-':>5}"
        print(f"{row['name']:34} {row['family']:14} {row['status']:8} {'-':8} {wall} {load} {'-':>7} {'-':>7} "
              f"{'-':>7}  {row.get('error', '')[:220]}", flush=True)


def summary(rows: list[dict]) -> str:
    ran = [r for r in rows if r["status"] != "skipped"]
    ok = [r for r in ran if r["status"] == "ok"]
    fake = [r for r in ok if r.get("mode") == "fake"]
    med = statistics.median(r["wall_s"] for r in ran) if ran else float("nan")
    skipped = len(rows) - len(ran)
    return (f"{len(ok)}/{len(ran)} estimated, {len(fake)} fake, median {med:.1f} s"
            + (f" ({skipped} skipped)" if skipped else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus folder (default %(default)s)")
    ap.add_argument("--python", default=DEFAULT_PYTHON, help="the stack venv's interpreter (default %(default)s)")
    ap.add_argument("--only", help="regex on case names")
    ap.add_argument("--gpu", default="a100-40gb")
    ap.add_argument("--json-out", type=Path, help="every row as JSON, rewritten after each case")
    a = ap.parse_args(argv)
    bindir = os.path.dirname(os.path.abspath(a.python))
    estimator = os.path.join(bindir, "gpu-estimate")
    if not os.access(estimator, os.X_OK):
        print(f"run: no gpu-estimate beside {a.python}: install this checkout into that venv "
              f"(pip install --no-deps -e .)", file=sys.stderr)
        return 2
    corpus = a.corpus.resolve()
    cases = load_cases(only=a.only)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
    print(f"# gpu-estimate {estimator} (code {head or '?'}), target {a.gpu}, corpus {corpus}, {len(cases)} cases",
          flush=True)
    print(f"{'case':34} {'family':14} {'status':8} {'mode':8} {'wall_s':>7} {'load':>5} {'alloc':>7} {'reserv':>7} "
          f"{'total':>7}  note", flush=True)
    memo: dict[tuple, bool] = {}
    rows: list[dict] = []
    for case in cases:
        why_not = sources_ready(case, corpus)
        missing = missing_packages(a.python, case.packages, memo, {k: case.expand(v, corpus) for k, v in case.env.items()})
        if missing:
            why_not = f"not importable in the stack: {', '.join(missing)}"
        if why_not:
            row = {"name": case.name, "family": case.family, "status": "skipped", "error": why_not}
        else:
            row = run_case(case, corpus, estimator, a.gpu, bindir)
        rows.append(row)
        print_row(row)
        if a.json_out:
            tmp = a.json_out.with_name(a.json_out.name + ".part")
            tmp.write_text(json.dumps({"code": head, "gpu": a.gpu, "estimator": estimator, "rows": rows},
                                      indent=1, default=str))
            os.replace(tmp, a.json_out)
    load = os.getloadavg()
    print(f"{summary(rows)}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
