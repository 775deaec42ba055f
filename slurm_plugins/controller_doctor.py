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
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from gpushare.node.doctor import NOTE, OK, PROBLEM, Check, build_command
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
    try:  # Slurm 24.05+ runs every EpilogSlurmctld line: ours may be any of them
        from gpushare.slurm.conf_file import read_settings

        epilog = ",".join(value for name, value in read_settings(conf_path) if name == "epilogslurmctld" and value)
    except SlurmConfError:
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


#: what each timer of etc/systemd/ starts, as whom and how often, for a host without systemd
TIMER_COMMANDS = {
    "gpushare-oom-resume.timer": ("gpushare-epilog-slurmctld --resume", "SlurmUser", "2 minutes"),
    "gpushare-estimation-watchdog.timer": ("gpushare estimates --release-overdue", "root", "5 minutes"),
}


def timer_checks(cfg: Config) -> list[Check]:
    timers = ["gpushare-oom-resume.timer"]
    if cfg.estimation.partition:
        timers.append("gpushare-estimation-watchdog.timer")
    systemctl = shutil.which("systemctl")
    if not systemctl or not os.path.isdir("/run/systemd/system"):
        return [Check("timers", NOTE, f"no systemd here: run `{command}` as {who} every {every} (cron), as {timer} "
                                      "does") for timer in timers for command, who, every in [TIMER_COMMANDS[timer]]]
    checks = []
    for timer in timers:
        state = subprocess.run([systemctl, "is-enabled", timer], capture_output=True, text=True, timeout=10)
        if state.stdout.strip() != "enabled":
            checks.append(Check("timers", PROBLEM, f"{timer} is {state.stdout.strip() or 'not installed'}: "
                                                   f"systemctl enable --now {timer}"))
    return checks or [Check("timers", OK, ", ".join(timers) + " enabled")]


#: slots slurmd runs (their programs live on the GPU nodes)
SLURMD_SLOTS = ("Prolog", "Epilog", "TaskProlog", "TaskEpilog")


def program_problem(key: str, entry: str) -> str | None:
    """Why what slot ``key`` names (``entry``: a program, or a glob pattern in Prolog and Epilog) would not run
    on this host as Slurm runs it; None when it runs."""
    from gpushare.slurm_plugins.chain import GLOB_SLOTS

    matches = sorted(glob.glob(entry)) if key in GLOB_SLOTS else [entry]
    if not matches:
        return f"{entry} matches no file: slurmd fails every {key} (the node is drained)"
    bad = [m for m in matches if not (os.path.isfile(m) and os.access(m, os.R_OK | os.X_OK))]
    if bad:
        return f"{', '.join(bad)}: no executable file (Slurm runs none of the slot's programs past it)"
    return None


def _wrapper_python(text: str) -> str | None:
    """The interpreter the last line of one of our chain wrappers execs."""
    for line in reversed(text.splitlines()):
        if line.startswith("exec ") and " -m gpushare." in line:
            try:
                return shlex.split(line)[1]
            except (ValueError, IndexError):
                return None
    return None


def slot_problems(cfg: Config, conf_path: str, key: str, value: str) -> list[str]:
    """Each reason one slurm.conf hook line does not run what it should, with the configuration it reads."""
    from gpushare.slurm_plugins.chain import GLOB_SLOTS
    from gpushare.slurm_plugins.slurm_config import _chained_site, bare_hook_config, pinned_config

    checked = os.path.realpath(cfg.source) if cfg.from_file else None
    name = os.path.basename(value)
    where = f"{key}={value}"
    if not name.startswith("gpushare-"):
        problem = program_problem(key, value)
        return [f"{where}: {problem}"] if problem else []
    problem = program_problem("", value)
    if problem:
        return [f"{where}: {problem}"]
    problems = []
    text = Path(value).read_text(errors="replace") if name.startswith(("gpushare-chain-", "gpushare-hook-")) else ""
    if name.startswith("gpushare-chain-"):
        sites = _chained_site(value)
        if key in GLOB_SLOTS and "--slot" not in text and any(c in site for site in sites for c in "*?["):
            problems.append(f"{where} was written by an older gpushare and starts {' '.join(sites)} as one program "
                            "(exit 127, the node is drained): rerun gpushare slurm-config --install-chains")
        for site in sites:
            problem = program_problem(key, site)
            if problem:
                problems.append(f"{where}: the site's {problem}")
        python = _wrapper_python(text)
        if python and not os.access(python, os.X_OK):
            problems.append(f"{where}: {python} is gone: the site's programs run alone, gpushare's never (an "
                            "older release removed?): rerun gpushare slurm-config --install-chains")
    if name.startswith("gpushare-hook-"):  # the failing-open wrapper: its program must still be there
        line = next((line for line in text.splitlines() if line.endswith(' "$@"') and line[:1] in "'/"), "")
        try:
            program = shlex.split(line)[0] if line else ""
        except (ValueError, IndexError):
            program = ""
        if program and not os.access(program, os.X_OK):
            problems.append(f"{where}: {program} is gone: the hook succeeds and does nothing (an older release "
                            "removed?): rerun gpushare slurm-config --install-hooks")
    pinned = pinned_config(value)  # ours, or a site's own wrapper that exports GPUSHARE_CONFIG
    if pinned is not None:
        if not os.path.isfile(pinned):
            problems.append(f"{where} pins GPUSHARE_CONFIG={pinned}, which is no file: the hook logs that and "
                            "does nothing; install the file or rerun gpushare slurm-config")
        elif checked and os.path.realpath(pinned) != checked:
            problems.append(f"{where} reads {pinned} (GPUSHARE_CONFIG in the wrapper), not {checked} checked here: "
                            f"rerun gpushare slurm-config --config {checked} with the same --install options")
    else:
        found = bare_hook_config(key, conf_path)
        if not found.exists():
            problems.append(f"{where} finds no gpushare.toml where Slurm starts it (it tries {found}): the hook logs "
                            f"one ERROR line and does nothing for any job; pin {checked or 'the site file'} with "
                            "gpushare slurm-config --install-hooks DIR --install-chains DIR (its wrappers set "
                            "GPUSHARE_CONFIG), or install the file there")
        elif checked is None or os.path.realpath(found) != checked:
            problems.append(f"{where} reads {found} (nothing names the file where Slurm starts it), not "
                            f"{checked or 'a gpushare.toml'}: gpushare slurm-config --install-hooks DIR "
                            "--install-chains DIR writes wrappers that pin the file")
    return problems


def hook_slot_checks(cfg: Config, conf_path: str, keys: tuple[str, ...], status: str = PROBLEM) -> list[Check]:
    """Every hook line of slurm.conf in ``keys``: what it names runs on this host (a glob matches executable
    files), and our programs read the gpushare.toml checked here."""
    from gpushare.slurm.conf_file import read_settings
    from gpushare.slurm_plugins.slurm_config import MULTI_LINE_KEYS

    try:
        settings = read_settings(conf_path)
    except SlurmConfError as exc:
        return [Check("slots", status, str(exc))]
    problems, named = [], 0
    for key in keys:
        values = [value for name, value in settings if name == key.lower() and value]
        for value in values if key in MULTI_LINE_KEYS else values[-1:]:
            if not value.startswith("/"):  # Slurm takes a relative path from slurm.conf's folder
                value = os.path.join(os.path.dirname(os.path.abspath(conf_path)), value)
            named += 1
            problems += slot_problems(cfg, conf_path, key, value)
    if problems:
        return [Check("slots", status, line) for line in problems]
    return [Check("slots", OK, f"{named} hook line(s) of {', '.join(keys)}: what each names runs here, and ours "
                               f"read {cfg.source}")] if named else []


_UNIT_CONFIG = re.compile(r"^Environment=.*?\bGPUSHARE_CONFIG=(\S+)", re.M)


def unit_config_checks(cfg: Config, unit_dir: str = "/etc/systemd/system") -> list[Check]:
    """Each installed gpushare unit reads the gpushare.toml checked here? Its ``Environment=GPUSHARE_CONFIG``
    (the unit file, then its drop-ins, the last one winning), else /etc/slurm/gpushare.toml."""
    from gpushare.config import DEFAULT_PATH

    checked = os.path.realpath(cfg.source) if cfg.from_file else None
    problems, seen = [], 0
    for unit in sorted(Path(unit_dir).glob("gpushare-*.service")):
        seen += 1
        reads = str(DEFAULT_PATH)
        for part in [unit, *sorted(Path(f"{unit}.d").glob("*.conf"))]:
            try:
                pins = _UNIT_CONFIG.findall(part.read_text(errors="replace"))
            except OSError:
                continue
            if pins:
                reads = pins[-1].strip('"')
        if checked is None or os.path.realpath(reads) != checked:
            problems.append(Check("units", PROBLEM, f"{unit.name} reads {reads}, not {checked or 'a gpushare.toml'}: "
                                                    f"systemctl edit {unit.name} (Environment=GPUSHARE_CONFIG=...)"))
    if problems or not seen:
        return problems
    return [Check("units", OK, f"{seen} gpushare unit(s) in {unit_dir} read {cfg.source}")]


_LUA_SOCKET = re.compile(r'^local SOCKET_PATH = "([^"]*)"', re.M)


def lua_module_check(cfg: Config, conf_path: str) -> Check | None:
    """The Lua module slurmctld runs carries the socket it was written for: the one in the gpushare.toml
    checked here? (A module written from another file asks another service, or none.)"""
    folder = Path(conf_path).parent
    for path in (folder / "gpushare_submit.lua", folder / "job_submit.lua"):
        try:
            found = _LUA_SOCKET.search(path.read_text(errors="replace"))
        except OSError:
            continue
        if found is None:
            continue
        if found.group(1) != cfg.submit.socket:
            return Check("lua module", PROBLEM, f"{path} asks {found.group(1)}, but {cfg.source} says [submit] socket "
                                                f"= {cfg.submit.socket}: gpushare slurm-config --config {cfg.source} "
                                                f"--install-lua {folder}")
        return Check("lua module", OK, f"{path} asks {found.group(1)}, as {cfg.source} says")
    return None


def parse_show_config(text: str) -> dict[str, str]:
    """``scontrol show config``'s ``Key = Value`` lines, keys lower-cased; ``(null)`` as empty."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            value = value.strip()
            found[key.strip().lower()] = "" if value == "(null)" else value
    return found


def _names(value: str) -> set[str]:
    return {part.strip().lower() for part in value.split(",") if part.strip()}


def restart_problems(running: dict[str, str], settings: list[tuple[str, str]]) -> list[str]:
    """What slurm.conf now says that the running slurmctld took at its start without (a restart applies it)."""
    keys = dict(settings)
    problems = []
    gres_file, gres_running = _names(keys.get("grestypes", "")), _names(running.get("grestypes", ""))
    if gres_file - gres_running:
        problems.append(f"GresTypes: slurm.conf has {','.join(sorted(gres_file - gres_running))}, the running "
                        "slurmctld does not")
    tres_file = _names(keys.get("accountingstoragetres", ""))
    tres_running = _names(running.get("accountingstoragetres", ""))
    if tres_file - tres_running:
        problems.append(f"AccountingStorageTRES: slurm.conf has {','.join(sorted(tres_file - tres_running))}, the "
                        "running slurmctld does not")
    weighted = {part.split("=", 1)[0].strip().lower() for name, value in settings if name == "tresbillingweights"
                for part in value.split(",") if part.lower().startswith("gres/")}
    # a weight must name a TRES of the running slurmctld (its GresTypes and AccountingStorageTRES)
    unknown = sorted(w for w in weighted if w.split("/", 1)[1].split(":", 1)[0] not in gres_running
                     or (tres_running and w.split(":", 1)[0] not in tres_running))
    if unknown:
        problems.append(f"TRESBillingWeights names {','.join(unknown)}, not a TRES of the running slurmctld: "
                        "`scontrol reconfigure` now stops it (fatal: failed to parse tres weights str)")
    return problems


def restart_check(cfg: Config, conf_path: str) -> Check | None:
    """Does the running slurmctld lack what slurm.conf now says and only a restart applies? Before anyone runs
    ``scontrol reconfigure``."""
    from gpushare.slurm.client import SlurmClient, SlurmError
    from gpushare.slurm.conf_file import read_settings

    try:
        running = parse_show_config(SlurmClient.from_config(cfg, timeout_s=10.0).run("scontrol", "show", "config"))
        settings = read_settings(conf_path)
    except (SlurmError, SlurmConfError, OSError):
        return None  # the slurm line says slurmctld does not answer; the file's own problems are reported above
    problems = restart_problems(running, settings)
    if not problems:
        return Check("restart", OK, f"the running slurmctld has {conf_path}'s GresTypes, AccountingStorageTRES "
                                    "and billing GRES")
    return Check("restart", PROBLEM, "; ".join(problems) + ": do not `scontrol reconfigure`; restart slurmctld, "
                                     "then every slurmd (docs/deployment.md, Restart or reconfigure)")


def _no_slurm() -> bool:
    """``gpushare doctor --no-slurm``: ask Slurm nothing (read from the running command's options)."""
    import click

    context = click.get_current_context(silent=True)
    return bool(context and context.params.get("no_slurm"))


def controller_checks(cfg: Config, force: bool = False) -> list[Check]:
    """The controller path's checks; none on a host that is no SlurmctldHost unless ``force``."""
    conf_path = cfg.slurm_conf_path() or "/etc/slurm/slurm.conf"
    try:
        keys = read_keys(conf_path)
        account = slurm_user(conf_path)
    except SlurmConfError as exc:
        return [Check("controller", PROBLEM, f"{exc}")] if force else []
    if not (force or is_controller(keys)):  # a GPU node: its own hook slots
        return hook_slot_checks(cfg, conf_path, SLURMD_SLOTS) + unit_config_checks(cfg) if shutil.which("slurmd") else []
    checks = [Check("slurmuser", OK, f"slurmctld runs as {account.name} (uid {account.uid}, group {account.group})"),
              socket_check(cfg, account), lua_check(keys), *hook_lines_check(keys, conf_path)]
    checks += [c for c in (lua_module_check(cfg, conf_path),) if c] + unit_config_checks(cfg)
    checks += hook_slot_checks(cfg, conf_path, ("EpilogSlurmctld", "MailProg"))  # where slurmctld runs them
    checks += hook_slot_checks(cfg, conf_path, SLURMD_SLOTS, PROBLEM if shutil.which("slurmd") else NOTE)
    if not _no_slurm():
        checks += [c for c in (restart_check(cfg, conf_path),) if c]
    checks += [c for c in (accounting_check(keys), enforce_check(keys), mig_files_check(cfg, conf_path)) if c]
    checks += timer_checks(cfg)
    owners = ownership_problems(cfg, account)
    checks += [Check("owners", PROBLEM, line) for line in owners] or [
        Check("owners", OK, f"{', '.join(str(p) for p, _, _ in hook_paths(cfg))}: {account.name}'s")]
    return checks


command = build_command(controller_checks)
