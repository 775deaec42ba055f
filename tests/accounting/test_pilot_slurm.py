"""``gpushare pilot report`` on a real Slurm in observe mode: slurmctld, slurmd, slurmdbd with MariaDB, the node
agent on simulated GPUs, gpushare-submitd with ``[policy] mode = "observe"``. Four jobs of known truth run on
whole GPUs (observe changes no request), then the report, reading only ``sacct``, must count each one right:

- ``fits``: ``#GPUSHARE mem=8G``, peaks at 3000 MiB: would have shared as shard:9, under its cap;
- ``over``: ``#GPUSHARE mem=2G``, peaks at 4000 MiB for 4 s: would have shared as shard:3 (cap 3 GiB), over it,
  and the backstop (grace 1 s, tolerance 512 MiB) would have stopped it;
- ``multi``: two GPUs: kept whole (multi-GPU), no estimate;
- ``none``: no directive and no cache entry: no estimate (``without_estimate = "exclusive"``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import accounting
from devcluster.local_cluster import ensure_login_user, missing_requirements
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm import record as record_format

pytestmark = pytest.mark.slurm
BIN_DIR = os.path.dirname(sys.executable)
SIMJOB = Path(__file__).parents[1] / "agent" / "simjob.py"


def script(directive: str | None, args: str) -> str:
    line = f"#GPUSHARE {directive}\n" if directive else ""
    return f"#!/bin/sh\n{line}'{sys.executable}' '{SIMJOB}' {args}\n"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, acct: Any) -> Iterator[Any]:
    problem = missing_requirements() or accounting.missing_requirements()
    if problem:
        pytest.skip(f"real Slurm with accounting unavailable: {problem}")
    owner = ensure_login_user()
    base = Path(tempfile.mkdtemp(prefix="gpushare-pilot-", dir="/tmp"))
    os.chmod(base, 0o755)
    SimBackend.from_scenario(acct.agent.two_gpus(), base / "sim.json")
    toml = acct.agent_toml(base, "backstop_grace_s = 1.0\n") + '\n[policy]\nmode = "observe"\n'
    made = acct.agent.AgentCluster(base, bin_dir=BIN_DIR, toml_extra=toml, accounting=True,
                                   accounting_users=("root", owner.pw_name))
    made.owner = owner
    with acct.running(made, request):
        yield made


def _done(cluster: Any, job: int) -> bool:
    found = subprocess.run(cluster.argv(["sacct", "-n", "-P", "-X", "-j", str(job), "-o", "State,SystemComment"]),
                           capture_output=True, text=True, env=cluster.env).stdout.strip().splitlines()
    if not found:
        return False
    state, _, comment = found[-1].partition("|")
    run = (record_format.parse(comment) or {}).get("run") or {}
    return state.split()[0] in ("COMPLETED", "FAILED") and "exit" in run


@pytest.fixture(scope="module")
def jobs(cluster: Any) -> dict[str, int]:
    out = Path(tempfile.mkdtemp(prefix="gpushare-pilot-out-"))
    os.chmod(out, 0o777)
    common = (f"--uid={cluster.owner.pw_uid}", f"--gid={cluster.owner.pw_gid}", "-D", str(out),
              "-o", str(out / "job-%j.out"), f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}")
    ids = {"fits": cluster.client.sbatch("--gres=gpu:1", *common,
                                         script=script("mem=8G", "--mem-mib 3000 --seconds 3"))[0],
           "over": cluster.client.sbatch("--gres=gpu:1", *common,
                                         script=script("mem=2G", "--mem-mib 4000 --seconds 4"))[0],
           "multi": cluster.client.sbatch("--gres=gpu:2", *common, script=script(None, "--mem-mib 2000 --seconds 2"))[0],
           "none": cluster.client.sbatch("--gres=gpu:1", *common, script=script(None, "--mem-mib 1000 --seconds 2"))[0]}
    for name, job in ids.items():
        cluster.wait_for(lambda: _done(cluster, job), 150, f"the {name} job {job} did not finish with its record")
    yield ids
    shutil.rmtree(out, ignore_errors=True)


def test_every_count_in_the_pilot_report_is_the_known_truth(cluster, jobs, tmp_path):
    page = tmp_path / "pilot.html"
    done = subprocess.run(cluster.argv([f"{BIN_DIR}/gpushare", "pilot", "report", "--since", "1h", "--json",
                                        "--no-what-if", "--html", str(page)]),
                          capture_output=True, text=True, env=cluster.env, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["coverage"] == {"jobs": 4, "with_estimate": 2, "sources": {"directive": 2}, "without_estimate": 2,
                               "reasons": {"multi-GPU kept whole": 1, "no estimate (exclusive)": 1}}, doc["coverage"]
    assert doc["sharing"]["jobs"] == 2, doc["sharing"]
    safety = doc["safety"]
    assert (safety["eligible"], safety["measured"], safety["over_cap"], safety["backstop_stops"]) == (2, 2, 1, 1), safety
    [over] = safety["over"]
    assert over["job"] == str(jobs["over"]) and over["cap_gib"] == 3.0
    assert over["peak_gib"] == pytest.approx(4000 / 1024, abs=0.05)
    by_job = {p["job"]: p for p in safety["points"]}
    assert by_job[str(jobs["fits"])]["cap_gib"] == 9.0 and not by_job[str(jobs["fits"])]["over"]
    assert page.read_text().count("<svg") == 3
