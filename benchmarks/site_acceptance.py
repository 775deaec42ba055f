"""gpushare installed beside real sites' published Slurm files (benchmarks/site_corpus.json), by the book.

For each site, on a test cluster of this machine (devcluster.LocalCluster: slurmctld as ``slurm``, slurmd as
root, one node n1 with two simulated 40 GiB GPUs, gpushare-submitd running), at the Slurm release
``$GPUSHARE_TEST_SLURM`` names:

1. *site alone*: the site's files are installed as the site installs them (its folder stands for /etc/slurm:
   hook lines in slurm.conf, job_submit.lua beside it, helper modules where its package.path finds them), the
   daemons restarted, and the site's scenario run: jobs its rules reject, jobs its rules rewrite, jobs that run
   through its Prolog/Epilog;
2. *with gpushare*: docs/deployment.md's install: ``gpushare slurm-config --install-lua --install-hooks
   --install-chains``, its hook lines pasted into slurm.conf, the two printed lines added to the site's
   job_submit.lua (the call after the site's own checks), ``scontrol reconfigure``; the same scenario again,
   which must give the same site outcomes, plus ours acting on a job with ``#GPUSHARE mem=4G`` (its GRES
   rewritten to shards), the node not drained;
3. *removed*: ``gpushare slurm-config --uninstall`` followed as printed, the two lines taken out, our files
   deleted (the page's step 4), ``scontrol reconfigure``: the site's files and slurm.conf are byte for byte
   what they were before step 2.

Prints one row per site (``--json`` for the whole record). Needs root and a Slurm the test clusters run
(docs/testing.md). Corpus: re-created by benchmarks/site_corpus.py into ``--corpus`` (default
/var/tmp/gpushare-site-corpus) unless already there.

    GPUSHARE_TEST_SLURM=22.05 python benchmarks/site_acceptance.py [--site NAME ...] [--mirrors DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from devcluster.admin_steps import apply_uninstall, paste  # noqa: E402
from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster, ensure_login_user  # noqa: E402
from devcluster.processes import scaled  # noqa: E402
from gpushare.slurm.gres_request import plain_gres  # noqa: E402
from gpushare.slurm.jobs import ENDED_STATES  # noqa: E402
from gpushare.slurm_plugins.decision import parse_record  # noqa: E402
from gpushare.slurm_plugins.slurm_config import site_lua_lines  # noqa: E402
from site_corpus import DEFAULT_DEST, blob_hash, load_list, recreate  # noqa: E402

HOOK_KEYS = ("Prolog", "Epilog", "TaskProlog", "TaskEpilog", "EpilogSlurmctld", "MailProg")
PASTED_KEYS = (*HOOK_KEYS, "JobSubmitPlugins")
SHARED = "#!/bin/sh\n#GPUSHARE mem=4G\n"


@dataclass
class SiteCluster(LocalCluster):
    """A LocalCluster whose slurmctld finds the site's Lua helper modules in the site's folder, as the site's
    package.path finds them in its /etc/slurm (LUA_PATH: Lua's own search path, ahead of the default)."""

    lua_dir: str = ""
    gpu_partition: str = "gpu"  # the partition of the GPU node in gpushare.toml's [[nodes]], as the site names it

    def _toml_text(self) -> str:
        return super()._toml_text().replace('partition = "gpu"', f'partition = "{self.gpu_partition}"')

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        if self.lua_dir:
            env["LUA_PATH"] = f"{self.lua_dir}/?.lua;;"
        return env


@dataclass
class Outcome:
    label: str
    alone: str = ""
    ours: str = ""
    same: bool = True  # the site's outcome is the same with gpushare installed


@dataclass
class Run:
    site: dict
    cluster: SiteCluster
    etc: Path
    work: Path
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    phase: str = "alone"
    lua_error: str = ""  # the slurmctld error line of the last submission's Lua failure, if any

    # --- jobs -------------------------------------------------------------------------------------
    def submit(self, *args: str, script: str = "#!/bin/sh\ntrue\n", user: str | None = None) -> tuple[str | None, str]:
        """sbatch as root (or ``user``): (job id, "") or (None, what sbatch said)."""
        argv = ["sbatch", "--parsable", "-D", str(self.work), "-o", str(self.work / "job-%j.out"), *args]
        argv = self.cluster.user_argv(user, argv) if user else self.cluster.argv(argv)
        before = self.lua_errors()
        proc = subprocess.run(argv, input=script, capture_output=True, text=True, env=self.cluster.env,
                              timeout=scaled(60))
        # 22.05 accepts a job whose slurm_job_submit raised a Lua error, as far as it got (rc stays 0)
        self.lua_error = next(iter(self.lua_errors()[len(before):]), "")
        if proc.returncode != 0:
            return None, " ".join(proc.stderr.split())
        return proc.stdout.strip().split(";")[0], ""

    def lua_errors(self) -> list[str]:
        log = self.cluster.base / "log" / "slurmctld.log"
        return [re.sub(r"^\[[^]]*\] ", "", line)[:240] for line in log.read_text(errors="replace").splitlines()
                if "job_submit" in line and "error" in line] if log.exists() else []

    def show(self, job_id: str) -> dict[str, str]:
        return self.cluster.client.show_job_text(job_id)

    def finish(self, job_id: str, timeout_s: float = 90) -> tuple[str, str]:
        """Wait for the job's end: (state, its output). A job whose launch failed (a Prolog that failed: the node
        drained, the job requeued held) is that state, cancelled, and the node resumed."""
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            job = self.cluster.client.job(job_id)
            if job is None or job.state in ENDED_STATES and "COMPLETING" not in job.states:
                break
            if "launch failed" in job.reason.lower() or "held" in job.reason.lower():  # 22.05: JobHeldUser
                self.cancel(job_id)
                self.node_up()
                return "launch failed, requeued held", ""
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not end: {job.states} {job.reason}")
            time.sleep(0.3)
        state = job.state if job else self.cluster.wait_job(job_id).state
        out = self.work / f"job-{job_id}.out"
        return state, out.read_text(errors="replace") if out.exists() else ""

    def cancel(self, job_id: str) -> None:
        self.cluster.client.run("scancel", job_id, check=False)

    def node_up(self) -> bool:
        state = self.cluster.client.node_states().get("n1", "")
        if "drain" in state or "down" in state:
            self.cluster.client.run("scontrol", "update", "nodename=n1", "state=resume", check=False)
            return False
        return True

    # --- outcomes ---------------------------------------------------------------------------------
    def record(self, label: str, value: str) -> None:
        """The site's outcome of one check in this phase; with gpushare it must equal the site's alone."""
        found = next((o for o in self.outcomes if o.label == label), None)
        if found is None:
            found = Outcome(label)
            self.outcomes.append(found)
        if self.phase == "alone":
            found.alone = value
        else:
            found.ours = value
            found.same = found.ours == found.alone
            if not found.same:
                self.problems.append(f"{label}: site alone '{found.alone}', with gpushare '{found.ours}'")

    def alone(self, label: str) -> str:
        """The site's outcome of one check without gpushare."""
        return next(o.alone for o in self.outcomes if o.label == label)

    def rejected(self, label: str, expect: str, *args: str, script: str = "#!/bin/sh\ntrue\n",
                 user: str | None = None) -> None:
        job_id, said = self.submit(*args, script=script, user=user)
        if job_id is not None:
            self.cancel(job_id)
        self.record(label, f"rejected: {expect}" if job_id is None and expect in said
                    else "accepted" if job_id else f"rejected otherwise: {said[:160]}")

    def ours(self, job_id: str) -> str:
        """What ours did to the job: 'shard:N' when it rewrote it (our record in AdminComment), else the
        decision our record gives, else what the job asks for."""
        text = self.show(job_id)
        found = parse_record(text.get("AdminComment", ""))
        gres = plain_gres(text.get("TresPerNode", ""))
        if found and gres.startswith("shard:"):
            return gres
        if found:
            return f"{found.get('decision')}: {str(found.get('why', ''))[:100]}"
        return f"no record ({gres or 'no GRES'})"

    def shared_job(self, *args: str, script: str = "true\n", user: str | None = None, expect: str = "shard:",
                   state: str = "COMPLETED") -> str:
        """A job with ``#GPUSHARE mem=4G``: ours must act on it (``expect``), it ends in ``state`` (COMPLETED
        unless the site's own files fail every job) and the node stays up; returns its output."""
        job_id, said = self.submit(*args, script=SHARED + script, user=user)
        if job_id is None:
            self.problems.append(f"shared job {' '.join(args)}: rejected: {said[:160]}")
            return ""
        self.ours_acted(job_id, expect)
        ended, out = self.finish(job_id)
        if ended != state or not self.node_up() and state == "COMPLETED":
            self.problems.append(f"shared job {job_id}: {ended}, node {self.cluster.client.node_states().get('n1')}")
        return out

    def ours_acted(self, job_id: str, expect: str = "shard:") -> bool:
        """Our rewrite happened (or, with ``expect``, our record starts so): else a problem naming what did."""
        did = self.ours(job_id)
        if not did.startswith(expect) and self.lua_error:
            self.notes.append(f"job {job_id}: the site's Lua failed before our call ({self.lua_error}); ours {did}")
            return False
        if not did.startswith(expect):
            self.problems.append(f"job {job_id}: ours {did}")
            return False
        return True


# --- the sites' scenarios ------------------------------------------------------------------------
# Each runs in both phases; run.record() keeps the site's outcomes, which must not change with gpushare.
# What ours must do is checked where run.phase == "ours".


def jobstats(run: Run) -> None:
    """Princeton's prolog.d writes /run/gpustat/<GPU index> = "<job> <uid>" for each GPU the job holds and
    epilog.d removes it; slurmctldepilog.sh stores jobstats' summary with sacctmgr (without jobstats and
    slurmdbd here it logs the failure through logger and exits 0, after its `sleep 5s`)."""
    script = "for f in /run/gpustat/*; do read j u < $f; [ \"$j\" = \"$SLURM_JOB_ID\" ] && echo owner-file; done\n"
    watch = Watch(f"{run.etc}/slurmctldepilog.sh")
    job_id, said = run.submit("--gres=gpu:1", script="#!/bin/sh\n" + script)
    assert job_id, said
    state, out = run.finish(job_id)
    run.record("whole-GPU job: state; prolog.d's GPU owner file seen by the job", f"{state}; {'owner-file' in out}")
    run.record("EpilogSlurmctld slurmctldepilog.sh ran", str(watch.seen(scaled(20))))
    run.record("node up after the jobs", str(run.node_up()))
    if run.phase == "ours":
        out = run.shared_job("--gres=gpu:1", script=script)
        run.notes.append("a shared job: prolog.d's GPU owner file "
                         f"{'seen by the job' if 'owner-file' in out else 'not written (no GPU index for a shard job)'}")


class Watch:
    """Whether a program runs, from now on: /proc polled in a thread (slurmctldepilog.sh sleeps 5 s, so it is
    seen however late the job's end is noticed)."""

    def __init__(self, program: str) -> None:
        self.program, self.found, self.stop = program, threading.Event(), threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not (self.found.is_set() or self.stop.is_set()):
            for pid in os.listdir("/proc"):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if self.program.encode() in cmdline:
                    self.found.set()
                    return
            time.sleep(0.05)

    def seen(self, within_s: float) -> bool:
        self.found.wait(within_s)
        self.stop.set()
        return self.found.is_set()


def hcc(run: Run) -> None:
    """HCC's rules: partition gpu needs a GPU GRES ("GPU jobs require --gres=gpu"); a job with a GPU GRES and no
    partition is routed to gpu. Its helper parses job_desc.gres, which it does not understand on 22.05 (there
    "gres:gpu:1"): every -p gpu GPU job is rejected and none is routed."""
    run.rejected("-p gpu, no GRES", "GPU jobs require --gres=gpu", "-p", "gpu")
    job_id, said = run.submit("-p", "gpu", "--gres=gpu:1")
    run.record("-p gpu --gres=gpu:1", run.finish(job_id)[0] if job_id else f"rejected: {said[:100]}")
    job_id, said = run.submit("--gres=gpu:1")
    run.record("--gres=gpu:1 without -p: routed to", run.show(job_id).get("Partition", "") if job_id else said[:100])
    if job_id:
        run.finish(job_id)
    run.record("node up after the jobs", str(run.node_up()))
    if run.phase == "ours":
        routed = run.alone("--gres=gpu:1 without -p: routed to") == "gpu"
        # where the site routes nothing, the job stays in batch, a partition of no [[nodes]] group: ours leaves it
        run.shared_job("--gres=gpu:1", expect="shard:" if routed else "out-of-scope")


def archer2(run: Run) -> None:
    """ARCHER2's rules: a partition and a QoS are required, partition gpu needs --gres=gpu:X, and a GPU job is
    given 32 CPUs a GPU (cpus_per_task), which the test node (2 CPUs) cannot hold: it pends and is cancelled."""
    run.rejected("no -p", "Please specify a partition name", "--qos=gpu")
    run.rejected("-p gpu, no QoS", "Please specify a QoS", "-p", "gpu", "--gres=gpu:1")
    run.rejected("-p gpu --qos=gpu, no GPU", "no GPU specification found", "-p", "gpu", "--qos=gpu")
    job_id, said = run.submit("-p", "gpu", "--qos=gpu", "--gres=gpu:1", script=SHARED + "true\n")
    if job_id is None:
        run.record("-p gpu --qos=gpu --gres=gpu:1: CPUs/Task", f"rejected: {said[:120]}")
        return
    run.record("-p gpu --qos=gpu --gres=gpu:1: CPUs/Task", run.show(job_id).get("CPUs/Task", ""))
    if run.phase == "ours":
        run.ours_acted(job_id)
    run.cancel(job_id)
    run.record("node up after the jobs", str(run.node_up()))


def niflheim(run: Run) -> None:
    """Niflheim's rules (root's jobs pass untouched, so jobs go in as an ordinary user): a partition is
    required, the job name MAINT is reserved, a GPU partition's job must ask for GPUs."""
    user = LOGIN_TEST_USER
    run.rejected("user job, no -p", "", "--gres=gpu:1", user=user)  # ESLURM_INVALID_PARTITION_NAME, no text
    run.rejected("-J MAINT", "JobName=MAINT is reserved", "-p", "a100", "--gres=gpu:1", "-J", "MAINT", user=user)
    job_id, said = run.submit("-p", "a100", "--gres=gpu:1", user=user)
    run.record("-p a100 --gres=gpu:1 (user)", run.finish(job_id)[0] if job_id else f"rejected: {said[:160]}")
    job_id, said = run.submit("-p", "a100", "--gres=gpu:1")
    run.record("root's job -p a100", run.finish(job_id)[0] if job_id else f"rejected: {said[:120]}")
    run.record("node up after the jobs", str(run.node_up()))
    if run.phase == "ours":
        run.shared_job("-p", "a100", "--gres=gpu:1", user=user)
        job_id, said = run.submit("-p", "a100", "--gres=gpu:1", script=SHARED + "true\n")
        if job_id:
            run.notes.append(f"root's jobs return before the site's last line, where ours is called: {run.ours(job_id)}")
            run.finish(job_id)


def softmig(run: Run) -> None:
    """SoftMig's Lua turns gpu:<type>.<n>:1 into shards and refuses several slices; its Prolog (bash, set -euo
    pipefail) reads the job with `scontrol show job --json` and jq and, for a shard job, writes
    /var/run/softmig/<job>.conf, which its Epilog removes."""
    run.rejected("two half-GPU slices", "Multiple GPU slices", "--gres=gpu:a100.2:2")
    job_id, said = run.submit("--gres=gpu:1")
    run.record("whole-GPU job", run.finish(job_id)[0] if job_id else f"rejected: {said[:120]}")
    run.record("node up after a whole-GPU job", str(run.node_up()))
    if run.phase == "ours":  # where the site's Prolog fails every job (alone too), ours fails no more of them
        out = run.shared_job("--gres=gpu:1", script="cat /var/run/softmig/$SLURM_JOB_ID.conf\n",
                             state=run.alone("whole-GPU job"))
        run.notes.append(f"a shared job: SoftMig's Prolog {'wrote' if 'CUDA_DEVICE_MEMORY_LIMIT' in out else 'did not write'}"
                         " its softmig limits for our shards")


def edf(run: Run) -> None:
    """EDF's Epilog.d/00_clean kills a user's leftover processes and /tmp files after the user's last job on the
    node; for root's jobs (uid < 1000, the jobs here: the test machine is shared) it logs and exits 0."""
    job_id, said = run.submit("--gres=gpu:1")
    run.record("job through Epilog=Epilog.d/*", run.finish(job_id)[0] if job_id else f"rejected: {said[:120]}")
    run.record("node up after the job", str(run.node_up()))
    if run.phase == "ours":
        run.shared_job("--gres=gpu:1")


#: name -> (scenario, partition lines beside the cluster's own "gpu" partition, made non-default)
SCENARIOS: dict[str, tuple[Callable[[Run], None], list[str]]] = {
    "princeton-jobstats": (jobstats, []),
    "unl-hcc": (hcc, ["PartitionName=batch Nodes=n1 Default=YES MaxTime=INFINITE State=UP"]),
    "epcc-archer2": (archer2, []),
    "dtu-niflheim": (niflheim, ["PartitionName=a100 Nodes=n1 MaxTime=INFINITE State=UP"]),
    "ualberta-softmig": (softmig, []),
    "edf-hpc": (edf, []),
}


# --- install and removal, as docs/deployment.md says ----------------------------------------------
_MTIME = [time.time()]


def _touch(path: Path) -> None:
    """slurmctld reloads job_submit.lua when its mtime (whole seconds) is newer than the last load."""
    _MTIME[0] = max(_MTIME[0] + 2, time.time() + 2)
    os.utime(path, (_MTIME[0], _MTIME[0]))


def _reconfigure(cluster: LocalCluster, conf: str) -> None:
    cluster.conf.write_text(conf)
    cluster.client.run("scontrol", "reconfigure")
    wanted = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in conf.splitlines()
              if line.split("=", 1)[0] in HOOK_KEYS}
    deadline = time.monotonic() + scaled(30)
    while True:
        shown = cluster.client.run("scontrol", "show", "config", check=False)
        if all(value in shown for key, value in wanted.items() if key in ("Prolog", "Epilog", "EpilogSlurmctld")):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"slurmctld did not take the new hook lines: {wanted}")
        time.sleep(0.3)


def _slurm_config(cluster: LocalCluster, *args: str) -> str:
    argv = [sys.executable, "-m", "gpushare.cli", "slurm-config", "--config", str(cluster.gpushare_conf),
            "--slurm-conf", str(cluster.conf), "--hook-dir", cluster.bin_dir,
            "--slurm-version", cluster.slurm_version, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True, env=cluster.env).stdout


def run_site(site: dict, corpus: Path) -> dict:
    scenario, partitions = SCENARIOS[site["name"]]
    base = Path(tempfile.mkdtemp(prefix="gpushare-site-", dir="/tmp"))
    etc = base / "etc"
    gpu_partition = next((line.split()[0].split("=")[1] for line in partitions if "Default=YES" not in line), "gpu")
    cluster = SiteCluster(base, bin_dir=str(Path(sys.executable).parent), with_hook=False, lua_dir=str(etc),
                          gpu_partition=gpu_partition)
    started = time.monotonic()
    work = base / "work"
    run = Run(site, cluster, etc, work)
    identical = False
    try:
        cluster.start()
        work.mkdir(mode=0o777)
        os.chmod(work, 0o777)
        # the site's own install: its files, its hook lines, its job_submit.lua beside slurm.conf
        for item in site["files"]:
            target = etc / item["install"]
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(corpus / site["name"] / item["path"], target)
            os.chmod(target, int(item["mode"], 8))
        conf = [line for line in cluster.conf.read_text().splitlines() if line.split("=", 1)[0] not in PASTED_KEYS]
        conf = [line.replace(" Default=YES", "") if partitions and line.startswith("PartitionName=gpu ") else line
                for line in conf]
        conf += [line.replace("{site}", str(etc)) for line in site.get("slots", [])] + partitions
        if "lua" in site:
            conf.append("JobSubmitPlugins=lua")
        site_conf = "\n".join(conf) + "\n"
        cluster.conf.write_text(site_conf)
        cluster.restart_slurm()
        cluster._wait(cluster._nodes_idle, scaled(60), "nodes did not come back")
        before = {item["install"]: (etc / item["install"]).read_bytes() for item in site["files"]}
        scenario(run)

        # install, as the page says
        run.phase = "ours"
        printed = _slurm_config(cluster, "--install-lua", str(etc), "--install-hooks", str(etc / "gpushare-hooks"),
                                "--install-chains", str(etc / "gpushare-chains"))
        lines = [line for line in printed.splitlines() if line.split("=", 1)[0] in PASTED_KEYS]
        installed = paste(site_conf, lines)
        lua_file = etc / "job_submit.lua"
        if "lua" in site:
            load, call = site_lua_lines(str(etc))
            text = lua_file.read_text().splitlines(keepends=True)
            at = site["lua"]["call_before"] - 1
            top = 1 if text and text[0].startswith("#") else 0
            text = [*text[:top], load + "\n", *text[top:at], call + "\n", *text[at:]]
            lua_file.write_text("".join(text))
        _touch(lua_file)
        _reconfigure(cluster, installed)
        scenario(run)

        # removal, as the page says
        out = _slurm_config(cluster, "--uninstall")
        removed = apply_uninstall(installed, out)
        if "lua" not in site:
            removed = "".join(line + "\n" for line in removed.splitlines() if line != "JobSubmitPlugins=lua")
        if "lua" in site:
            load, call = site_lua_lines(str(etc))
            lua_file.write_text("".join(line for line in lua_file.read_text().splitlines(keepends=True)
                                        if line.rstrip("\n") not in (load, call)))
            _touch(lua_file)
        else:
            lua_file.unlink()
        for name in ("gpushare_submit.lua", "gpushare-hooks", "gpushare-chains"):
            path = etc / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        _reconfigure(cluster, removed)
        after = {item["install"]: (etc / item["install"]).read_bytes() for item in site["files"]}
        identical = after == before and removed == site_conf
        for name, data in after.items():
            blob = next(i["blob"] for i in site["files"] if i["install"] == name)
            if blob_hash(data) != blob:
                identical = False
        if not identical:
            run.problems.append("removal: the site's files or slurm.conf differ from before the install")
        identical = identical and all(stat.S_IMODE((etc / i["install"]).stat().st_mode) == int(i["mode"], 8)
                                      for i in site["files"])
        run.notes.extend(f"slurmctld: {line}" for line in sorted(set(run.lua_errors()))[:4])
    except Exception as exc:  # noqa: BLE001 - the row says where it stopped, with what was seen before
        run.problems.append(f"{run.phase}: {type(exc).__name__}: {exc}")
        logs = base / "log"
        for name in ("slurmctld.log", "slurmd-n1.log"):
            if (logs / name).exists():
                tail = (logs / name).read_text(errors="replace").splitlines()[-15:]
                run.notes.append(f"{name}: " + " | ".join(tail))
    finally:
        cluster.stop()
        if not os.environ.get("GPUSHARE_KEEP_SITE"):
            shutil.rmtree(base, ignore_errors=True)
    return {"site": site["name"], "slurm": cluster.slurm_release if cluster.runtime else "?",
            "seconds": round(time.monotonic() - started), "outcomes": [o.__dict__ for o in run.outcomes],
            "notes": [n for n in run.notes if n], "problems": run.problems, "removal_identical": identical}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", action="append", help="only this site (repeatable)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--mirrors", type=Path, help="local git mirrors for benchmarks/site_corpus.py")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--jobs", type=int, default=1, help="sites run at once, each on its own cluster")
    args = parser.parse_args(argv)
    sites = [s for s in load_list() if not args.site or s["name"] in args.site]
    problems = recreate(args.corpus, args.mirrors, {s["name"] for s in sites})
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    ensure_login_user()

    def one(site: dict) -> dict:
        try:
            return run_site(site, args.corpus)
        except Exception as exc:  # one site's failure is its row, the others still run
            return {"site": site["name"], "problems": [f"{type(exc).__name__}: {exc}"], "outcomes": [], "notes": [],
                    "removal_identical": False}

    results = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each site on a cluster of its own
        for result in pool.map(one, sites):
            results.append(result)
            if args.json:
                continue
            verdict = "pass" if not result["problems"] and result["removal_identical"] else "FAIL"
            print(f"{result['site']}: {verdict} ({result.get('seconds', '?')} s, Slurm {result.get('slurm', '?')})")
            for o in result["outcomes"]:
                print(f"  {o['label']}: alone {o['alone']!r}, with gpushare {o['ours']!r}")
            for line in result["notes"] + result["problems"]:
                print(f"  {line}")
            sys.stdout.flush()
    if args.json:
        print(json.dumps(results, indent=1))
    return 0 if all(not r["problems"] and r["removal_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
