"""``gpushare doctor`` on the slurmctld host: the controller path, checked as slurmctld's own account.

Why a check of its own: everything slurmctld starts runs as SlurmUser (``slurm`` in the distributions'
packages), and each of its failures is silent from the outside: a shim that cannot reach the service, or a
Slurm that links a Lua without lua-socket, accepts every job unchanged (slurmctld's log says so, once per
job); a missing ``JobSubmitPlugins=lua`` never calls the shim; an EpilogSlurmctld that cannot write the
ledger recovers nothing. Each check below is one line, and every problem names its fix.

The checks run when this host is a SlurmctldHost of slurm.conf (or with ``--controller``).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from gpushare.agent.doctor import NOTE, OK, PROBLEM, Check, build_command
from gpushare.config import Config
from gpushare.slurm.conf_file import Account, SlurmConfError, read_keys, slurm_user
from gpushare.slurm_plugins.controller_account import hook_paths, ownership_problems, socket_gid

#: Where the distributions install Slurm's plugins (Debian's multiarch folder, RHEL's /usr/lib64/slurm).
PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib64/slurm",
               "/usr/lib/slurm", "/usr/local/lib/slurm")
PROBE = b'{"op":"probe"}\n'  # any operation but "submit" is answered "accept" (slurm_plugins/submitd.py)
_LUA_LIB = re.compile(r"liblua-?(5\.\d)")


def is_controller(keys: dict[str, str]) -> bool:
    """True when this host is one of slurm.conf's SlurmctldHost (or the older ControlMachine) entries."""
    names = {socket.gethostname(), socket.gethostname().split(".")[0]}
    hosts = [value.split("(")[0] for key, value in keys.items() if key in ("slurmctldhost", "controlmachine")]
    return any(host in names for host in hosts)


def probe_socket(path: str, account: Account, timeout_s: float = 5.0) -> tuple[bool, str]:
    """Connect to gpushare-submitd as ``account`` (slurmctld's) and ask once; (answered, what happened)."""
    code = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.settimeout(float(sys.argv[2]))\n"
            "try:\n s.connect(sys.argv[1])\nexcept OSError as e:\n print(e.strerror or e); sys.exit(2)\n"
            f"s.sendall({PROBE!r})\ndata=b''\n"
            "while not data.endswith(b'end\\n'):\n chunk=s.recv(4096)\n if not chunk: break\n data+=chunk\n"
            "sys.exit(0 if data.endswith(b'end\\n') else 3)\n")
    as_account = {} if os.geteuid() != 0 or account.uid == 0 else {
        "user": account.uid, "group": account.gid, "extra_groups": []}
    try:
        proc = subprocess.run([sys.executable, "-c", code, path, str(timeout_s)], capture_output=True, text=True,
                              timeout=timeout_s + 5, **as_account)  # type: ignore[call-overload]
    except (subprocess.TimeoutExpired, OSError) as exc:
        return False, str(exc)
    if proc.returncode == 0:
        return True, "answered"
    if proc.returncode == 3:
        return False, "connected, but the service closed without an answer (refused this uid)"
    return False, (proc.stdout.strip() or proc.stderr.strip()[-200:] or f"exit {proc.returncode}")


def socket_check(cfg: Config, account: Account) -> Check:
    path = cfg.submit.socket
    who = f"{account.name} (SlurmUser)"
    answered, what = probe_socket(path, account)
    if answered:
        return Check("socket", OK, f"{path}: gpushare-submitd answers {who}")
    if not os.path.exists(path):
        return Check("socket", PROBLEM, f"{path}: no socket, every job is accepted unchanged: start "
                                        "gpushare-submitd (systemctl enable --now gpushare-submitd)")
    st = os.stat(path)
    want = socket_gid(cfg, account)
    if "refused this uid" in what:
        fix = f"add {account.uid} to [submit] peer_uids, or fix SlurmUser in slurm.conf, and restart gpushare-submitd"
    elif want is not None and st.st_gid != want:
        fix = (f"its group is gid {st.st_gid}, slurmctld's is {want}: set [submit] socket_group (empty: SlurmUser's "
               "primary group) and restart gpushare-submitd")
    else:
        fix = "check the socket's folder permissions and [submit] socket_group, then restart gpushare-submitd"
    return Check("socket", PROBLEM, f"{path}: {who} cannot ask ({what}); every job is accepted unchanged: {fix}")


def linked_lua(keys: dict[str, str]) -> tuple[str | None, str]:
    """(Lua version job_submit/lua links, the plugin's path) from ``ldd``; (None, why) when unknown."""
    dirs = [d for d in keys.get("plugindir", "").split(":") if d] or list(PLUGIN_DIRS)
    plugins = [p for d in dirs for p in glob.glob(os.path.join(d, "job_submit_lua.so"))]
    if not plugins:
        return None, f"no job_submit_lua.so in {':'.join(dirs)} (PluginDir)"
    ldd = shutil.which("ldd")
    if not ldd:
        return None, "ldd not installed"
    out = subprocess.run([ldd, plugins[0]], capture_output=True, text=True, timeout=10).stdout
    match = _LUA_LIB.search(out)
    return (match.group(1) if match else None), plugins[0]


def lua_check(keys: dict[str, str]) -> Check:
    version, where = linked_lua(keys)
    if version is None:
        return Check("lua", NOTE, f"cannot tell which Lua Slurm links: {where}")
    interpreter = shutil.which(f"lua{version}") or shutil.which(f"lua-{version}")
    if interpreter is None:
        so = [p for p in glob.glob(f"/usr/lib*/**/lua/{version}/socket/unix.so", recursive=True)]
        if so:
            return Check("lua", OK, f"{where} links Lua {version}; lua-socket found at {so[0]}")
        return Check("lua", PROBLEM, f"{where} links Lua {version} and no lua-socket for it was found: install it "
                                     f"(Debian: apt-get install lua-socket; RHEL: dnf install lua-socket from EPEL)")
    proc = subprocess.run([interpreter, "-e", 'require("socket"); require("socket.unix")'], capture_output=True,
                          text=True, timeout=10)
    if proc.returncode:
        return Check("lua", PROBLEM, f"{where} links Lua {version}, whose require('socket.unix') fails: every job "
                                     "is accepted unchanged; install lua-socket for that Lua (Debian: apt-get "
                                     "install lua-socket; RHEL: dnf install lua-socket from EPEL)")
    return Check("lua", OK, f"{where} links Lua {version}; lua-socket loads")


def _mentions(value: str, needle: str) -> bool:
    """``needle`` in the setting itself or in the program it names (a site's chain script)."""
    if needle in value:
        return True
    for path in value.split(","):
        try:
            if needle in Path(path.strip()).read_text(errors="replace")[:65536]:
                return True
        except OSError:
            continue
    return False


def hook_lines_check(keys: dict[str, str], conf_path: str) -> list[Check]:
    checks = []
    plugins = keys.get("jobsubmitplugins", "")
    if "lua" not in plugins.split(","):
        checks.append(Check("hooks", PROBLEM, f"{conf_path}: JobSubmitPlugins={plugins or '(unset)'}: slurmctld never "
                                              "calls the shim; add lua (gpushare slurm-config prints the line)"))
    else:
        lua = Path(conf_path).parent / "job_submit.lua"
        if not lua.is_file() or "gpushare" not in lua.read_text(errors="replace"):
            checks.append(Check("hooks", PROBLEM, f"{lua}: does not load gpushare's shim: gpushare slurm-config "
                                                  f"--install-lua {lua.parent}"))
    epilog = keys.get("epilogslurmctld", "")
    if not _mentions(epilog, "gpushare-epilog-slurmctld"):
        checks.append(Check("hooks", PROBLEM, f"{conf_path}: EpilogSlurmctld={epilog or '(unset)'}: no OOM recovery; "
                                              "add gpushare-epilog-slurmctld (gpushare slurm-config prints the line)"))
    if not checks:
        checks.append(Check("hooks", OK, f"{conf_path}: JobSubmitPlugins=lua, EpilogSlurmctld runs gpushare's"))
    return checks


def accounting_check(keys: dict[str, str]) -> Check | None:
    if "slurmdbd" not in keys.get("accountingstoragetype", ""):
        return None
    tres = keys.get("accountingstoragetres", "").split(",")
    missing = [name for name in ("gres/gpu", "gres/shard") if name not in tres]
    if missing:
        return Check("accounting", PROBLEM, f"AccountingStorageTRES lacks {', '.join(missing)}: sacct, sshare and "
                                            "GPU-hour reports do not see shared jobs; add "
                                            "AccountingStorageTRES=gres/gpu,gres/shard")
    return Check("accounting", OK, "AccountingStorageTRES counts gres/gpu and gres/shard")


def enforce_check(keys: dict[str, str]) -> Check | None:
    """QOS limits (a GPU limit written as docs/deployment.md says) hold only under AccountingStorageEnforce."""
    if "slurmdbd" not in keys.get("accountingstoragetype", ""):
        return None
    enforce = keys.get("accountingstorageenforce", "").lower().split(",")
    if "limits" in enforce or "safe" in enforce:
        return Check("limits", OK, f"AccountingStorageEnforce={','.join(enforce)}: QOS limits apply")
    return Check("limits", NOTE, "AccountingStorageEnforce has no limits: QOS GPU limits bound no job, shared or not; "
                                 "AccountingStorageEnforce=limits,qos applies them (docs/deployment.md)")


def mig_files_check(cfg: Config, conf_path: str) -> Check | None:
    """MIG nodes: the site's slurm.conf and gres.conf include the executor's own files and leave the nodes to
    them (gpushare.mig_manager.gres_files.check_site_files, the check every reshape makes before writing)."""
    from gpushare.mig_manager.gres_files import GresFileError, check_site_files, own_files
    from gpushare.slurm.hostlist import HostlistError, expand_hostlist

    try:
        nodes = [n for group in cfg.nodes if group.mig for n in expand_hostlist(group.names, strict=True)]
    except HostlistError as exc:
        return Check("mig files", PROBLEM, str(exc))
    if not nodes:
        return None
    site_slurm = Path(conf_path)
    site_gres = Path(cfg.mig.gres_conf) if cfg.mig.gres_conf else site_slurm.with_name("gres.conf")
    own_slurm, own_gres = own_files(site_slurm, site_gres, cfg.mig.slurm_include, cfg.mig.gres_include)
    for node in nodes:
        try:
            check_site_files(site_slurm, site_gres, own_slurm, own_gres, node)
            if not re.search(rf"(?mi)^NodeName={re.escape(node)}(\s|$)", own_slurm.read_text(encoding="utf-8")):
                raise GresFileError(f"{own_slurm} has no NodeName={node} line; move it there from slurm.conf")
        except (GresFileError, OSError) as exc:
            return Check("mig files", PROBLEM, f"MIG reshapes of {node} will be refused: {exc}")
    return Check("mig files", OK, f"MIG nodes' lines in {own_slurm} and {own_gres}, included by the site's files")


def timer_checks(cfg: Config) -> list[Check]:
    timers = ["gpushare-oom-resume.timer"]
    if cfg.estimation.partition:
        timers.append("gpushare-estimation-watchdog.timer")
    systemctl = shutil.which("systemctl")
    if not systemctl or not os.path.isdir("/run/systemd/system"):
        return [Check("timers", NOTE, f"no systemd here: run what {', '.join(timers)} run (etc/systemd/) "
                                      "periodically by other means")]
    checks = []
    for timer in timers:
        state = subprocess.run([systemctl, "is-enabled", timer], capture_output=True, text=True, timeout=10)
        if state.stdout.strip() != "enabled":
            checks.append(Check("timers", PROBLEM, f"{timer} is {state.stdout.strip() or 'not installed'}: "
                                                   f"systemctl enable --now {timer}"))
    return checks or [Check("timers", OK, ", ".join(timers) + " enabled")]


def controller_checks(cfg: Config, force: bool = False) -> list[Check]:
    """The controller path's checks; none on a host that is no SlurmctldHost unless ``force``."""
    conf_path = cfg.slurm_conf_path() or "/etc/slurm/slurm.conf"
    try:
        keys = read_keys(conf_path)
        account = slurm_user(conf_path)
    except SlurmConfError as exc:
        return [Check("controller", PROBLEM, f"{exc}")] if force else []
    if not (force or is_controller(keys)):
        return []
    checks = [Check("slurmuser", OK, f"slurmctld runs as {account.name} (uid {account.uid}, group {account.group})"),
              socket_check(cfg, account), lua_check(keys), *hook_lines_check(keys, conf_path)]
    checks += [c for c in (accounting_check(keys), enforce_check(keys), mig_files_check(cfg, conf_path)) if c]
    checks += timer_checks(cfg)
    owners = ownership_problems(cfg, account)
    checks += [Check("owners", PROBLEM, line) for line in owners] or [
        Check("owners", OK, f"{', '.join(str(p) for p, _, _ in hook_paths(cfg))}: {account.name}'s")]
    return checks


command = build_command(controller_checks)
