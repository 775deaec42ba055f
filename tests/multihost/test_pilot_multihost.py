"""``gpushare pilot report`` on the multi-host cluster: observe mode, jobs of known truth on two GPU nodes.

The single-host form (tests/accounting/test_pilot_slurm.py) proves each count on one node. Here the jobs run on
two GPU hosts of their own (gpu1 and gpu2, each with its own agent, Epilog and disk), and the report runs on the
login host, which shares nothing with them but the accounting database: every count must still be the known
truth, so the measured peaks and would-be decisions of both nodes reach it.

- gpu1 ``fits``: ``#GPUSHARE mem=8G``, peaks at 3000 MiB: would have shared as shard:9, under its cap;
- gpu1 ``multi``: two GPUs: kept whole (multi-GPU), no estimate;
- gpu2 ``over``: ``#GPUSHARE mem=2G``, peaks at 4000 MiB for 4 s: would have shared as shard:3 (cap 3 GiB),
  over it, and the backstop (grace 1 s, tolerance 512 MiB) would have stopped it;
- gpu2 ``none``: no directive: no estimate (``without_estimate = "exclusive"``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devcluster.multihost import Host, SIM_DIR, read_description
from gpushare.slurm import record as record_format

pytestmark = [pytest.mark.slurm, pytest.mark.multihost]
SIMJOB = Path(__file__).parents[1] / "agent" / "simjob.py"  # a GPU process on the simulated backend
ALICE = "gpushare-alice"
SETTINGS = (f'\n[agent]\ndevice_backend = "sim:{SIM_DIR}/sim.json"\nbackstop_grace_s = 1.0\nsample_period_s = 0.25\n'
            'window_samples = 4\nflush_every_s = 1.0\n'
            '\n[policy]\nmode = "observe"\nwithout_estimate = "exclusive"\n')
JOBS = {  # name -> (node, GPUs, directive, simjob arguments)
    "fits": ("gpu1", 1, "mem=8G", "--mem-mib 3000 --seconds 3"),
    "multi": ("gpu1", 2, None, "--mem-mib 2000 --seconds 2"),
    "over": ("gpu2", 1, "mem=2G", "--mem-mib 4000 --seconds 4"),
    "none": ("gpu2", 1, None, "--mem-mib 1000 --seconds 2"),
}


def two_gpu_nodes() -> tuple[Host, ...]:
    """The shipped description with its MIG node replaced by a second plain GPU node of two A100-40GB."""
    hosts = [h for h in read_description() if not h.mig]
    taken = {h.address for h in hosts}
    address = next(f"127.0.10.{n}" for n in range(5, 100) if f"127.0.10.{n}" not in taken)
    return (*hosts, Host(name="gpu2", address=address, roles=("gpu",), gpu="a100-40gb", gpus=2))


def _script(cluster, gpus: int, directive: str | None, args: str) -> str:  # type: ignore[no-untyped-def]
    line = f"#GPUSHARE {directive}\n" if directive else ""
    return (f"#!/bin/sh\n#SBATCH --gres=gpu:{gpus}\n#SBATCH --output=/tmp/job-%j.out\n{line}"
            f"{cluster.bin_dir}/python {SIMJOB} {args}\n")


def _row(cluster, job_id: int) -> tuple[str, str, dict]:  # type: ignore[no-untyped-def]
    """The database's newest row of the job, read on the login host: (state, node, our stored record)."""
    rows = cluster.run("login", ["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o",
                                 "State,NodeList,AdminComment,SystemComment"], check=False).stdout.strip().splitlines()
    if not rows:
        return "", "", {}
    state, node, admin, system = (rows[-1].split("|") + ["", "", "", ""])[:4]
    return state.split()[0] if state else "", node, record_format.stored(admin, system) or {}


def _done(cluster, job_id: int) -> bool:  # type: ignore[no-untyped-def]
    state, _, record = _row(cluster, job_id)
    return state in ("COMPLETED", "FAILED") and "exit" in (record.get("run") or {})


def test_pilot_report_counts_the_records_of_two_gpu_nodes_on_the_login_host(multihost):
    cluster = multihost(SETTINGS, agents=True, accounting=True, hosts=two_gpu_nodes())
    for host in ("gpu1", "gpu2"):
        cluster.wait_for(lambda h=host: cluster.agent_up(h), 20, f"the agent on {host}")
    ids = {name: cluster.sbatch("login", ALICE, _script(cluster, gpus, directive, args), f"--nodelist={node}")
           for name, (node, gpus, directive, args) in JOBS.items()}
    for name, job in ids.items():
        cluster.wait_for(lambda j=job: _done(cluster, j), 150, f"the {name} job {job} did not end with its record")
    for name, job in ids.items():  # each ran where the truth says, and observe changed no request
        state, node, record = _row(cluster, job)
        assert (state, node, record.get("decision")) == ("COMPLETED", JOBS[name][0], "observe"), (name, record)
    done = cluster.run("login", ["gpushare", "pilot", "report", "--since", "1h", "--json", "--no-what-if"])
    doc = json.loads(done.stdout)
    assert doc["coverage"] == {"jobs": 4, "with_estimate": 2, "sources": {"directive": 2}, "without_estimate": 2,
                               "reasons": {"multi-GPU kept whole": 1, "no estimate (exclusive)": 1}}, doc["coverage"]
    assert doc["sharing"]["jobs"] == 2, doc["sharing"]
    safety = doc["safety"]
    assert (safety["eligible"], safety["measured"], safety["over_cap"], safety["backstop_stops"]) == (2, 2, 1, 1), safety
    [over] = safety["over"]
    assert over["job"] == str(ids["over"]) and over["cap_gib"] == 3.0  # gpu2's measured peak and backstop
    assert over["peak_gib"] == pytest.approx(4000 / 1024, abs=0.05)
    fits = {p["job"]: p for p in safety["points"]}[str(ids["fits"])]  # gpu1's
    assert fits["cap_gib"] == 9.0 and not fits["over"]
    assert fits["peak_gib"] == pytest.approx(3000 / 1024, abs=0.05)
