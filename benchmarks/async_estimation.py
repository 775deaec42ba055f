"""Submission-to-release time of asynchronous estimation for the examples, on a real local Slurm.

One cluster (GPU node n1 with 2 × a100-40gb, CPU node c1 in partition ``cpu``), ``[policy] without_estimate``
= async. For each example a GPU job whose batch script says ``python examples/<name>.py`` is submitted
with plain ``sbatch --gres=gpu:1`` as an ordinary user; we time from ``sbatch`` returning to the job's
record leaving ``decision: estimating`` (the moment it is released), and report the service's own
``held_s`` and the request it got. Jobs are measured one at a time so each time is one estimation's.

    sudo python benchmarks/async_estimation.py --user gpushare-test \\
        [--estimator /path/to/gpu-estimate] [--examples forward_only,amp_train] [--instant]

``--instant`` swaps in a stand-in estimator that prints a fixed answer at once, leaving the path's own
cost: polling, scheduling the estimation job on the CPU node, reading the result, resize and release.

The user must exist and be able to execute the estimator (a virtual environment outside a private home).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpushare.slurm.jobs import Job, number
from gpushare.slurm_plugins.decision import parse_record
from devcluster.local_cluster import LocalCluster, missing_requirements

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEFAULT = "forward_only,zero_grad_placement,grad_accum_train,amp_train,gpt2_train,resnet50_train,data_dependent,crash"


def submit(cluster: LocalCluster, user: str, work: Path, name: str) -> tuple[int, float]:
    body = f"#!/bin/sh\n#SBATCH -J bench-{name}\npython() {{ true; }}\npython {name}.py\n"
    proc = subprocess.run(cluster.user_argv(user, ["sbatch", "--parsable", "--gres=gpu:1", "-D", str(work),
                                            "-o", "/dev/null"]), input=body, text=True, capture_output=True, env=cluster.env,
                          check=True)
    return int(proc.stdout.strip().split(";")[0]), time.monotonic()


def wait_release(cluster: LocalCluster, job_id: int, timeout_s: float) -> tuple[dict, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = cluster.client.job(job_id)
        record = parse_record(job.admin_comment if job else None) or {}
        if record.get("decision") != "estimating":
            return record, time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} still held after {timeout_s:.0f} s")


def estimator_elapsed(est: Job | None) -> float:
    """gpu-estimate's own ``elapsed_s`` from the result the estimation job left (NaN when it failed)."""
    try:
        doc = json.loads((Path(est.std_out).parent / "result.json").read_text())  # type: ignore[union-attr]
        return float(doc["elapsed_s"])
    except (TypeError, KeyError, OSError, ValueError):
        return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--user", default="gpushare-test")
    parser.add_argument("--estimator", default=os.path.join(os.path.dirname(sys.executable), "gpu-estimate"))
    parser.add_argument("--examples", default=DEFAULT)
    parser.add_argument("--poll", type=float, default=1.0, help="[estimation] poll_s")
    parser.add_argument("--instant", action="store_true",
                        help="use a stand-in estimator that answers at once: the path's own overhead")
    args = parser.parse_args()
    problem = missing_requirements()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    account = pwd.getpwnam(args.user)
    root = Path(tempfile.mkdtemp(prefix="gpushare-bench-"))
    os.chmod(root, 0o711)
    work = root / "work"
    work.mkdir(mode=0o755)
    for name in args.examples.split(","):
        shutil.copy(EXAMPLES / f"{name}.py", work / f"{name}.py")
    for path in [work, *work.iterdir()]:
        os.chown(path, account.pw_uid, account.pw_gid)
    if args.instant:
        stand_in = root / "instant-estimate"
        stand_in.write_text('#!/bin/sh\necho \'{"elapsed_s": 0, "targets": [{"gpu": "a100-40gb", '
                            '"peak_total_bytes": 3221225472}]}\'\n')
        os.chmod(stand_in, 0o755)
        args.estimator = str(stand_in)
    toml = (f'[estimation]\npartition = "cpu"\ncpus = 2\nmemory = "3500M"\ntime_limit_s = 600\n'
            f'poll_s = {args.poll}\nspool_dir = "{root / "spool"}"\ncommand = "{args.estimator}"\n')
    cluster = LocalCluster(root / "c", bin_dir=os.path.dirname(sys.executable), cpu_nodes=("c1",), toml_extra=toml)
    rows = []
    try:
        cluster.start()
        for name in args.examples.split(","):
            job_id, submitted = submit(cluster, args.user, work, name)
            record, released = wait_release(cluster, job_id, 900)
            rows.append((name, released - submitted, record))
            est = cluster.client.job(record["est_job"]) if record.get("est_job") else None
            times = {k: number(est.raw.get(k)) or 0 for k in ("end_time", "start_time", "submit_time")} if est else {}
            run_s = (times["end_time"] - times["start_time"]) if est else float("nan")
            queued_s = (times["start_time"] - times["submit_time"]) if est else float("nan")
            print(f"{name:<22} {released - submitted:6.1f} s  (estimation job queued {queued_s:.0f} s, ran "
                  f"{run_s:.0f} s; gpu-estimate's own elapsed_s {estimator_elapsed(est):.1f})  held_s="
                  f"{record.get('held_s')}  {record.get('decision')} {record.get('new')}  "
                  f"{record.get('why', '')[:60]}", flush=True)
    finally:
        cluster.stop()
    times = [seconds for _, seconds, _ in rows]
    if times:
        print(f"median {statistics.median(times):.1f} s, max {max(times):.1f} s over {len(times)} examples "
              f"(poll {args.poll} s)")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
