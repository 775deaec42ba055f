"""A Slurm cluster whose roles run on hosts of their own, on one machine: controller, login, CPU and GPU nodes.

Why: a real site splits Slurm's roles across hosts that share no /tmp, /run, /var or /etc/slurm, with homes on
a file system the controller's root cannot read, and often with configless nodes. A single-host test cluster
hides every path that quietly needs a shared disk. Here each host of ``multihost.toml`` is modelled by Linux
namespaces:

- its own mount namespace, in which the host's private directories (:data:`PRIVATE_DIRS`, and /etc/hosts) are
  bind-mounted from ``<base>/hosts/<name>/fs``; /home is the one shared file system (``<base>/shared/home``);
- its own UTS namespace (hostname = the Slurm node name) and its own loopback address (127.0.10.x, moved to
  127.0.11.x ... for a second test session beside it, devcluster.slots): slurmd finds its node by hostname,
  munged resolves its address through the cluster's /etc/hosts;
- the controller's processes lose CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from their bounding set, so root
  there cannot read 0700 homes, as with NFS root squash;
- every host runs its own munged with the same key, at Debian's default paths;
- a configless node has no /etc/slurm/slurm.conf: its slurmd runs with ``--conf-server``.

Everything a host runs goes through the host's ``enter`` script (``<base>/hosts/<name>/enter [--user U]
[--cwd D] CMD...``), which builds the namespace for that process tree: processes of one host started
separately see the same files, as processes of one machine do. For Slurm 24.11/26.05 the script also
chroots into the release's cached Debian chroot (devcluster.chroot), with the private directories mounted
inside it. The harness itself (the tests) reads a host's files at :meth:`MultiHostCluster.path_on`, as an
admin reading a node's disk would.

Needs root, util-linux (unshare, setpriv) and the packages the single-host cluster needs.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from devcluster import chroot, slots, slurm_runtime
from devcluster.accounting import Accounting
from devcluster.local_cluster import REPO, ClusterError, controller_up, nodes_idle, share_always, wait_job
from devcluster.processes import kill_leftovers, release, stop_group, wait_until
from devcluster.slurm_runtime import SLURM_USER, own_by_slurm
from gpushare.atomic import write_text_atomic
from gpushare.config import Config, parse_config
from gpushare.gres.gres_conf import gres_conf_lines, node_gres
from gpushare.slurm.client import SlurmClient
from gpushare.slurm.jobs import Job
from gpushare.slurm_plugins.slurm_config import group_gpus, render_lua, render_slurm_conf
from gpushare.slurm.version import SlurmVersion

DESCRIPTION = Path(__file__).with_name("multihost.toml")
#: What each host keeps to itself. Everything else (/usr, /work with the installed package, the chroot cache)
#: is the same on every host, as an image-installed cluster's system disk is.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run", "/var/log", "/var/spool", "/var/lib/gpushare", "/var/lib/gpushare-sim",
                "/var/lib/munge", "/var/lib/slurm", "/etc/slurm", "/etc/munge", "/etc/gpushare")
SHARED_DIRS = ("/home",)
SLURM_CONF = "/etc/slurm/slurm.conf"
GPUSHARE_CONF = "/etc/slurm/gpushare.toml"
MIG_CAP_MAJOR = 234  # the simulated nvidia-caps character devices' major number
SIM_DIR = "/var/lib/gpushare-sim"  # a GPU host's simulated GPUs: device files and the NVML state (private)
TOOLS = ("sbatch", "scontrol", "squeue", "sinfo", "scancel", "sacct", "sacctmgr", "srun")
USERS = ("gpushare-alice", "gpushare-bob")  # ordinary users with 0700 homes in the shared /home
CLUSTER_NAME = "gpushare-multihost"
MUNGE_SOCKET = "/run/munge/munge.socket.2"  # Debian's default: every host's own munged
# 22.05 picks up a MIG node's new GRES only through restarts (docs/mig.md), each on its own host: these stop the
# daemon the pid file names, wait for it to go (a zombie of the harness counts as gone) and start it again
_STOP = ('p=$(cat {pid}) && kill $p; while [ -d /proc/$p ] && ! grep -q "^State:.*Z" /proc/$p/status; '
         'do sleep 0.1; done; ')
RESTART_SLURMCTLD = f"/bin/sh -c '{_STOP.format(pid='/run/slurmctld/slurmctld.pid')}slurmctld -i >/dev/null 2>&1'"
_SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Host:
    """One host of the description: its name (hostname and Slurm node name), address and roles."""

    name: str
    address: str
    roles: tuple[str, ...]
    gpu: str = ""
    gpus: int = 0
    mig: bool = False
    configless: bool = False

    def has(self, role: str) -> bool:
        return role in self.roles


def read_description(path: Path = DESCRIPTION) -> tuple[Host, ...]:
    """The hosts of a description file; a malformed one is refused with the file and the host named."""
    data = tomllib.loads(path.read_text())
    hosts = []
    for index, entry in enumerate(data.get("host", [])):
        try:
            hosts.append(Host(name=entry["name"], address=entry["address"], roles=tuple(entry["roles"]),
                              gpu=entry.get("gpu", ""), gpus=int(entry.get("gpus", 0)), mig=bool(entry.get("mig")),
                              configless=bool(entry.get("configless"))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterError(f"{path}: host {index + 1}: {exc!r}") from None
    if sum(h.has("controller") for h in hosts) != 1:
        raise ClusterError(f"{path}: exactly one host needs the controller role")
    return tuple(hosts)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_user(name: str) -> pwd.struct_passwd:
    """An ordinary user whose home is /home/<name> (which exists only inside the cluster's hosts)."""
    with slots.host_lock("users"):  # another session may be adding the same user
        try:
            return pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-M", "-d", f"/home/{name}", "-s", "/bin/sh", name], check=True)
            return pwd.getpwnam(name)


@dataclass
class MultiHostCluster:
    """The cluster under ``base``: ``start()``, then ``run(host, argv)``/``client``/``wait_job``, ``stop()``."""

    base: Path
    hosts: tuple[Host, ...] = field(default_factory=read_description)
    toml_extra: str = ""  # appended to the generated gpushare.toml
    slurm_version: str = field(default_factory=slurm_runtime.requested_version)
    bin_dir: str = field(default_factory=lambda: os.path.dirname(sys.executable))  # installed gpushare
    pids: dict[str, int] = field(default_factory=dict)
    # the daemons' Popen objects, held until stop(): a daemon that died stays a zombie, so its pid (its process
    # group's id) is not recycled for another cluster's process that stop()'s killpg would then hit
    held: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    runtime: slurm_runtime.SlurmRuntime | None = None
    accounting: bool = False  # slurmdbd on the controller, its MariaDB beside the cluster (HostAccounting)
    acct: "HostAccounting | None" = None
    # which of the concurrent test sessions this is (devcluster.slots): the hosts' loopback addresses move into
    # its range (127.0.10.x in slot 0, 127.0.11.x in slot 1), so clusters side by side share no address:port
    slot: int = field(default_factory=slots.slot)

    def __post_init__(self) -> None:
        self.hosts = tuple(replace(h, address=slots.shifted_address(h.address, self.slot)) for h in self.hosts)

    # --- the description ------------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def with_role(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.has(role)]

    @property
    def controller(self) -> Host:
        return self.with_role("controller")[0]

    @property
    def login(self) -> Host:
        return (self.with_role("login") or [self.controller])[0]

    @property
    def slurm_nodes(self) -> list[Host]:
        return [h for h in self.hosts if h.has("gpu") or h.has("cpu")]

    def slurm_at_least(self, version: str) -> bool:
        return slurm_runtime.at_least(self.slurm_version, version)

    # --- where things are -----------------------------------------------------------------------------------
    def host_dir(self, host: str) -> Path:
        return self.base / "hosts" / host

    def path_on(self, host: str, path: str | os.PathLike[str]) -> Path:
        """Where ``path`` as ``host`` sees it is, for the harness (a private or shared directory)."""
        text = os.path.normpath(os.fspath(path))
        for shared in SHARED_DIRS:
            if text == shared or text.startswith(shared + "/"):
                return self.base / "shared" / text.lstrip("/")
        for private in sorted(PRIVATE_DIRS, key=len, reverse=True):
            if text == private or text.startswith(private + "/"):
                return self.host_dir(host) / "fs" / text.lstrip("/")
        return Path(text)

    def home(self, user: str) -> Path:
        return self.path_on(self.login.name, f"/home/{user}")

    def write_as(self, user: str, name: str, text: str) -> Path:
        """A file in ``user``'s home, owned by them (as they would write it on the login host)."""
        path = self.home(user) / name
        path.write_text(text)
        account = pwd.getpwnam(user)
        os.chown(path, account.pw_uid, account.pw_gid)
        return path

    def config(self) -> Config:
        return parse_config(tomllib.loads(self.toml_text()), source=GPUSHARE_CONF)

    def enter(self, host: str) -> Path:
        return self.host_dir(host) / "enter"

    # --- running things on a host ---------------------------------------------------------------------------
    def argv(self, host: str, argv: Sequence[str], user: str | None = None, cwd: str | None = None) -> list[str]:
        """``argv`` run on ``host`` (as ``user`` with a login-like environment, else as the host's root)."""
        prefix = [str(self.enter(host))]
        if user:
            prefix += ["--user", user]
        if cwd:
            prefix += ["--cwd", cwd]
        return [*prefix, *argv]

    def env(self, user: str | None = None) -> dict[str, str]:
        """A clean environment, as a login shell gives one: the site's install directory on PATH."""
        path = f"{self.bin_dir}:{_SAFE_PATH}"
        if user:
            home = f"/home/{user}"
            return {"PATH": path, "HOME": home, "USER": user, "LOGNAME": user, "SHELL": "/bin/sh",
                    "LANG": "C.UTF-8"}
        return {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8"}

    def run(self, host: str, argv: Sequence[str], user: str | None = None, cwd: str | None = None,
            check: bool = True, timeout_s: float = 120.0, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.argv(host, argv, user, cwd), capture_output=True, text=True, input=input,
                              timeout=timeout_s, env={**self.env(user), **(env or {})})
        if check and done.returncode != 0:
            who = f"{user}@{host}" if user else f"root@{host}"
            raise ClusterError(f"{who}: {' '.join(argv)} exited {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[-400:]}")
        return done

    def sbatch(self, host: str, user: str, script: str, *args: str, cwd: str | None = None) -> int:
        """Submit ``script`` as ``user`` from ``host`` (their home by default); the job id."""
        cwd = cwd or f"/home/{user}"
        done = self.run(host, ["sbatch", "--parsable", *args], user=user, cwd=cwd, input=script)
        return int(done.stdout.strip().split(";")[0])

    def spawn(self, host: str, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Start a daemon on ``host``; its output goes to the host's /var/log/devcluster/<name>.out."""
        log_dir = self.path_on(host, "/var/log/devcluster")
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"{name}.out", "ab") as log:
            proc = subprocess.Popen(self.argv(host, argv), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env={**self.env(), **(env or {})}, start_new_session=True,
                                    close_fds=True)
        self.pids[f"{host}:{name}"] = proc.pid
        self.held.append(proc)
        return proc.pid

    @property
    def client(self) -> SlurmClient:
        """Slurm's tools as root on the login host (an admin's shell there)."""
        return self.client_on(self.login.name)

    def client_on(self, host: str) -> SlurmClient:
        return SlurmClient(SLURM_CONF if not self.host(host).configless else None,
                           bin_dir=str(self.base / "hostbin" / host))

    # --- building the hosts ---------------------------------------------------------------------------------
    def toml_text(self) -> str:
        groups = "".join(
            f'\n[[nodes]]\nnames = "{h.name}"\ngpu = "{h.gpu}"\ncount = {h.gpus}\ndevice_dir = "{SIM_DIR}/dev"\n'
            f'partition = "{"mig" if h.mig else "gpu"}"\n' + ("mig = true\n" if h.mig else "")
            for h in self.with_role("gpu"))
        agent = (f'\n[agent]\ndevice_backend = "sim:{SIM_DIR}/sim.json"\n' if "[agent]" not in self.toml_extra else "")
        mig = (f'\n[mig]\ncoordination = "controller"\ndevice_dir = "{SIM_DIR}/dev"\ncap_device_major = {MIG_CAP_MAJOR}\n'
               f"controller_restart_commands = [{json.dumps(RESTART_SLURMCTLD)}]\n"
               f"node_restart_commands = [{json.dumps(self._restart_slurmd())}]\n"
               if any(h.mig for h in self.hosts) and "[mig]" not in self.toml_extra else "")
        return f"version = 1\n{share_always(self.toml_extra)}\n{agent}{mig}{groups}"

    def _restart_slurmd(self) -> str:
        server = f"{self.controller.address}:{self.ports.get('ctld', 0)}"
        return f"/bin/sh -c '{_STOP.format(pid='/run/slurmd.pid')}slurmd --conf-server {server} >/dev/null 2>&1'"

    def _write_hosts(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)
        home = self.base / "shared" / "home"
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o755)
        for user in USERS:
            account = ensure_user(user)
            directory = home / user
            directory.mkdir(exist_ok=True)
            os.chown(directory, account.pw_uid, account.pw_gid)
            os.chmod(directory, 0o700)
        key = os.urandom(1024)
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        self.ports = {"ctld": _free_port(), **{h.name: _free_port() for h in self.slurm_nodes}}
        cfg_text = self.toml_text()
        cfg = self.config()
        if self.accounting and self.acct is None:
            self.acct = HostAccounting(self.base / "accounting", CLUSTER_NAME, Path(MUNGE_SOCKET), self.env(),
                                       slurm_argv=lambda argv: self.argv(self.controller.name, argv),
                                       # as SlurmUser from the start (the upstream unit's User=slurm): the
                                       # controller's root has no CAP_DAC_OVERRIDE for slurm's 0600 slurmdbd.conf
                                       dbd_argv=lambda argv: self.argv(self.controller.name, argv, SLURM_USER),
                                       gpu_types=tuple(sorted({h.gpu for h in self.with_role("gpu")})),
                                       host=self.controller, host_etc=self.path_on(self.controller.name, "/etc/slurm"))
        for host in self.with_role("gpu"):  # first: a MIG node's GRES lines come from its GPUs' layout
            self.path_on(host.name, SIM_DIR).mkdir(parents=True, exist_ok=True)
            self._make_gpus(host, cfg)
        slurm_conf = self._slurm_conf(cfg)
        for host in self.hosts:
            for directory in PRIVATE_DIRS:
                path = self.path_on(host.name, directory)
                path.mkdir(parents=True, exist_ok=True)
                # the simulated GPUs' state is written by jobs, as their users (the device files stay root's)
                os.chmod(path, 0o1777 if directory in ("/tmp", "/var/tmp") else 0o777 if directory == SIM_DIR else 0o755)
            write_text_atomic(self.host_dir(host.name) / "hosts", hosts_file)
            munge = self.path_on(host.name, "/etc/munge/munge.key")
            munge.write_bytes(key)
            os.chmod(munge, 0o400)
            os.chmod(munge.parent, 0o700)
            for sub in ("/var/log/munge", "/run/munge", "/var/log/slurm", "/var/spool/slurmd"):
                self.path_on(host.name, sub).mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path_on(host.name, GPUSHARE_CONF), cfg_text)
            if not host.configless:
                # a MIG node's lines live in gpushare's own include files, which the site's files Include
                # (docs/mig.md, "Slurm setup"; relative, so slurmctld serves them to configless nodes too): the
                # MIG executor writes only those
                site_conf, mig_conf = _split_includes(slurm_conf, self._mig_hosts(), "gpushare-mig.conf")
                site_gres, mig_gres = _split_includes(self._gres_conf(cfg), self._mig_hosts(),
                                                      "gpushare-mig-gres.conf")
                write_text_atomic(self.path_on(host.name, SLURM_CONF), site_conf)
                write_text_atomic(self.path_on(host.name, "/etc/slurm/gres.conf"), site_gres)
                write_text_atomic(self.path_on(host.name, "/etc/slurm/gpushare-mig.conf"), mig_conf)
                write_text_atomic(self.path_on(host.name, "/etc/slurm/gpushare-mig-gres.conf"), mig_gres)
                if self.slurm_at_least("23.02"):
                    write_text_atomic(self.path_on(host.name, "/etc/slurm/cgroup.conf"), "CgroupPlugin=disabled\n")
            if host.has("controller"):  # slurmctld runs as SlurmUser: its directories, as the packages lay them out
                write_text_atomic(self.path_on(host.name, "/etc/slurm/job_submit.lua"), render_lua(cfg))
                for directory in ("/var/spool/slurmctld", "/var/log/slurm"):
                    own_by_slurm(self.path_on(host.name, directory), 0o755)
                # slurmctld writes its pid file as root before it becomes SlurmUser (then hands it over); the
                # controller's root here has no CAP_DAC_OVERRIDE (root squash), so the folder stays root's
                self.path_on(host.name, "/run/slurmctld").mkdir(parents=True, exist_ok=True)
            self._write_enter(host)
            self._write_tools(host)

    def _make_gpus(self, host: Host, cfg: Config) -> None:
        """The host's simulated GPUs: device files and the NVML state; a MIG host's GPUs in MIG mode, each
        one 7g instance (the layout a freshly partitioned node has), with their nvidia-caps devices."""
        from gpushare.gres.sim_backend import SimBackend
        from gpushare.mig_manager.device_ops import create_instance
        from gpushare.mig_manager.gres_files import ensure_cap_devices
        from gpushare.mig_manager.journal import Op

        sim = self.path_on(host.name, SIM_DIR)
        (sim / "dev").mkdir(parents=True, exist_ok=True)
        os.chmod(sim, 0o777)  # jobs register their processes in the simulated NVML state, as users
        for index in range(host.gpus):
            device = sim / "dev" / f"nvidia{index}"
            if not device.exists():
                os.mknod(device, 0o666 | 0o020000, os.makedev(195, index))
        scenario = {"version": 1, "name": host.name, "processes": [],
                    "gpus": [{"model": host.gpu, **({"mig_mode": True} if host.mig else {})} for _ in range(host.gpus)]}
        backend = SimBackend.from_scenario(scenario, sim / "sim.json")
        if host.mig:
            whole = next(p.name for p in cfg.gpu(host.gpu).mig_profiles if p.name.startswith("7g."))
            for index in range(host.gpus):
                create_instance(backend, Op("create", index, whole, 0))
            minors = [m for g in self._node_gpus(host) for d in g.mig or () for m in (d.gi_cap_minor, d.ci_cap_minor)]
            ensure_cap_devices(sim / "dev", minors, MIG_CAP_MAJOR)
        for name in ("sim.json", "sim.json.lock"):
            (sim / name).touch()
            os.chmod(sim / name, 0o666)

    def _mig_hosts(self) -> set[str]:
        return {h.name for h in self.with_role("gpu") if h.mig}

    def _node_gpus(self, host: Host) -> list:
        """A MIG host's GPUs as gres.conf sees them, from its simulated state."""
        from gpushare.gres.gres_conf import node_gpus
        from gpushare.gres.sim_backend import SimBackend

        return node_gpus(SimBackend.open(self.path_on(host.name, f"{SIM_DIR}/sim.json")))

    def _gres_conf(self, cfg: Config) -> str:
        lines = ["# generated by devcluster.multihost from gpushare's gres.conf generator"]
        for group in cfg.nodes:
            host = self.host(group.names)
            gpus = self._node_gpus(host) if host.mig else group_gpus(cfg, group)
            lines.extend(gres_conf_lines(gpus, group.device_dir, node_name=group.names))
        return "\n".join(lines) + "\n"

    def _slurm_conf(self, cfg: Config) -> str:
        ctl = self.controller
        version = SlurmVersion.parse(self._runtime().release or self.slurm_version)
        lines = [
            f"ClusterName={CLUSTER_NAME}",
            f"SlurmctldHost={ctl.name}({ctl.address})",
            f"SlurmctldPort={self.ports['ctld']}",
            "SlurmctldParameters=enable_configless",
            "AuthType=auth/munge\nCredType=cred/munge",
            f"SlurmUser={SLURM_USER}\nSlurmdUser=root",
            "StateSaveLocation=/var/spool/slurmctld\nSlurmdSpoolDir=/var/spool/slurmd",
            "SlurmctldPidFile=/run/slurmctld/slurmctld.pid\nSlurmdPidFile=/run/slurmd.pid",
            "SlurmctldLogFile=/var/log/slurm/slurmctld.log\nSlurmdLogFile=/var/log/slurm/slurmd.log",
            "SlurmctldDebug=info\nSlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none",
            "SelectTypeParameters=CR_Core_Memory\nDefMemPerCPU=100",
            "MailProg=/bin/true\nReturnToService=2\nMpiDefault=none",
            "SchedulerType=sched/backfill\nSchedulerParameters=sched_interval=1",
            "JobCompType=jobcomp/none",
            *(self.acct.slurm_conf_lines() if self.acct else ["AccountingStorageType=accounting_storage/none"]),
            "InactiveLimit=0\nKillWait=5\nMinJobAge=300",
            "SlurmctldTimeout=30\nSlurmdTimeout=60",
        ]
        generated = render_slurm_conf(cfg, self.bin_dir, version).splitlines()
        cpus = max(2, os.cpu_count() or 2)
        for line in generated:
            if line.startswith("NodeName="):
                name = line.split()[0].split("=", 1)[1]
                if name in self.ports and self.host(name).mig:  # its current layout, not the whole GPU
                    line = re.sub(r" Gres=\S+", f" Gres={node_gres(self._node_gpus(self.host(name)))}", line)
                if name in self.ports:
                    line += f" NodeHostname={name} NodeAddr={self.host(name).address} Port={self.ports[name]}"
                line += f" CPUs={cpus} RealMemory=4000" if "CPUs=" not in line else ""
            lines.append(line)
        cpu_nodes = [h for h in self.with_role("cpu")]
        for host in cpu_nodes:
            lines.append(f"NodeName={host.name} NodeHostname={host.name} NodeAddr={host.address} "
                         f"Port={self.ports[host.name]} CPUs={cpus} RealMemory=16000 State=UNKNOWN")  # estimation jobs ask 8 GiB
        if cpu_nodes:
            lines.append(f"PartitionName=cpu Nodes={','.join(h.name for h in cpu_nodes)} MaxTime=INFINITE State=UP")
        text = "\n".join(lines) + "\n"
        first = text.find("PartitionName=gpu ")
        if first >= 0:  # the GPU partition is the default one, as at most sites
            text = text.replace("PartitionName=gpu ", "PartitionName=gpu Default=YES ", 1)
        return text

    def _runtime(self) -> slurm_runtime.SlurmRuntime:
        if self.runtime is None:
            problem = slurm_runtime.missing_requirements(self.slurm_version)
            if problem:
                raise ClusterError(problem)
            for tool in ("unshare", "setpriv", "runuser"):
                if not shutil.which(tool, path=_SAFE_PATH):
                    raise ClusterError(f"{tool} not found (util-linux)")
            if self.slurm_version == slurm_runtime.HOST:
                self.runtime = slurm_runtime.SlurmRuntime(version=slurm_runtime.HOST,
                                                          release=slurm_runtime.host_release())
            else:
                root = chroot.ensure_chroot(self.slurm_version)
                chroot.prepare_runtime(root, self._chroot_binds())
                stamp = chroot.read_stamp(root) or {}
                self.runtime = slurm_runtime.SlurmRuntime(version=self.slurm_version,
                                                          release=str(stamp.get("slurm", self.slurm_version)),
                                                          root=root)
        return self.runtime

    def _installed(self) -> list[str]:
        """The installation every host runs from (the repository and its virtualenv): the same on every host,
        like an image-installed system disk, even where it lies below a host's private directory (a clone
        under /tmp)."""
        paths = sorted({os.path.realpath(p) for p in (REPO, sys.prefix, self.bin_dir)}, key=len)
        return [p for n, p in enumerate(paths) if not any(p.startswith(q + "/") for q in paths[:n])]

    def _chroot_binds(self) -> list[str]:
        """What a chroot host sees of this machine: the interpreter and the installation."""
        system = [p for p in chroot.runtime_binds() if p != "/tmp"]
        extra = [p for p in self._installed() if not any(p == b or p.startswith(b + "/") for b in system)]
        return system + extra

    def _exposures(self, fs: Path) -> list[str]:
        """Binds carrying the installation into a host's private directories (host Slurm): made inside the
        private source before it is mounted (recursively) over its directory."""
        q, lines = shlex.quote, []
        for path in self._installed():
            for private in PRIVATE_DIRS:
                if path.startswith(private + "/"):
                    inside = fs / private.lstrip("/") / os.path.relpath(path, private)
                    lines.append(f"mkdir -p {q(str(inside))}; mount --bind {q(path)} {q(str(inside))}")
        return lines

    def _write_enter(self, host: Host) -> None:
        q = shlex.quote
        runtime = self._runtime()
        root = str(runtime.root) if runtime.root else ""
        fs = self.host_dir(host.name) / "fs"
        # mkdir: an empty mount point on this machine (or in the chroot) where the directory is missing
        mounts = [f'mkdir -p "$root"{q(d)}; mount --rbind {q(str(fs / d.lstrip("/")))} "$root"{q(d)}'
                  for d in PRIVATE_DIRS]
        mounts += [f'mkdir -p "$root"{q(d)}; mount --bind {q(str(self.base / "shared" / d.lstrip("/")))} "$root"{q(d)}'
                   for d in SHARED_DIRS]
        mounts.append(f'mount --bind {q(str(self.host_dir(host.name) / "hosts"))} "$root"/etc/hosts')
        # a directory holding the cluster's own tree (/tmp for pytest's) is covered last: until then every
        # source is still reachable
        base = str(self.base.resolve())
        mounts.sort(key=lambda line: not root and any(base.startswith(d + "/") for d in PRIVATE_DIRS
                                                      if line.endswith(f'"$root"{q(d)}')))
        if root:  # the installation is bound after the private directories, over them where it lies below one
            setup = ['mount -t proc proc "$root/proc"', 'mount --rbind /sys "$root/sys"',
                     'mount --rbind /dev "$root/dev"']
            mounts += [f'[ -e "$root"{q(p)} ] || mkdir -p "$root"{q(p)}; mount --rbind {q(p)} "$root"{q(p)}'
                       for p in self._chroot_binds()]
            enter = 'chroot "$root"'
        else:
            setup, enter = self._exposures(fs), ""
        # root squash: the controller's root keeps every capability but the two that bypass file permissions
        squash = "setpriv --bounding-set -dac_override,-dac_read_search " if host.has("controller") else ""
        script = f"""#!/bin/sh
# Runs a command on host {host.name} of the multi-host test cluster (generated by devcluster.multihost).
# Usage: enter [--user NAME] [--cwd DIR] COMMAND [ARG...]
if [ "${{1-}}" != --in-namespace ]; then
  exec unshare --mount --uts --propagation private -- "$0" --in-namespace "$@"
fi
shift
set -e
root={q(root)}
user=
cwd=/
if [ "${{1-}}" = --user ]; then user=$2; shift 2; fi
if [ "${{1-}}" = --cwd ]; then cwd=$2; shift 2; fi
hostname {q(host.name)}
{chr(10).join(setup)}
{chr(10).join(mounts)}
export GPUSHARE_DEVCLUSTER_HOST={q(host.name)}
if [ -n "$user" ]; then
  exec {squash}{enter} /bin/sh -c 'cd "$1" && u=$2 && shift 2 && exec runuser -u "$u" -- "$@"' sh "$cwd" "$user" "$@"
fi
exec {squash}{enter} /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$cwd" "$@"
"""
        path = self.enter(host.name)
        path.write_text(script)
        path.chmod(0o755)

    def _write_tools(self, host: Host) -> None:
        """Slurm's tools as root on ``host``, for :class:`SlurmClient` (its bin_dir)."""
        directory = self.base / "hostbin" / host.name
        directory.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            wrapper = directory / tool
            wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(str(self.enter(host.name)))} {tool} \"$@\"\n")
            wrapper.chmod(0o755)

    # --- starting and stopping ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0, services: bool = True) -> "MultiHostCluster":
        self._runtime()
        self._write_hosts()
        for host in self.hosts:
            self.spawn(host.name, "munged", ["munged", "-F", "--force"])
        for host in self.hosts:
            self._wait(lambda h=host: self.path_on(h.name, "/run/munge/munge.socket.2").exists(), 10,
                       f"munged on {host.name} did not create its socket")
        ctl = self.controller.name
        if services:
            self.spawn(ctl, "submitd", [f"{self.bin_dir}/gpushare-submitd"])
            self._wait(lambda: self.path_on(ctl, "/run/gpushare/submitd.sock").exists(), 60,
                       "gpushare-submitd did not listen")
        if self.acct is not None:  # before slurmctld, which registers with it
            (self.acct.base / "log").mkdir(parents=True, exist_ok=True)
            self.acct.start(timeout_s)
            self.acct.register([*USERS, "root"])
        self.spawn(ctl, "slurmctld", ["slurmctld", "-D", "-i"])
        self._wait(self._controller_up, timeout_s, "slurmctld did not answer")
        for host in self.slurm_nodes:
            self.start_slurmd(host.name)
        self._wait(self._nodes_idle, timeout_s, "nodes did not become idle")
        return self

    def start_slurmd(self, name: str) -> None:
        host = self.host(name)
        argv = ["slurmd", "-D"]
        if host.configless:
            argv += ["--conf-server", f"{self.controller.address}:{self.ports['ctld']}"]
        self.spawn(name, "slurmd", argv)

    def start_agent(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        """The node agent on ``name``, its metrics on the host's own address. The hosts share one network
        namespace, so the one setting a site would write once (``metrics_address = "0.0.0.0"``) is given per
        host as its environment override instead (``gpushare doctor`` lists such overrides)."""
        self.spawn(name, "agent", [f"{self.bin_dir}/gpushare-agent", *args],
                   env={"GPUSHARE_AGENT_METRICS_ADDRESS": self.host(name).address, **(env or {})})

    def agent_up(self, name: str) -> bool:
        return self.path_on(name, "/run/gpushare/agent/agent.sock").exists()

    def stop_process(self, key: str) -> None:
        pid = self.pids.pop(key, None)
        if pid is not None:
            stop_group(pid)

    def stop(self) -> None:
        """Stop the daemons, then every process left on one of the hosts (job steps, jobs)."""
        order = sorted(self.pids, key=lambda k: (k.endswith(":munged"), k.endswith(":slurmctld")))
        for key in order:
            if key.endswith(":munged") and self.acct is not None:
                self.acct.stop()  # after slurmctld (its last job records), before munge
            self.stop_process(key)
        if self.acct is not None:
            self.acct.stop()
        kill_leftovers(self.leftover_pids)
        release(self.held)

    def leftover_pids(self) -> list[int]:
        """Processes that see one of this cluster's hosts' own /etc/hosts (bound there by the enter script, so
        every process of a host sees it, however it was started): daemons, jobs, and daemons a command restarted
        on its own (a MIG reshape on 22.05). The file's identity (device, inode) marks the cluster; a mount
        namespace's number would not: the kernel hands a freed number to the next namespace at once, often one
        of another test session's cluster, whose processes this would then kill."""
        marks = set()
        for host in self.hosts:
            try:
                info = os.stat(self.host_dir(host.name) / "hosts")
            except OSError:
                continue
            marks.add((info.st_dev, info.st_ino))
        spare = {os.getpid()}
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in spare:
                try:
                    info = os.stat(f"/proc/{entry}/root/etc/hosts")
                except OSError:
                    continue
                if (info.st_dev, info.st_ino) in marks:
                    found.append(int(entry))
        return found

    def _controller_up(self) -> bool:
        return controller_up(self.client)

    def _nodes_idle(self) -> bool:
        return nodes_idle(self.client, [h.name for h in self.slurm_nodes])

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, message: str) -> None:
        if not wait_until(predicate, timeout_s):
            raise ClusterError(f"{message} within {timeout_s:.0f} s; logs under {self.base / 'hosts'}/*/fs/var/log")

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, message: str) -> None:
        self._wait(predicate, timeout_s, message)

    def wait_job(self, job_id: int | str, timeout_s: float = 60.0) -> Job:
        return wait_job(self.client, job_id, timeout_s)

    def logs(self, tail: int = 25) -> str:
        """The last lines of every log of every host, for a failing test's report."""
        parts = []
        for host in self.hosts:
            for log in sorted(self.path_on(host.name, "/var/log").rglob("*")):
                if log.is_file():
                    lines = log.read_text(errors="replace").splitlines()[-tail:]
                    parts.append(f"== {host.name}:{log.relative_to(self.path_on(host.name, '/var/log'))}\n"
                                 + "\n".join(lines))
        return "\n".join(parts)


@dataclass
class HostAccounting(Accounting):
    """The accounting database of the multi-host cluster: slurmdbd runs on the controller (its files at the
    controller's own paths), MariaDB beside the cluster on this machine, as a site's database host would
    be. Everything else is devcluster.accounting's."""

    host: Host | None = None
    host_etc: Path = Path()  # the controller's /etc/slurm, as the harness reaches it

    @property
    def dbd_conf(self) -> Path:
        return self.host_etc / "slurmdbd.conf"

    def slurm_conf_lines(self) -> list[str]:
        address = self.host.address if self.host else "127.0.0.1"
        return [line.replace("AccountingStorageHost=127.0.0.1", f"AccountingStorageHost={address}")
                for line in super().slurm_conf_lines()]

    def write_files(self) -> None:
        super().write_files()
        address = self.host.address if self.host else "127.0.0.1"
        text = self.dbd_conf.read_text()
        text = re.sub(r"^AuthInfo=.*\n", "", text, flags=re.M)  # the host's own munged, at its default socket
        text = re.sub(r"^DbdAddr=.*$", f"DbdAddr={address}", text, flags=re.M)
        text = re.sub(r"^LogFile=.*$", "LogFile=/var/log/slurm/slurmdbd.log", text, flags=re.M)
        text = re.sub(r"^PidFile=.*$", "PidFile=/run/slurmdbd/slurmdbd.pid", text, flags=re.M)
        self.dbd_conf.write_text(text)

    def own_files(self) -> None:
        if self.host is None:
            return super().own_files()
        own_by_slurm(self.dbd_conf, 0o600, directory=False)
        root = self.host_etc.parents[1]  # the controller's /, as the harness reaches it
        own_by_slurm(root / "var/log/slurm/slurmdbd.log", 0o640, directory=False)
        own_by_slurm(root / "run/slurmdbd", 0o755)


def _split_includes(text: str, nodes: set[str], include: str) -> tuple[str, str]:
    """(the site's file with ``Include <include>`` where ``nodes``' lines were, the include file with them)."""
    site: list[str] = []
    own: list[str] = []
    for line in text.splitlines():
        if line.startswith("NodeName=") and line.split()[0].split("=", 1)[1] in nodes:
            if not own:
                site.append(f"Include {include}")
            own.append(line)
        else:
            site.append(line)
    if not own:
        site.append(f"Include {include}")
    return "\n".join(site) + "\n", "\n".join(own) + "\n"
