"""Our job record beside a site's own summary in the database's AdminComment, on a real Slurm with slurmdbd.

Princeton's jobstats stores its summary from an EpilogSlurmctld with an unconditional ``sacctmgr -i update job
where jobid=N set AdminComment=JS1:<base64>``. The site's programs here are stand-ins that write exactly that,
chained with ours by the wrappers ``gpushare slurm-config --install-chains`` writes (the site's program first),
as a site would install them. Two jobs run at once, one per order of the two writes:

- ``js1-first``: the site's node Epilog waits until the database shows the site's summary, so ours is stored
  after it;
- ``ours-first``: the site's EpilogSlurmctld waits until our final run summary is stored (Princeton's script
  sleeps five seconds for slurmdbd; waiting for the write makes the order certain), then overwrites.

Both summaries survive: the site's AdminComment is exactly what its command stored, and ``gpushare jobstats``
reads our decision and run summary back as the job's owner. Each stand-in logs what it saw, so the test knows
the order really happened. One cluster for the module; the two jobs take about ten seconds.

The same site then pilots gpushare (``[policy] mode = "observe"``, reloaded with SIGHUP): a job that outgrows
the cap it would have had runs to its end on its whole GPU, and its stored record says the share and cap it
would have had and that the backstop would have stopped it (gpushare.policy.observe).
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import accounting
from devcluster.local_cluster import ensure_login_user, missing_requirements
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm import record as record_format
from gpushare.slurm_plugins.slurm_config import install_chains

pytestmark = pytest.mark.slurm
BIN_DIR = os.path.dirname(sys.executable)
SIMJOB = Path(__file__).parents[1] / "agent" / "simjob.py"
ORDERS = ("js1-first", "ours-first")
PATH = "export PATH=/usr/bin:/bin:/usr/sbin:/sbin"
SEP = "\x1f"

# Princeton jobstats' slurm/slurmctldepilog.sh, its write verbatim; the summary comes from the plan file
# instead of `jobstats -f -b`, and `sleep 5s` becomes a wait for our stored summary in the ours-first order.
SITE_EPILOG_SLURMCTLD = """#!/bin/sh
{path}
export SLURM_CONF='{conf}'
plan='{base}/site/'$SLURM_JOB_ID
[ -r "$plan" ] || exit 0
read ORDER STATS < "$plan"
if [ "$ORDER" = ours-first ]; then
  i=0
  until sacct -n -P -X -D -j $SLURM_JOB_ID -o SystemComment | grep -q '`fin`:1'; do
    i=$((i+1)); [ $i -gt 150 ] && break; sleep 0.2
  done
  [ $i -gt 150 ] || echo "$SLURM_JOB_ID saw ours" >> '{base}/site/seen'
fi
OUT="`sacctmgr -i update job where jobid=$SLURM_JOB_ID set AdminComment=JS1:$STATS 2>&1`"
[ $? = 0 ] || echo "$SLURM_JOB_ID sacctmgr: $OUT" >> '{base}/site/seen'
exit 0
"""

# A site's node Epilog that, in the js1-first order, ends only once the site's summary is in the database.
SITE_EPILOG = """#!/bin/sh
{path}
export SLURM_CONF='{conf}'
plan='{base}/site/'$SLURM_JOB_ID
[ -r "$plan" ] || exit 0
read ORDER STATS < "$plan"
[ "$ORDER" = js1-first ] || exit 0
i=0
until sacct -n -P -X -D -j $SLURM_JOB_ID -o AdminComment | grep -qi '^js1:'; do
  i=$((i+1)); [ $i -gt 150 ] && exit 0; sleep 0.2
done
echo "$SLURM_JOB_ID saw js1" >> '{base}/site/seen'
exit 0
"""


def princeton_summary(job: int) -> str:
    """What `jobstats -f -b` prints: base64 of gzip'd JSON (mixed case, '+', '/' and '=' included)."""
    stats = {"gpus": 1, "nodes": {"n1": {"cpus": 1, "gpu_total_memory": {"0": 42949672960},
                                         "gpu_used_memory": {"0": 3145728000}, "gpu_utilization": {"0": 61.5}}},
             "total_time": 4, "job": job}
    return base64.b64encode(gzip.compress(json.dumps(stats).encode(), mtime=0)).decode()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, acct: Any) -> Iterator[Any]:
    problem = missing_requirements() or accounting.missing_requirements()
    if problem:
        pytest.skip(f"real Slurm with accounting unavailable: {problem}")
    owner = ensure_login_user()
    base = Path(tempfile.mkdtemp(prefix="gpushare-js1-", dir="/tmp"))
    os.chmod(base, 0o755)
    SimBackend.from_scenario(acct.agent.two_gpus(), base / "sim.json")

    class SiteCluster(acct.agent.AgentCluster):  # type: ignore[misc, name-defined]
        """The site's Epilog and EpilogSlurmctld in slurm.conf, chained with ours as slurm-config writes it."""

        def _slurm_conf(self, cfg: Any) -> str:
            text = super()._slurm_conf(cfg)
            bin_dir = self.base / "bin"
            site = {}
            for key, body in (("EpilogSlurmctld", SITE_EPILOG_SLURMCTLD), ("Epilog", SITE_EPILOG)):
                program = bin_dir / f"site-{key.lower()}"
                program.write_text(body.format(path=PATH, conf=self.conf, base=self.base))
                program.chmod(0o755)
                site[key] = str(program)
            chains = install_chains(site, str(bin_dir), bin_dir)
            return "\n".join(f"{line.partition('=')[0]}={chains[line.partition('=')[0]]}"
                             if line.partition("=")[0] in chains else line for line in text.splitlines()) + "\n"

    made = SiteCluster(base, bin_dir=BIN_DIR, toml_extra=acct.agent_toml(base, "backstop_grace_s = 1.0\n"),
                       accounting=True, accounting_users=("root", owner.pw_name))
    (base / "site").mkdir(mode=0o755)
    (base / "site" / "seen").touch(mode=0o666)
    os.chmod(base / "site" / "seen", 0o666)
    made.owner = owner
    with acct.running(made, request, more_logs=[base / "site" / "seen"]):
        yield made


def _row(cluster: Any, job: int) -> tuple[str, str, str]:
    """(State, SystemComment, AdminComment) of the job's newest run, as root reads the database."""
    out = subprocess.run(cluster.argv(["sacct", "-n", "-P", f"--delimiter={SEP}", "-X", "-D", "-j", str(job),
                                       "-o", "State,SystemComment,AdminComment"]),
                         capture_output=True, text=True, env=cluster.env).stdout.strip().splitlines()
    parts = out[-1].split(SEP, 2) if out else []
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", "", "")


@pytest.fixture(scope="module")
def jobs(cluster: Any) -> Iterator[dict[str, tuple[int, str]]]:
    """One shared job per order, running at once; each held until its plan for the site's programs is written."""
    out = Path(tempfile.mkdtemp(prefix="gpushare-js1-out-"))
    os.chmod(out, 0o777)
    as_owner = ("-H", "--gres=gpu:1", f"--uid={cluster.owner.pw_uid}", f"--gid={cluster.owner.pw_gid}", "-D",
                str(out), "-o", str(out / "job-%j.out"), f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}")
    body = f"#!/bin/sh\n#GPUSHARE mem=8G\n'{sys.executable}' '{SIMJOB}' --mem-mib 3000 --seconds 3\n"
    made = {}
    started = time.monotonic()
    for order in ORDERS:
        job = cluster.client.sbatch(*as_owner, script=body)[0]
        made[order] = (job, princeton_summary(job))
        (cluster.base / "site" / str(job)).write_text(f"{order} {made[order][1]}\n")
        cluster.client.release(job)

    def settled(job: int) -> bool:
        state, system, admin = _row(cluster, job)
        found = record_format.parse(system) or {}
        return (state.startswith("COMPLETED") and admin.lower().startswith("js1:")
                and (found.get("run") or {}).get("fin") == 1)

    for order, (job, _) in made.items():
        cluster.wait_for(lambda job=job: settled(job), 90, f"the {order} job {job} did not settle")
    time.sleep(1.0)  # anything still on its way to the database lands before the reads below
    sys.stderr.write(f"both orders settled in {time.monotonic() - started:.1f} s\n")
    yield made
    shutil.rmtree(out, ignore_errors=True)


def test_the_orders_really_happened(cluster, jobs):
    seen = (cluster.base / "site" / "seen").read_text().split("\n")
    assert f"{jobs['js1-first'][0]} saw js1" in seen  # the site's node Epilog held ours until JS1 was stored
    assert f"{jobs['ours-first'][0]} saw ours" in seen  # the site's EpilogSlurmctld overwrote after ours
    assert "sacctmgr" not in " ".join(seen)


@pytest.mark.version_sensitive("sacctmgr keeps a stored AdminComment's case from 23.02 on; 22.05 lower-cases it")
@pytest.mark.parametrize("order", ORDERS)
def test_both_summaries_survive(cluster, jobs, order):
    job, stats = jobs[order]
    state, system, admin = _row(cluster, job)
    site = f"JS1:{stats}"
    # the site's summary is exactly what its command stored: sacctmgr of 22.05 lowercases what it stores
    assert admin == (site if cluster.slurm_at_least("23.02") else site.lower())
    ours = record_format.parse(system)
    assert ours is not None and ours["decision"] == "shared" and ours["run"]["fin"] == 1
    assert ours["run"]["exit"] == 0 and 2.5 < ours["run"]["peak_gib"] < 3.5

    doc = json.loads(subprocess.run(
        cluster.user_argv(cluster.owner.pw_name, [f"{BIN_DIR}/gpushare", "jobstats", str(job), "--json"]),
        capture_output=True, text=True, env=cluster.env, timeout=60, check=True).stdout)
    assert doc["recorded"] and not doc["partial"] and doc["decision"] == "shared"
    assert doc["gres"].startswith("shard:") and 2.5 < doc["peak_gib"] < 3.5

    live = cluster.client.job(job)  # slurmctld's own copy is never touched by sacctmgr
    assert live is not None and (record_format.parse(live.admin_comment) or {}).get("decision") == "shared"


def test_observe_mode_on_the_node_records_the_cap_and_the_stop_it_did_not_make(cluster, jobs):
    text = cluster.gpushare_conf.read_text()
    assert "\n[policy]\n" in text  # the agent test clusters' own [policy] section
    cluster.gpushare_conf.write_text(text.replace("\n[policy]\n", '\n[policy]\nmode = "observe"\n', 1))
    log = cluster.base / "log" / "submitd.log"
    reloads = log.read_text().count("configuration reloaded")
    os.kill(cluster.pids["submitd"], signal.SIGHUP)
    cluster.wait_for(lambda: log.read_text().count("configuration reloaded") > reloads, 15, "submitd did not reload")

    out = Path(tempfile.mkdtemp(prefix="gpushare-observe-out-", dir="/tmp"))  # the job's user writes here
    os.chmod(out, 0o777)
    started = time.monotonic()
    job = cluster.client.sbatch("--gres=gpu:1", f"--uid={cluster.owner.pw_uid}", f"--gid={cluster.owner.pw_gid}",
                                "-D", str(out), "-o", str(out / "job-%j.out"),
                                f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}",
                                script=f"#!/bin/sh\n#GPUSHARE mem=2G\n'{sys.executable}' '{SIMJOB}' --mem-mib 6000 "
                                       "--seconds 5\n")[0]

    def stored() -> dict[str, Any]:
        state, system, admin = _row(cluster, job)
        found = record_format.stored(admin, system) or {}
        return found if state.startswith("COMPLETED") and (found.get("run") or {}).get("fin") else {}

    cluster.wait_for(lambda: bool(stored()), 90, f"the observed job {job} did not finish with a stored record")
    sys.stderr.write(f"observed job stored in {time.monotonic() - started:.1f} s\n")
    found = stored()
    assert found["decision"] == "observe" and found["would"] == "shared"  # its request was left alone
    assert found["run"]["exit"] == 0 and found["run"]["peak_gib"] > 5.5  # ran to its end on its whole GPU
    cap = found["run"]["would"]["cap_gib"]
    assert 2.0 <= cap <= 4.0 and found["run"]["would"]["stop"] == "backstop"
    assert "cap_gib" not in found["run"]  # no cap was applied
    agent_log = (cluster.base / "log" / "agent.log").read_text()
    assert f"job {job}: observe mode: the backstop would have stopped it" in agent_log
    text_out = subprocess.run(
        cluster.user_argv(cluster.owner.pw_name, [f"{BIN_DIR}/gpushare", "jobstats", str(job)]),
        capture_output=True, text=True, env=cluster.env, timeout=60, check=True).stdout
    assert "observe mode: it would have shared a GPU as shard:" in text_out
    assert "the backstop would have stopped it at" in text_out
    shutil.rmtree(out, ignore_errors=True)


def test_jobstats_of_a_running_job_reads_the_agent_on_its_node(cluster, jobs):
    """The owner, on the job's node (here the one host), gets the measurements so far from the agent's live
    socket (gpushare.agent.live_api) instead of waiting for the job's end."""
    out = Path(tempfile.mkdtemp(prefix="gpushare-live-out-", dir="/tmp"))
    os.chmod(out, 0o777)
    job = cluster.client.sbatch("--gres=gpu:1", f"--uid={cluster.owner.pw_uid}", f"--gid={cluster.owner.pw_gid}",
                                "-D", str(out), "-o", str(out / "job-%j.out"),
                                f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}",
                                script=f"#!/bin/sh\n#GPUSHARE mode=exclusive\n'{sys.executable}' '{SIMJOB}' "
                                       "--mem-mib 3000 --seconds 12\n")[0]

    def jobstats() -> str:
        return subprocess.run(cluster.user_argv(cluster.owner.pw_name, [f"{BIN_DIR}/gpushare", "jobstats", str(job)]),
                              capture_output=True, text=True, env=cluster.env, timeout=60).stdout

    cluster.wait_for(lambda: "used at most 2.9" in jobstats(), 40, f"no live measurement of job {job}")
    text = jobstats()
    assert "RUNNING" in text and "(measured so far, live from the agent on its node)" in text
    cluster.client.run("scancel", str(job))  # seen live: the rest of its run tells nothing more
    cluster.wait_job(job)
    shutil.rmtree(out, ignore_errors=True)
