"""Job records that outlive the GPU node: a real Slurm with its accounting database (MariaDB + slurmdbd of the
running release, devcluster.accounting), three jobs of an ordinary user, the node's local state wiped, then
``gpushare jobstats`` and ``gpushare simulate --sacct`` reading only Slurm.

One cluster for the module (starting MariaDB and slurmdbd costs seconds): the jobs run once, every test reads
what they left. Shipped defaults except the agent's simulated GPUs and its quick sampling (tests/agent).
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
from devcluster.slurm_runtime import own_by_slurm
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm import record as record_format

pytestmark = pytest.mark.slurm
BIN_DIR = os.path.dirname(sys.executable)
SIMJOB = Path(__file__).parents[1] / "agent" / "simjob.py"
OTHER_USER = "gpushare-test2"


def script(directive: str, args: str) -> str:
    return f"#!/bin/sh\n#GPUSHARE {directive}\n'{sys.executable}' '{SIMJOB}' {args}\n"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, acct: Any) -> Iterator[Any]:
    problem = missing_requirements() or accounting.missing_requirements()
    if problem:
        pytest.skip(f"real Slurm with accounting unavailable: {problem}")
    owner, other = ensure_login_user(), ensure_login_user(OTHER_USER)
    base = Path(tempfile.mkdtemp(prefix="gpushare-acct-", dir="/tmp"))
    os.chmod(base, 0o755)
    SimBackend.from_scenario(acct.agent.two_gpus(), base / "sim.json")
    made = acct.agent.AgentCluster(base, bin_dir=BIN_DIR, toml_extra=acct.agent_toml(base), accounting=True,
                                   accounting_users=("root", owner.pw_name, other.pw_name),
                                   mail_prog=str(base / "bin" / "mailprog"))
    write_mail_programs(base, made)
    made.owner, made.other = owner, other
    with acct.running(made, request):
        yield made


def write_mail_programs(base: Path, cluster: Any) -> None:
    """slurm.conf's MailProg: gpushare's wrapper (as docs/agent.md shows it) in front of a mail program that
    writes each mail to ``base/mail`` (arguments, then the body). slurmctld runs MailProg as SlurmUser, so the
    mail folder and the wrapper's log are that account's."""
    (base / "bin").mkdir(parents=True, exist_ok=True)
    own_by_slurm(base / "mail", 0o755)
    own_by_slurm(base / "log" / "mailprog.log", 0o644, directory=False)
    fake = base / "bin" / "fake-mail"
    fake.write_text(f"#!/bin/sh\n{{ printf '%s\\n' \"$@\"; cat; }} > '{base}/mail/'$(date +%s%N).txt\n")
    wrapper = base / "bin" / "mailprog"
    wrapper.write_text(f"#!/bin/sh\nexport SLURM_CONF='{cluster.conf}' GPUSHARE_CONFIG='{cluster.gpushare_conf}'\n"
                       f"exec '{sys.executable}' -m gpushare.epilog.mailprog --mail '{fake}' --wait-s 30 \"$@\" "
                       f"2>>'{base}/log/mailprog.log'\n")
    for script_path in (fake, wrapper):
        script_path.chmod(0o755)


@pytest.fixture(scope="module")
def jobs(cluster: Any) -> dict[str, int]:
    """A shared job, an OOM-recovered job and an exclusive job of one user, finished; then the GPU node's
    records and agent state are wiped, as on a reinstalled node."""
    out = Path(tempfile.mkdtemp(prefix="gpushare-acct-out-"))
    os.chmod(out, 0o777)
    as_owner = ("--gres=gpu:1", f"--uid={cluster.owner.pw_uid}", f"--gid={cluster.owner.pw_gid}", "-D", str(out),
                "-o", str(out / "job-%j.out"), "--open-mode=append",
                f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}")
    mail = ("--mail-type=END", f"--mail-user={cluster.owner.pw_name}")
    ids = {"shared": cluster.client.sbatch(*as_owner, *mail, script=script("mem=8G", "--mem-mib 3000 --seconds 3"))[0],
           "oom": cluster.client.sbatch(*as_owner, script=script(
               "mem=4G", "--mem-mib 4300 --seconds 3 --oom-first-run"))[0],
           "exclusive": cluster.client.sbatch(*as_owner, script=script(
               "mode=exclusive", "--mem-mib 5000 --seconds 3 --smact 0.6"))[0]}
    for name, job in ids.items():  # the OOM job's first run also ends with a stored summary: wait for its rerun
        cluster.wait_for(lambda: _done(cluster, job, rerun=name == "oom"), 150, f"the {name} job {job} did not finish")
    cluster.stop_agent()
    cfg = cluster.agent_cfg()
    for directory in (cfg.records_dir, cfg.state_dir):
        shutil.rmtree(directory, ignore_errors=True)
    yield ids
    shutil.rmtree(out, ignore_errors=True)


def _done(cluster: Any, job: int, rerun: bool = False) -> bool:
    """Finished in the database with a stored run summary; with ``rerun``, the run after an OOM recovery
    (COMPLETED, the record holding the recovery), not the failed first one."""
    found = subprocess.run(cluster.argv(["sacct", "-n", "-P", "-X", "-j", str(job), "-o", "State,AdminComment"]),
                           capture_output=True, text=True, env=cluster.env).stdout.strip().splitlines()
    if not found:
        return False
    state, _, comment = found[-1].partition("|")
    record = record_format.parse(comment) or {}
    if rerun and (state.split()[0] != "COMPLETED" or "oom" not in record):
        return False
    return state.split()[0] in ("COMPLETED", "FAILED") and "run" in record and "exit" in record["run"]


def jobstats(cluster: Any, user: str, job: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cluster.user_argv(user, [f"{BIN_DIR}/gpushare", "jobstats", str(job), "--json"]),
                          capture_output=True, text=True, env=cluster.env, timeout=60)


def test_the_owner_reads_each_jobs_summary_and_advice_from_slurm_alone(cluster, jobs):
    assert not Path(cluster.agent_cfg().records_dir).exists()  # nothing left on the node
    docs = {}
    for name, job in jobs.items():
        done = jobstats(cluster, cluster.owner.pw_name, job)
        assert done.returncode == 0, done.stderr
        docs[name] = json.loads(done.stdout)
    shared, oom, exclusive = docs["shared"], docs["oom"], docs["exclusive"]
    assert (shared["state"], shared["decision"], shared["share_gib"]) == ("COMPLETED", "shared", 9.0), shared
    assert shared["peak_gib"] == pytest.approx(3000 / 1024, abs=0.05) and shared["ttfk_s"] is not None
    assert shared["energy_j"] is not None and shared["user"] == cluster.owner.pw_name
    assert list(shared["gpus"].values())[0]["smact_pct"] > 0  # the GPU's, shared with the OOM job's first run
    assert shared["advice"] == "this job peaked at 2.93 GiB of its 9 GiB share: next time `#GPUSHARE mem=3G`"

    assert (oom["state"], oom["runs"]) == ("COMPLETED", 2), oom
    assert oom["oom"]["from"].endswith("shard:5") and oom["oom"]["n"] == 1
    assert oom["advice"].startswith("an OOM was recovered: the learned floor is now 7.5 GiB"), oom["advice"]

    assert (exclusive["state"], exclusive["decision"]) == ("COMPLETED", "exclusive"), exclusive
    assert exclusive["gres"].startswith("gpu:") and exclusive["share_gib"] == 40.0
    assert exclusive["advice"] == ("this job peaked at 4.88 GiB of a whole 40 GiB GPU: next time "
                                   "`#GPUSHARE mem=5G` lets it share; a 2g.10gb slice would have held it")
    text = subprocess.run(cluster.user_argv(cluster.owner.pw_name, [f"{BIN_DIR}/gpushare", "jobstats",
                                                                    str(jobs["shared"])]),
                          capture_output=True, text=True, env=cluster.env, timeout=60).stdout
    assert "used at most 2.93 GiB (33 % of it)" in text and "Advice: this job peaked at 2.93 GiB" in text


def test_the_export_gives_each_run_its_gpu_fraction_in_every_format(cluster, jobs):
    """``gpushare jobstats --format`` as the owner, from Slurm alone: the shared job's shard:9 of a 40 GiB GPU is
    0.225 of a GPU (where XDMoD, counting gres/gpu, sees none), the exclusive job's whole GPU is 1, and the OOM
    job's two runs each get their own size; the xdmod lines are XDMoD's 26 fields with the fraction added."""
    ids = ",".join(str(job) for job in jobs.values())

    def export(fmt: str) -> str:
        done = subprocess.run(cluster.user_argv(cluster.owner.pw_name, [f"{BIN_DIR}/gpushare", "jobstats", "--format",
                                                                        fmt, *ids.split(",")]),
                              capture_output=True, text=True, env=cluster.env, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    doc = json.loads(export("json"))
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in doc["jobs"]:
        rows.setdefault(row["job_id_raw"], []).append(row)
    [shared] = rows[str(jobs["shared"])]
    assert (shared["shards"], shared["basis"], shared["gpu_fraction"]) == (9, "shards", 0.225), shared
    assert shared["gpu_hours"] == pytest.approx(0.225 * shared["elapsed_s"] / 3600, abs=1e-6)
    assert shared["peak_gib"] == pytest.approx(3000 / 1024, abs=0.05) and shared["decision"] == "shared"
    [exclusive] = rows[str(jobs["exclusive"])]
    assert (exclusive["gpus"], exclusive["basis"], exclusive["gpu_fraction"]) == (1, "gres/gpu", 1.0), exclusive
    first, second = rows[str(jobs["oom"])]
    assert first["shards"] == 5 and first["gpu_fraction"] == 0.125 and second["gpu_fraction"] > 0.125, (first, second)
    assert doc["gpu_hours"] == pytest.approx(sum(r["gpu_hours"] for r in doc["jobs"]), abs=1e-5)
    lines = export("csv").splitlines()
    assert lines[0].startswith("job,job_id_raw,user,") and len(lines) == 1 + len(doc["jobs"])
    xdmod = {line.split("|")[1]: line.split("|") for line in export("xdmod").splitlines()}
    assert all(len(fields) == 26 for fields in xdmod.values())
    assert "gres/gpu=0.225" in xdmod[str(jobs["shared"])][22] and "gres/shard=9" in xdmod[str(jobs["shared"])][22]
    assert "gres/gpu=1" in xdmod[str(jobs["exclusive"])][22]


def test_another_user_cannot_read_them(cluster, jobs):
    for job in jobs.values():
        done = jobstats(cluster, cluster.other.pw_name, job)
        assert done.returncode == 1 and "not yours to read" in done.stderr, (done.stdout, done.stderr)


def test_simulate_replays_the_databases_own_sacct_json(cluster, jobs, tmp_path):
    export = subprocess.run(cluster.argv(["sacct", "-X", "--json", "-a", "-S", "now-1hour"]),
                            capture_output=True, text=True, env=cluster.env, timeout=60)
    assert export.returncode == 0, export.stderr
    path = tmp_path / "sacct.json"
    path.write_text(export.stdout)
    done = subprocess.run([f"{BIN_DIR}/gpushare", "simulate", "--sacct", str(path), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["summary"]["jobs"] >= 3, result["summary"]


def test_the_end_of_job_mail_carries_the_summary(cluster, jobs):
    """slurmctld (real, of this release) calls MailProg as the job ends, before the Epilogs: the wrapper waits
    for the stored record and appends the summary to the mail it passes on."""
    subject = f"Job_id={jobs['shared']} "

    def mail() -> str:
        for path in sorted((cluster.base / "mail").glob("*.txt")):
            text = path.read_text()
            if subject in text:
                return text
        return ""

    cluster.wait_for(lambda: bool(mail()), 40, "no end-of-job mail")
    text = mail()
    assert text.splitlines()[0] == "-s" and "Ended" in text.splitlines()[1]
    assert text.splitlines()[2] == cluster.owner.pw_name
    assert f"Job {jobs['shared']} ({cluster.owner.pw_name}): COMPLETED" in text
    assert "Advice: this job peaked at 2.93 GiB of its 9 GiB share" in text
