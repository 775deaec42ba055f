"""Slurm's accounting database for a test cluster: one MariaDB server and one slurmdbd, started on demand.

Why: what a job did on its GPU must outlive the GPU node (docs/formats.md, "job record in Slurm's database"),
and the only store every login node can read is Slurm's own accounting database, through ``sacct``. The
tests therefore need a real one: Debian's ``slurmdbd`` of the cluster's release (the host's 22.05, or the
chroot's for 24.11/26.05) in front of the host's MariaDB, which serves every release over TCP on 127.0.0.1.

Everything lives under one directory (datadir, socket, logs, slurmdbd.conf beside slurm.conf) and every
process is started through caller-supplied argv wrappers, so a harness that runs its controller elsewhere
(another host, a container) passes its own: ``slurm_argv`` for slurmdbd and ``sacctmgr`` (the cluster's
``argv``: into its chroot), ``db_argv`` for MariaDB (the host's, unchanged by default).

Site settings the tests rely on, written into both files: ``PrivateData=jobs`` (a user reads only their own
jobs through ``sacct`` and ``scontrol``; ``gpushare jobstats`` relies on it, docs/configuration.md) and no
``AccountingStorageEnforce`` (jobs of users without an association still run, as before the database).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devcluster.processes import release, stop_group, wait_until
from devcluster.slurm_runtime import SLURM_USER, own_by_slurm

Argv = Callable[[list[str]], list[str]]
DB_BINARIES = ("mariadbd", "mariadb-install-db", "mariadb")
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
ACCOUNT = "gpushare"


class AccountingError(RuntimeError):
    """The accounting database cannot start; the message is one line naming what and where."""


def missing_requirements() -> str | None:
    """Why MariaDB cannot run here (slurmdbd itself is checked per release, at start), or None."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin"
    missing = [b for b in DB_BINARIES if not shutil.which(b, path=path)]
    if missing:
        return f"MariaDB not installed (missing {', '.join(missing)}; apt-get install mariadb-server slurmdbd)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _same(argv: list[str]) -> list[str]:
    return argv


@dataclass
class Accounting:
    """MariaDB + slurmdbd for the cluster whose files are under ``base`` (``etc/slurm.conf`` beside us).

    ``start()`` before slurmctld (it registers the cluster), ``stop()`` after it. ``slurm_conf_lines()`` go
    into slurm.conf; ``register(users)`` adds the test users to the cluster's account.
    """

    base: Path
    cluster_name: str
    munge_socket: Path
    env: Mapping[str, str]  # SLURM_CONF points at base/etc/slurm.conf: slurmdbd finds slurmdbd.conf beside it
    slurm_argv: Argv = _same
    db_argv: Argv = _same
    dbd_argv: Argv | None = None  # how slurmdbd is started, when not as slurm_argv (e.g. as SlurmUser itself)
    db_port: int = field(default_factory=_free_port)
    dbd_port: int = field(default_factory=_free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(12))
    gpu_types: tuple[str, ...] = ()  # typed GPU GRES to account (AllocTRES then names the model: jobstats' MIG advice)
    pids: dict[str, int] = field(default_factory=dict)
    argvs: dict[str, list[str]] = field(default_factory=dict)  # how each daemon was started (pause/resume)
    held: list[subprocess.Popen[bytes]] = field(default_factory=list)  # as LocalCluster.held, until stop()

    @property
    def dir(self) -> Path:
        return self.base / "accounting"

    @property
    def db_socket(self) -> Path:
        return self.dir / "mariadb.sock"

    @property
    def dbd_conf(self) -> Path:
        return self.base / "etc" / "slurmdbd.conf"

    def slurm_conf_lines(self) -> list[str]:
        """What slurm.conf needs to store jobs in this database (replacing ``accounting_storage/none``)."""
        # AccountingStoragePass: the munge socket for talking to slurmdbd (AuthInfo is not used for it)
        return [f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                f"AccountingStoragePort={self.dbd_port}\nAccountingStoragePass={self.munge_socket}",
                # GRES are not accounted unless named: without this sacct's AllocTRES shows no GPU or shard
                "AccountingStorageTRES=" + ",".join(["gres/gpu", "gres/shard", *(f"gres/gpu:{t}" for t in self.gpu_types)]),
                "PrivateData=jobs"]

    # --- files -------------------------------------------------------------------------------------------
    def write_files(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # the database files and its socket are root's
        log = self.base / "log"
        text = "\n".join([
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}",
            "DbdHost=localhost", "DbdAddr=127.0.0.1", f"DbdPort={self.dbd_port}", f"SlurmUser={SLURM_USER}",
            f"LogFile={log}/slurmdbd.log", f"PidFile={self.base}/run/slurmdbd/slurmdbd.pid", "DebugLevel=info",
            "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={self.db_port}",
            f"StorageUser={DB_USER}", f"StoragePass={self.password}", f"StorageLoc={DB_NAME}",
            "PrivateData=jobs"]) + "\n"
        # slurmdbd refuses a slurmdbd.conf that others can read (it holds the database password)
        fd = os.open(self.dbd_conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(self.dbd_conf, 0o600)
        self.own_files()

    def own_files(self) -> None:
        """slurmdbd runs as SlurmUser: its configuration (0600, which it insists on), log and pid directory
        are that account's, as the packages lay them out."""
        own_by_slurm(self.dbd_conf, 0o600, directory=False)
        own_by_slurm(self.base / "log" / "slurmdbd.log", 0o640, directory=False)
        own_by_slurm(self.base / "run" / "slurmdbd", 0o755)

    # --- processes -----------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "Accounting":
        problem = missing_requirements()
        if problem:
            raise AccountingError(problem)
        self.write_files()
        datadir = self.dir / "data"
        if not (datadir / "mysql").is_dir():
            self._run(self.db_argv(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
                                    "--auth-root-authentication-method=socket", "--skip-test-db"]),
                      "mariadb-install-db", 120)
        self._spawn("mariadbd", self.db_argv([
            "mariadbd", "--no-defaults", f"--datadir={datadir}", f"--socket={self.db_socket}",
            f"--port={self.db_port}", "--bind-address=127.0.0.1", "--user=root", "--skip-name-resolve",
            f"--pid-file={self.dir / 'mariadbd.pid'}", f"--log-error={self.base / 'log' / 'mariadbd.log'}",
            "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=16M", "--skip-log-bin",
            # Slurm's own advice for its tables (slurmdbd warns below these)
            "--innodb-lock-wait-timeout=900", "--max-allowed-packet=16M"]))
        self._wait(lambda: self._sql("SELECT 1", check=False) == 0, timeout_s, "MariaDB did not answer")
        self._sql(f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self.password}';"
                  f"ALTER USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self.password}';"
                  f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1';")
        self._spawn("slurmdbd", (self.dbd_argv or self.slurm_argv)(["slurmdbd", "-D"]))
        self._wait(self._dbd_up, timeout_s, "slurmdbd did not answer")
        self.sacctmgr("add", "cluster", self.cluster_name)
        self.sacctmgr("add", "account", ACCOUNT, f"cluster={self.cluster_name}", "description=gpushare tests",
                      "organization=gpushare")
        return self

    def register(self, users: Sequence[str]) -> None:
        """Give ``users`` an association in the cluster's account (their jobs then carry it)."""
        if users:
            self.sacctmgr("add", "user", ",".join(users), f"account={ACCOUNT}", f"cluster={self.cluster_name}")

    def sacctmgr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``sacctmgr -i ARGS`` as root; an "already exists" answer is not an error (registration is idempotent)."""
        done = subprocess.run(self.slurm_argv(["sacctmgr", "-i", *args]), capture_output=True, text=True,
                              env=dict(self.env), stdin=subprocess.DEVNULL, timeout=60)
        if check and done.returncode != 0 and "already exist" not in (done.stdout + done.stderr):
            raise AccountingError(f"sacctmgr {' '.join(args)}: {(done.stderr or done.stdout).strip()[-300:]}")
        return done

    def stop(self) -> None:
        for name in ("slurmdbd", "mariadbd"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                stop_group(pid, term_wait_s=20.0)  # MariaDB flushes its tables
        release(self.held)

    def pause(self, name: str) -> None:
        """Stop one daemon (``slurmdbd`` or ``mariadbd``) as a crash or an outage would leave it: fault tests."""
        pid = self.pids.pop(name, None)
        if pid is not None:
            stop_group(pid, term_wait_s=20.0)

    def resume(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a paused daemon again, as it was started, and wait until it answers."""
        self._spawn(name, self.argvs[name])
        if name == "mariadbd":
            self._wait(lambda: self._sql("SELECT 1", check=False) == 0, timeout_s, "MariaDB did not answer")
        else:
            self._wait(self._dbd_up, timeout_s, "slurmdbd did not answer")

    def _dbd_up(self) -> bool:
        done = subprocess.run(self.slurm_argv(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"]),
                              capture_output=True, text=True, env=dict(self.env), stdin=subprocess.DEVNULL,
                              timeout=30)
        return done.returncode == 0

    def _sql(self, statement: str, check: bool = True) -> int:
        done = subprocess.run(self.db_argv(["mariadb", "--no-defaults", f"--socket={self.db_socket}", "-u", "root",
                                            "-e", statement]),
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        if check and done.returncode != 0:
            raise AccountingError(f"MariaDB at {self.db_socket}: {done.stderr.strip()[-300:]}")
        return done.returncode

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(self.env), start_new_session=True, close_fds=True)
        log.close()
        self.pids[name], self.argvs[name] = proc.pid, argv
        self.held.append(proc)

    def _run(self, argv: list[str], what: str, timeout_s: float) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s)
        if done.returncode != 0:
            raise AccountingError(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-300:]}")

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, message: str) -> None:
        if not wait_until(predicate, timeout_s):
            raise AccountingError(f"{message} within {timeout_s:.0f} s; logs in {self.base / 'log'}")


