"""A real Slurm cluster on localhost with simulated GPUs, for the demo and the integration tests.

Everything is Debian's own daemons (munged, slurmctld, slurmd) configured under one scratch directory,
with GPUs as character devices (``mknod c 195 N``: Slurm ignores plain files for CUDA_VISIBLE_DEVICES,
docs/compatibility.md). The slurm.conf GRES lines, gres.conf and job_submit.lua come from the same generators
admins use (``gpushare slurm-config``), so the tests exercise what gets deployed.

Needs root (mknod, starting the daemons). slurmctld (and slurmdbd) run as the unprivileged ``slurm`` account,
as the distributions' packages run them, with their own state, log and pid directories; slurmd runs as root.
Daemons are started with ``setsid`` and all standard streams redirected, so a CI step piping our output never
waits on them.

Which Slurm: ``slurm_version`` (default ``$GPUSHARE_TEST_SLURM``, else the host's 22.05). Newer releases run
from cached Debian chroots (devcluster.chroot): daemons, hooks and gpushare-submitd run inside, and the
cluster's ``env``/``client``/``argv``/``user_argv`` reach the chroot's client tools, so a test is written once
for every version.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from devcluster import slots, slurm_runtime
from devcluster.processes import kill_leftovers, release, scaled, stop_group, time_scale, wait_until
from devcluster.accounting import Accounting
from devcluster.slurm_runtime import SLURM_USER, SlurmRuntime, own_by_slurm, traversable_below_tmp
from gpushare.atomic import write_text_atomic
from gpushare.config import Config, parse_config
from gpushare.slurm.client import SlurmClient
from gpushare.slurm.jobs import ENDED_STATES, Job
from gpushare.gres.gres_conf import gres_conf_lines, node_gres
from gpushare.slurm.conf_file import slurm_user
from gpushare.slurm_plugins.controller_account import prepare_hook_paths
from gpushare.slurm_plugins.slurm_config import HOOK_ENTRY_POINTS, group_gpus, render_lua

REPO = Path(__file__).resolve().parents[1]  # bound into chroots: the virtualenv and examples live there


class ClusterError(RuntimeError):
    pass


LOGIN_TEST_USER = "gpushare-test"
CLUSTER_NAME = "gpushare-local"


def ensure_login_user(name: str = LOGIN_TEST_USER) -> pwd.struct_passwd:
    """An ordinary user with a login shell for jobs submitted as another user, created when missing.

    The login shell matters: Slurm 26.05 loads the login environment of a job root submits with ``--uid`` and
    holds the job (``user_env_retrieval_failed_requeued_held``) when it cannot, as for ``nobody``'s nologin
    shell (measured; 22.05 and 24.11 run it). Create the user before the cluster starts, so the chroot's
    copy of the accounts has it.
    """
    with slots.host_lock("users"):  # another test session may be adding the same user
        try:
            return pwd.getpwnam(name)
        except KeyError:
            if not shutil.which("useradd"):
                raise ClusterError(f"no user {name} and no useradd to create it") from None
            subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/bin/sh", name], check=True)
            return pwd.getpwnam(name)


def missing_requirements(slurm_version: str | None = None) -> str | None:
    """Why a local cluster of ``slurm_version`` (default: ``$GPUSHARE_TEST_SLURM``) cannot start here, or None."""
    return slurm_runtime.missing_requirements(slurm_version)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def share_always(toml_extra: str) -> str:
    """``[policy] share_when = "always"`` unless the test sets it: a test cluster is idle between tests, and
    the queue gate (``share_when = "queued"``) would keep every job on a whole GPU; its own tests ask for it.
    Likewise ``max_jobs_per_gpu = 0``: tests pack several small jobs onto one simulated GPU and check their
    memory-sized shards (``shard:4`` for 3 GiB); the bound's own tests set it."""
    added = "".join(line for key, line in (("share_when", 'share_when = "always"\n'),
                                           ("max_jobs_per_gpu", "max_jobs_per_gpu = 0\n")) if key not in toml_extra)
    if not added:
        return toml_extra
    if "[policy]\n" in toml_extra:
        return toml_extra.replace("[policy]\n", "[policy]\n" + added, 1)
    return f"{toml_extra}\n[policy]\n{added}"


@dataclass
class LocalCluster:
    """One cluster under ``base``: ``start()``, use ``env``/``client``, ``stop()``."""

    base: Path
    gpu: str = "a100-40gb"
    gpus_per_node: int = 2
    node_names: tuple[str, ...] = ("n1",)
    cpu_nodes: tuple[str, ...] = ()  # GPU-less nodes in partition "cpu" (asynchronous estimation jobs)
    with_hook: bool = True
    with_submitd: bool = True
    toml_extra: str = ""  # appended to the generated gpushare.toml (tests tune policy here)
    submit_settings: dict[str, object] = field(default_factory=dict)  # extra [submit] keys
    bin_dir: str = field(default_factory=lambda: os.path.dirname(sys.executable))  # our console scripts
    extra_binds: tuple[str, ...] = ()  # more host paths the chroot's jobs see at the same place (cached venvs)
    slurm_version: str = field(default_factory=slurm_runtime.requested_version)
    # Slurm's accounting database (devcluster.accounting: MariaDB + slurmdbd, PrivateData=jobs); off by default,
    # it adds seconds to a start. ``accounting_users`` get an association in the cluster's account.
    accounting: bool = False
    accounting_users: tuple[str, ...] = ("root",)
    mail_prog: str = "/bin/true"  # slurm.conf MailProg (tests of gpushare.epilog.mailprog put a wrapper here)
    pids: dict[str, int] = field(default_factory=dict)
    # the daemons' Popen objects, held until stop(): a daemon that died stays a zombie, so its pid (its process
    # group's id) is not recycled for another cluster's process that stop()'s killpg would then hit
    held: list[subprocess.Popen[bytes]] = field(default_factory=list)
    runtime: SlurmRuntime | None = None
    acct: Accounting | None = None

    @property
    def slurm_release(self) -> str:
        """The running Slurm's full release (``"24.11.5"``), known once started."""
        return self.runtime.release if self.runtime else ""

    @property
    def in_chroot(self) -> bool:
        return self.slurm_version != slurm_runtime.HOST

    @property
    def slurm_bin_dir(self) -> str | None:
        """Where this cluster's client tools are (chroot wrappers), None for the host's own."""
        return str(self.base / "slurmbin") if self.in_chroot else None

    def slurm_at_least(self, version: str) -> bool:
        return slurm_runtime.at_least(self.slurm_version, version)

    def tres(self, gres: str) -> str:
        """``"shard:4"`` as this cluster's Slurm prints a per-node request (``gres:shard:4``/``gres/shard:4``)."""
        return slurm_runtime.tres(self.slurm_version, gres)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run as root where this cluster's Slurm lives (its chroot), e.g. a node daemon."""
        return self._runtime().argv(argv)

    def user_argv(self, user: str, argv: list[str]) -> list[str]:
        """``argv`` run as the ordinary ``user`` (``runuser``; inside the chroot for chroot versions)."""
        return self._runtime().user_argv(user, argv)

    def _runtime(self) -> SlurmRuntime:
        if self.runtime is None:
            problem = missing_requirements(self.slurm_version)
            if problem:
                raise ClusterError(problem)
            self.base.mkdir(parents=True, exist_ok=True)
            self.runtime = slurm_runtime.prepare(self.slurm_version, self.base, [REPO, self.bin_dir, *self.extra_binds])
        return self.runtime

    # --- paths ------------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def gpushare_conf(self) -> Path:
        return self.base / "etc" / "gpushare.toml"

    @property
    def submitd_socket(self) -> Path:
        return self.base / "run" / "submitd.sock"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["GPUSHARE_CONFIG"] = str(self.gpushare_conf)
        if self.slurm_bin_dir:
            env["PATH"] = f"{self.slurm_bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    @property
    def client(self) -> SlurmClient:
        return SlurmClient(self.conf, bin_dir=self.slurm_bin_dir)

    @property
    def all_nodes(self) -> tuple[str, ...]:
        return (*self.node_names, *self.cpu_nodes)

    def device_dir(self, node: str) -> Path:
        return self.base / "dev" / node

    def config(self) -> Config:
        return parse_config(self._toml_dict(), source=str(self.gpushare_conf))

    # --- files ------------------------------------------------------------------------------------
    def _toml_text(self) -> str:
        nodes = "".join(
            f'\n[[nodes]]\nnames = "{name}"\ngpu = "{self.gpu}"\ncount = {self.gpus_per_node}\n'
            f'device_dir = "{self.device_dir(name)}"\npartition = "gpu"\n'
            for name in self.node_names)
        extra_submit = "".join(f"{key} = {json.dumps(value)}\n" for key, value in self.submit_settings.items())
        # Our commands run on the host (tests, gpushare CLI) must reach this cluster's tools, not the host's.
        slurm_bin = f'\n[slurm]\nbin_dir = "{self.slurm_bin_dir}"\n' if self.slurm_bin_dir else ""
        return (f"version = 1\n{share_always(self.toml_extra)}\n[submit]\nsocket = \"{self.submitd_socket}\"\n"
                f"cache_dir = \"{self.base / 'cache'}\"\nlog_file = \"{self.base / 'log' / 'submitd.log'}\"\n"
                f"timeout_ms = 500\n{extra_submit}"
                f"\n[oom]\nledger_dir = \"{self.base / 'oom-ledger'}\"\nlog_file = \"{self.base / 'log' / 'oom.log'}\"\n"
                f"{slurm_bin}{nodes}")

    def _toml_dict(self) -> dict:
        import tomllib

        return tomllib.loads(self._toml_text())

    def write_files(self) -> None:
        # World-readable tree (the munge key stays 0400): sbatch and jobs run as ordinary users too.
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        for sub in ("etc", "state", "log", "run", "munge", "cache", "bin"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.base / sub, 0o755)
        os.chmod(self.base / "munge", 0o711)  # other users reach the socket; the key stays 0400 root
        write_text_atomic(self.gpushare_conf, self._toml_text())
        cfg = self.config()
        self._make_devices(cfg)
        self._write_hook_wrappers()
        self.ports = {"ctld": _free_port(), **{n: _free_port() for n in self.all_nodes}}
        if self.accounting and self.acct is None:
            self.acct = Accounting(self.base, CLUSTER_NAME, self.base / "munge" / "munge.sock", self.env,
                                   slurm_argv=self.argv, gpu_types=tuple(sorted({g.gpu for g in cfg.nodes})))
        write_text_atomic(self.conf, self._slurm_conf(cfg))
        gres = ["# generated by LocalCluster from gpushare's gres.conf generator"]
        for group in cfg.nodes:
            gres.extend(gres_conf_lines(group_gpus(cfg, group), group.device_dir, node_name=group.names))
        write_text_atomic(self.base / "etc" / "gres.conf", "\n".join(gres) + "\n")
        if self.slurm_at_least("23.02"):
            # Without a cgroup filesystem slurmd >= 23 refuses to start unless told there is no cgroup plugin;
            # 22.05 does not know the value "disabled".
            write_text_atomic(self.base / "etc" / "cgroup.conf", "CgroupPlugin=disabled\n")
        for node in self.all_nodes:
            (self.base / "state" / f"spool-{node}").mkdir(parents=True, exist_ok=True)
        if self.with_hook:
            write_text_atomic(self.base / "etc" / "job_submit.lua", render_lua(cfg))
        self._own_controller_paths(cfg)
        key = self.base / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)

    def _own_controller_paths(self, cfg: Config) -> None:
        """What slurmctld, running as SlurmUser, writes: its state, log and pid file, as the packages lay
        them out; and what our controller-side hooks write, prepared as gpushare-submitd prepares it (here
        too when a test runs without the service)."""
        traversable_below_tmp(self.base)
        own_by_slurm(self.base / "state" / "ctld", 0o755)
        own_by_slurm(self.base / "run" / "slurmctld", 0o755)
        own_by_slurm(self.base / "log" / "slurmctld.log", 0o640, directory=False)
        hooks_log = self.base / "log" / "hooks.log"  # the hook wrappers' stderr, whoever runs them (root,
        hooks_log.touch()  # SlurmUser, the job's user): a test harness's log, not a site's
        os.chmod(hooks_log, 0o666)
        prepare_hook_paths(cfg, slurm_user(self.conf))

    def _make_devices(self, cfg: Config) -> None:
        for group in cfg.nodes:
            directory = Path(group.device_dir)
            directory.mkdir(parents=True, exist_ok=True)
            for index in range(group.count):
                path = directory / f"nvidia{index}"
                if not path.exists():
                    os.mknod(path, 0o666 | 0o020000, os.makedev(195, index))

    def _write_hook_wrappers(self) -> None:
        """Slurm runs hooks with almost no environment: wrappers pin the config and never fail a job."""
        for entry in HOOK_ENTRY_POINTS.values():
            wrapper = self.base / "bin" / entry
            wrapper.write_text(
                "#!/bin/sh\n"
                f"export GPUSHARE_CONFIG='{self.gpushare_conf}'\n"
                f"'{self.bin_dir}/{entry}' \"$@\" 2>>'{self.base}/log/hooks.log'\n"
                "rc=$?\n"
                f"[ $rc -eq 0 ] || echo \"{entry} exit $rc\" >>'{self.base}/log/hooks.log'\n"
                "exit 0\n")
            os.chmod(wrapper, 0o755)

    def _slurm_conf(self, cfg: Config) -> str:
        host = socket.gethostname()
        base = self.base
        lines = [
            f"ClusterName={CLUSTER_NAME}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ports['ctld']}",
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={base}/munge/munge.sock",
            f"SlurmUser={SLURM_USER}\nSlurmdUser=root",
            f"StateSaveLocation={base}/state/ctld\nSlurmdSpoolDir={base}/state/spool-%n",
            f"SlurmctldPidFile={base}/run/slurmctld/slurmctld.pid\nSlurmdPidFile={base}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={base}/log/slurmctld.log\nSlurmdLogFile={base}/log/slurmd-%n.log",
            "SlurmctldDebug=info\nSlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none",
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core_Memory\nDefMemPerCPU=100",
            f"MailProg={self.mail_prog}\nReturnToService=2\nMpiDefault=none",
            "SchedulerType=sched/backfill\nSchedulerParameters=sched_interval=1",
            "JobCompType=jobcomp/none",
            *(self.acct.slurm_conf_lines() if self.acct else ["AccountingStorageType=accounting_storage/none"]),
            "InactiveLimit=0\nKillWait=5\nMinJobAge=300\nMaxJobCount=20000",
            "SlurmctldTimeout=30\nSlurmdTimeout=60",
            "GresTypes=gpu,shard",
        ]
        if self.with_hook:
            lines.append("JobSubmitPlugins=lua")
        for key, entry in HOOK_ENTRY_POINTS.items():
            lines.append(f"{key}={base}/bin/{entry}")
        cpus = max(2, os.cpu_count() or 2)
        for group in cfg.nodes:
            gres = node_gres(group_gpus(cfg, group))
            port = self.ports[group.names]
            lines.append(f"NodeName={group.names} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={cpus} RealMemory=4000 Gres={gres} State=UNKNOWN")
        lines.append(f"PartitionName=gpu Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP")
        for name in self.cpu_nodes:
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={self.ports[name]} "
                         f"CPUs={cpus} RealMemory=4000 State=UNKNOWN")
        if self.cpu_nodes:
            lines.append(f"PartitionName=cpu Nodes={','.join(self.cpu_nodes)} MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    # --- processes --------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(self.argv(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True, close_fds=True)
        log.close()
        self.pids[name] = proc.pid
        self.held.append(proc)
        write_text_atomic(self.base / "run" / "pids", "\n".join(f"{k} {v}" for k, v in self.pids.items()) + "\n")

    def start(self, timeout_s: float = 60.0) -> "LocalCluster":
        self._runtime()
        self.write_files()
        munge = self.base / "munge"
        self._spawn("munged", ["munged", "-F", "-S", str(munge / "munge.sock"), f"--key-file={munge / 'munge.key'}",
                               f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munge.seed'}",
                               f"--log-file={self.base / 'log' / 'munged.log'}", "--force"])
        self._wait(lambda: (munge / "munge.sock").exists(), 10, "munged did not create its socket")
        if self.with_submitd:
            self.start_submitd()
        if self.acct is not None:  # before slurmctld, which registers with it
            self.acct.start(timeout_s)
            self.acct.register(self.accounting_users)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(self._controller_up, timeout_s, "slurmctld did not answer")
        for node in self.all_nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._nodes_idle, timeout_s, "nodes did not become idle")
        return self

    def start_submitd(self) -> None:
        self._spawn("submitd", [f"{self.bin_dir}/gpushare-submitd", "--config", str(self.gpushare_conf)])
        self._wait(lambda: self.submitd_socket.exists(), 60, "gpushare-submitd did not listen")

    def stop_process(self, name: str) -> None:
        pid = self.pids.pop(name, None)
        if pid is not None:
            stop_group(pid)

    def restart_slurm(self, node: str | None = None, timeout_s: float = 30.0) -> None:
        """Restart slurmctld, then the slurmd of ``node`` (every node when None), and wait for answers.

        What Slurm 22.05 needs before it offers a changed file-backed GRES count (a MIG repartition,
        docs/mig.md): ``scontrol reconfigure`` keeps the old count.
        """
        self.stop_process("slurmctld")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(self._controller_up, timeout_s, "slurmctld did not answer after a restart")
        for name in (node,) if node else self.all_nodes:
            self.stop_process(f"slurmd-{name}")
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def restart_controller(self, timeout_s: float = 30.0) -> None:
        """Restart slurmctld alone (SIGTERM: it saves its state, and the new one recovers it); the slurmds
        and their running jobs stay."""
        self.stop_process("slurmctld")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(self._controller_up, timeout_s, "slurmctld did not answer after a restart")

    def stop(self) -> None:
        """Stop the daemons, then kill what Slurm leaves behind: slurmstepd of still-running jobs ignores
        SIGTERM and outlives slurmd, and job processes may outlive it. Chroot mounts live in per-process
        private namespaces, so they go away with the last of these processes."""
        for name in [n for n in self.pids if n.startswith("slurmd-")] + ["slurmctld", "submitd"]:
            self.stop_process(name)
        if self.acct is not None:
            self.acct.stop()
        self.stop_process("munged")
        kill_leftovers(self.leftover_pids)
        release(self.held)

    def leftover_pids(self) -> list[int]:
        """This cluster's processes that outlive its daemons, except ours: slurmstepd (it clears its
        environment, but keeps the slurmd log of this cluster open) and anything carrying this cluster's
        SLURM_CONF (jobs, hooks, tools). slurmstepd comes first so it starts nothing new meanwhile."""
        marker = f"SLURM_CONF={self.conf}".encode()
        log_dir = f"{self.base / 'log'}/"
        spare = {os.getpid(), os.getppid()}
        steps, others = [], []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in spare:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    cmdline = handle.read()
                if cmdline.startswith(b"slurmstepd"):
                    if any(log_dir in target for target in _open_files(int(entry))):
                        steps.append(int(entry))
                    continue
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if marker in handle.read().split(b"\0"):
                        others.append(int(entry))
            except OSError:
                continue
        return steps + others

    def _controller_up(self) -> bool:
        return controller_up(self.client)

    def _nodes_idle(self) -> bool:
        return nodes_idle(self.client, self.all_nodes)

    def _wait(self, predicate, timeout_s: float, message: str, seen=None) -> None:  # type: ignore[no-untyped-def]
        """Wait for ``predicate`` (deadline ``timeout_s`` scaled to the machine's load); on time-out, raise with
        ``message``, the deadline and load, and what ``seen()`` (when given) shows at that moment."""
        if not wait_until(predicate, timeout_s):
            raise ClusterError(f"{message} within {scaled(timeout_s):.0f} s{load_note()}"
                               f"{'; seen: ' + _describe(seen) if seen else ''}; logs in {self.base / 'log'}")

    def wait_job(self, job_id: int | str, timeout_s: float = 60.0) -> Job:
        return wait_job(self.client, job_id, timeout_s)


def wait_job(client: SlurmClient, job_id: int | str, timeout_s: float = 60.0) -> Job:
    """Poll until the job is in a final state (flags such as COMPLETING gone); returns its record. The
    deadline is ``timeout_s`` scaled to the machine's load; a time-out says the job's last state, reason
    and node."""
    limit_s = scaled(timeout_s)
    deadline = time.monotonic() + limit_s
    job: Job | None = None
    while time.monotonic() < deadline:
        job = client.job(job_id)
        if job is not None and job.state in ENDED_STATES and not job.completing:
            return job
        time.sleep(0.2)
    seen = f"state {job.states}, reason {job.reason or 'none'}, nodes {job.nodes or 'none'}" if job else "no record"
    raise ClusterError(f"job {job_id} not finished in {limit_s:.0f} s{load_note()} ({seen})")


def load_note() -> str:
    """`` (load 9.8 on 2 cores, deadlines ×4.9)``: how busy the machine was when a wait ran out."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    return f" (load {load:.1f} on {os.cpu_count()} cores, deadlines x{time_scale():.1f})"


def _describe(seen) -> str:  # type: ignore[no-untyped-def]
    try:
        return repr(seen())[:500]
    except Exception as exc:  # what was seen cannot be read: that is what was seen
        return f"unreadable ({type(exc).__name__}: {exc})"[:500]


def controller_up(client: SlurmClient) -> bool:
    """slurmctld answers ``scontrol ping`` (polled while a cluster starts)."""
    try:
        return "UP" in client.run("scontrol", "ping")
    except Exception:  # noqa: BLE001 - polling until it answers
        return False


def nodes_idle(client: SlurmClient, names: Iterable[str]) -> bool:
    try:
        states = client.node_states()
    except Exception:  # noqa: BLE001 - polling until it answers
        return False
    return all(states.get(n, "").rstrip("*") == "idle" for n in names)


def _open_files(pid: int) -> list[str]:
    """Where ``pid``'s descriptors point (for a chrooted process: as seen from here, with the chroot prefix)."""
    targets = []
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return targets
    for fd in descriptors:
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return targets
