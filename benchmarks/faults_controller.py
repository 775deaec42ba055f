"""Jobs held for asynchronous estimation when gpushare-submitd is killed or slurmctld restarts (docs/reliability.md).

One real local cluster of the running Slurm release (one GPU node, one CPU node for estimation jobs), the
test user and the stand-in estimator of tests/estimation/conftest.py (each estimation sleeps ``--estimate-s``
and logs its run). Per fault, ``--jobs`` GPU jobs from ``--scripts`` distinct training scripts are submitted
and held for estimation; 2 s later gpushare-submitd is killed with SIGKILL and started again 1 s later (as
its unit does), or slurmctld is restarted. Printed per fault: the jobs affected (still held at the fault),
jobs lost, jobs released without an estimate-based decision, scripts estimated more than once, and the time
from the fault until the last job was released.

    sudo GPUSHARE_TEST_SLURM=26.05 PYTHONPATH=. python benchmarks/faults_controller.py --jobs 20
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster, ensure_login_user, missing_requirements
from gpushare.slurm_plugins.decision import parse_record


def _estimation_helpers() -> Any:
    """tests/estimation/conftest.py (the stand-in estimator and the [estimation] table), under its own name."""
    path = Path(__file__).parents[1] / "tests" / "estimation" / "conftest.py"
    spec = importlib.util.spec_from_file_location("gpushare_estimation_test_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _submit(cluster: LocalCluster, work: Path, script: str) -> int:
    done = subprocess.run(cluster.user_argv(LOGIN_TEST_USER, ["sbatch", "--parsable", "--gres=gpu:1", "-D", str(work),
                                                             "-o", "/dev/null"]),
                          input=f"#!/bin/sh\npython() {{ true; }}\npython {script}\n", capture_output=True, text=True,
                          env=cluster.env, timeout=60, check=True)
    return int(done.stdout.strip().split(";")[0])


def _kill_submitd(cluster: LocalCluster) -> None:
    pid = cluster.pids.pop("submitd")
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    time.sleep(1.0)  # RestartSec=1
    cluster.start_submitd()


def fault(cluster: LocalCluster, work: Path, name: str, jobs: int, scripts: int, estimate_s: int,
          limit_s: float) -> str:
    work.mkdir(mode=0o755)
    user = ensure_login_user()
    os.chown(work, user.pw_uid, user.pw_gid)
    for n in range(scripts):
        path = work / f"train{n}.py"
        path.write_text(f"# FAKE_PEAK_GIB={2 + n % 3}\n# FAKE_SLEEP_S={estimate_s}\n# {name} {n}\n")
        os.chown(path, user.pw_uid, user.pw_gid)
    ids = [_submit(cluster, work, f"train{i % scripts}.py") for i in range(jobs)]
    time.sleep(2.0)
    held = [j for j in ids if _decision(cluster, j) == "estimating"]
    started = time.monotonic()
    if name == "submitd":
        _kill_submitd(cluster)
    else:
        cluster.restart_controller()
    converged = None
    while time.monotonic() - started < limit_s:
        if all(_decision(cluster, j) not in (None, "estimating") for j in ids):
            converged = time.monotonic() - started
            break
        time.sleep(0.5)
    queued = {int(j.job_id): j for j in cluster.client.jobs()}
    lost = sum(1 for j in ids if j not in queued)
    finals = [parse_record(queued[j].admin_comment) or {} for j in ids if j in queued]
    undecided = [r for r in finals if r.get("decision") in (None, "estimating") or r.get("src") != "async"]
    for record in undecided:
        print(f"  released without its estimate: {record.get('decision')}: {record.get('why')}", flush=True)
    runs = Counter((work / "fake-estimate-runs.log").read_text().split()) if (work / "fake-estimate-runs.log").exists() \
        else Counter()
    twice = sum(1 for count in runs.values() if count > 1)
    subprocess.run(["scancel", *map(str, ids)], env=cluster.env, check=False)
    took = f"{converged:.1f} s" if converged is not None else f"not within {limit_s:.0f} s"
    label = "gpushare-submitd SIGKILL" if name == "submitd" else "slurmctld restart"
    return (f"{label}: {jobs} jobs ({len(held)} held at the fault), {lost} lost, {len(undecided)} released without "
            f"their estimate, {twice} of {scripts} scripts estimated twice, all released {took} after the fault")


def _decision(cluster: LocalCluster, job_id: int) -> str | None:
    found = cluster.client.job(job_id)
    return (parse_record(found.admin_comment) or {}).get("decision") if found is not None else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--scripts", type=int, default=5, help="distinct training scripts (one estimation each)")
    parser.add_argument("--estimate-s", type=int, default=3, help="how long each stand-in estimation runs")
    parser.add_argument("--limit-s", type=float, default=180.0)
    args = parser.parse_args()
    problem = missing_requirements()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    helpers = _estimation_helpers()
    ensure_login_user()
    base = Path(tempfile.mkdtemp(prefix="gpushare-bench-ctl-faults-", dir="/tmp"))
    os.chmod(base, 0o711)
    fake = base / "fake-estimate"
    fake.write_text(helpers.FAKE_ESTIMATE.replace("@REAL@", "false"))
    os.chmod(fake, 0o755)
    cluster = LocalCluster(base / "c", bin_dir=os.path.dirname(sys.executable), cpu_nodes=("c1",),
                           toml_extra=helpers.estimation_toml(base / "spool", fake))
    try:
        cluster.start()
        for name in ("submitd", "slurmctld"):
            print(fault(cluster, base / f"work-{name}", name, args.jobs, args.scripts, args.estimate_s,
                        args.limit_s), flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
