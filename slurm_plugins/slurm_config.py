"""``gpushare slurm-config``: the slurm.conf and gres.conf lines, and job_submit.lua, for a site's config.

Why generated: shard counts must equal each GPU's memory in GiB for shared requests to mean anything
(docs/architecture.md), and the Lua shim must carry the service socket and deadline from gpushare.toml; writing
those by hand is how clusters drift from their config.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from importlib import resources
from pathlib import Path

import click

from gpushare.atomic import write_text_atomic
from gpushare.slurm import hostlist
from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.version import SlurmVersion
from gpushare.config import Config, ConfigError, NodeGroup, load_config
from gpushare.gres.gres_conf import NodeGpu, gres_conf_lines, node_gres
from gpushare.slurm_plugins.chain import GLOB_SLOTS

HOOK_ENTRY_POINTS = {
    "Prolog": "gpushare-prolog",
    "Epilog": "gpushare-epilog",
    "TaskProlog": "gpushare-task-prolog",
    "TaskEpilog": "gpushare-task-epilog",
    "EpilogSlurmctld": "gpushare-epilog-slurmctld",
}


LUA_MODULE = "gpushare_submit"


def render_lua_module(cfg: Config) -> str:
    """gpushare_submit.lua: the module with this site's socket, deadline and script limit filled in."""
    template = resources.files("gpushare.slurm_plugins").joinpath(f"{LUA_MODULE}.lua").read_text(encoding="utf-8")
    socket_path = cfg.submit.socket
    if any(c in socket_path for c in '"\\\n'):
        raise ConfigError(f"{cfg.source}: [submit].socket: quotes, backslashes and newlines are not allowed")
    return (template.replace("@SOCKET_PATH@", socket_path)
            .replace("@DEADLINE_S@", f"{cfg.submit.timeout_ms / 1000:.3f}")
            .replace("@MAX_SCRIPT_BYTES@", str(cfg.submit.max_script_bytes))
            .replace("@SHARED_FEATURE@", shared_feature(cfg))
            .replace("@BREAKER_TIMEOUTS@", str(cfg.submit.breaker_timeouts))
            .replace("@BREAKER_OPEN_S@", str(int(cfg.submit.breaker_open_s))))


def site_lua_lines(module_dir: str) -> list[str]:
    """The two lines a site's own job_submit.lua needs: load the module, and call it from slurm_job_submit.

    Why two lines and not a file of ours: a site's job_submit.lua holds its own rules (accounts, limits,
    partitions); replacing it loses them, so the module goes beside it and the site decides where ours runs."""
    if any(c in module_dir for c in '"\\\n?;'):
        raise ConfigError(f"{module_dir}: quotes, backslashes, newlines, '?' and ';' cannot go into a Lua package.path")
    return [f'package.path = "{module_dir}/?.lua;" .. package.path; local gpushare = require("{LUA_MODULE}")',
            "local rc = gpushare.job_submit(job_desc, part_list, submit_uid); if rc ~= slurm.SUCCESS then return rc end"]


#: slurm.conf keys whose program (or programs) we chain with ours
CHAINED_KEYS = ("Prolog", "Epilog", "TaskProlog", "TaskEpilog", "EpilogSlurmctld", "MailProg")
#: keys Slurm 24.05+ reads from several lines, running every one (slurm.conf(5)); the others take one value
MULTI_LINE_KEYS = ("Prolog", "Epilog", "PrologSlurmctld", "EpilogSlurmctld")


def site_hooks(conf_path: str) -> dict[str, list[str]]:
    """The site's own programs in the hook slots we use, from its current slurm.conf (ours left out).

    Each slot maps to what slurm.conf names there, in order: one program, a glob pattern (Prolog and Epilog,
    e.g. jobstats' ``/etc/slurm/prolog.d/*.sh``), or several lines of either (Slurm 24.05+). A relative
    path is taken from slurm.conf's folder, as Slurm does."""
    return {key: [program for _, program in pairs] for key, pairs in _site_slots(conf_path).items()}


def site_lines(conf_path: str) -> dict[str, list[str]]:
    """The site's own slot values as its slurm.conf wrote them (relative paths kept), read back from our chain
    wrappers where slurm.conf names one: what an uninstall puts back."""
    return {key: [line for line, _ in pairs] for key, pairs in _site_slots(conf_path).items()}


def _site_slots(conf_path: str) -> dict[str, list[tuple[str, str]]]:
    """Slot -> (the value as slurm.conf had it, the program Slurm runs) for each of the site's own programs."""
    from gpushare.slurm.conf_file import SlurmConfError, read_settings

    try:
        settings = read_settings(conf_path)
    except (SlurmConfError, OSError):
        return {}
    found: dict[str, list[tuple[str, str]]] = {}
    for key in CHAINED_KEYS:
        values = [value.strip() for name, value in settings if name == key.lower()]
        if key not in MULTI_LINE_KEYS:
            values = values[-1:]  # the last setting wins
        entries: list[tuple[str, str]] = []
        for original in values:
            value = original
            if value and not value.startswith("/"):
                value = os.path.join(os.path.dirname(os.path.abspath(conf_path)), value)
            if os.path.basename(value).startswith("gpushare-chain-"):
                # our wrapper from an earlier run: the site's programs inside, and its lines as they were
                programs = _chained_site(value)
                lines = _chained_lines(value)
                entries.extend(zip(lines if len(lines) == len(programs) else programs, programs))
            elif value and not os.path.basename(value).startswith("gpushare-") and not (
                    key == "MailProg" and value == "/bin/true"):  # ours, named directly, is no site program
                entries.append((original, value))
        if entries:
            found[key] = entries
    return found


_LINE_NOTE = "# slurm.conf's own line: "


def _chained_lines(wrapper: str) -> list[str]:
    """The site's slot values as slurm.conf had them, noted in a chain wrapper when it was written."""
    try:
        text = Path(wrapper).read_text(errors="replace")
    except OSError:
        return []
    return [line[len(_LINE_NOTE):].partition("=")[2] for line in text.splitlines() if line.startswith(_LINE_NOTE)]


def _chained_site(wrapper: str) -> list[str]:
    """The site's programs named in a chain wrapper written earlier (so a second run keeps them)."""
    try:
        text = Path(wrapper).read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("exec ") and " -m gpushare." in line:
            try:
                words = shlex.split(line)
            except ValueError:
                return []
            return [words[i + 1] for i, word in enumerate(words[:-1]) if word in ("--site", "--mail") and words[i + 1]]
    return []


def pinned_config(wrapper: str) -> str | None:
    """The gpushare.toml a wrapper pins (GPUSHARE_CONFIG); None when it pins none or is unreadable. Ours write
    ``GPUSHARE_CONFIG=FILE; export GPUSHARE_CONFIG``; a site's own wrapper may say ``export GPUSHARE_CONFIG=FILE``,
    which pins the same."""
    try:
        with open(wrapper, "rb") as handle:
            text = handle.read(64 * 1024).decode(errors="replace")  # a wrapper is a short script
    except OSError:
        return None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        if line.startswith("GPUSHARE_CONFIG="):
            try:
                return shlex.split(line.split(";", 1)[0].partition("=")[2])[0]
            except (ValueError, IndexError):
                return None
    return None


def _pin(config_file: str | None) -> str:
    """The line every generated wrapper starts with: the gpushare.toml checked when it was written.

    Why: slurmctld passes no SLURM_CONF to EpilogSlurmctld and slurmd passes its own, so without the line a
    hook looks for the file elsewhere than ``gpushare config check`` did and may run on built-in defaults.
    With it, a file moved away fails loudly (the hook logs that GPUSHARE_CONFIG names no file)."""
    if not config_file:
        return ""
    return f"GPUSHARE_CONFIG={shlex.quote(config_file)}; export GPUSHARE_CONFIG\n"


_GLOB_PART = re.compile(r"(\*|\?|\[[A-Za-z0-9!^_.-]*\])")


def _sh_pattern(pattern: str) -> str:
    """A glob pattern for sh: its wildcards bare, everything else quoted."""
    return "".join(part if _GLOB_PART.fullmatch(part) else shlex.quote(part)
                   for part in _GLOB_PART.split(pattern) if part)


def _sh_site(key: str, sites: list[str]) -> str:
    """sh that runs the site's programs as Slurm would, when our Python cannot start."""
    if len(sites) == 1 and key not in GLOB_SLOTS:
        return f"  exec {shlex.quote(sites[0])} \"$@\"\n"
    if key in GLOB_SLOTS:  # each pattern's files in reverse order, stopping at the first failure
        listing = "; ".join(f"for p in {_sh_pattern(p)}; do printf '%s\\n' \"$p\"; done | LC_ALL=C sort -r"
                            for p in sites)
        return ("  IFS='\n'\n"
                f"  for f in $({{ {listing}; }}); do \"$f\" \"$@\" || exit $?; done\n  exit 0\n")
    return ("  rc=0\n  for f in " + " ".join(shlex.quote(p) for p in sites) +
            "; do \"$f\" \"$@\"; c=$?; [ \"$rc\" -ne 0 ] || rc=$c; done\n  exit $rc\n")


def stable_prefix(prefix: str | None = None) -> str:
    """The virtualenv's path as the cluster should name it: a symbolic link beside it that points to it
    (``/opt/gpushare -> /opt/gpushare-0.1.0``, docs/deployment.md), else the path itself.

    Why: what slurm-config writes (hook lines, wrappers) outlives the release that wrote it. Through the link an
    upgrade or a rollback is one rename; through the versioned path the old release keeps running until every
    line is rewritten, and once it is removed the chained slots run the site's programs alone."""
    prefix = (prefix or sys.prefix).rstrip("/")
    if os.path.islink(prefix):
        return prefix
    real, parent = os.path.realpath(prefix), os.path.dirname(prefix)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return prefix
    for name in names:
        path = os.path.join(parent, name)
        if os.path.islink(path) and os.path.realpath(path) == real:
            return path
    return prefix


def wrapper_python(hook_dir: str) -> str:
    """The interpreter the wrappers start: the one beside the entry points when ``hook_dir`` is a virtualenv's
    bin (the same virtualenv, named through the same path), else this one."""
    candidate = os.path.join(hook_dir, "python3")
    venv = os.path.isfile(os.path.join(os.path.dirname(hook_dir.rstrip("/")), "pyvenv.cfg"))
    return candidate if venv and os.access(candidate, os.X_OK) else sys.executable


def chain_wrapper(key: str, site: str | list[str], hook_dir: str, config_file: str | None = None,
                  lines: list[str] | None = None) -> str:
    """A wrapper for one slot: the site's programs and ours, the site's status kept (slurm_plugins/chain.py).

    MailProg differs: ours is itself a wrapper around the mail program, so the site's program becomes the
    mail program it runs (the site's mail, with the job's summary appended).

    Python runs isolated (``-I``): neither the hook's working directory (slurmd's, perhaps a clone of this
    repository) nor a user's PYTHONPATH (TaskProlog runs in the job's environment) decides what it imports."""
    sites = [site] if isinstance(site, str) else list(site)
    python = shlex.quote(wrapper_python(hook_dir))
    head = f"#!/bin/sh\n# generated by gpushare slurm-config for slurm.conf's {key}: " + ("{what}\n")
    if lines and len(lines) == len(sites):  # what an uninstall puts back (gpushare slurm-config --uninstall)
        head += "".join(f"{_LINE_NOTE}{key}={line}\n" for line in lines).replace("{", "{{").replace("}", "}}")
    # A Python that cannot start (a broken or half-installed virtualenv) must not take the site's program down
    # with it: the site's programs then run alone, as before gpushare.
    probe = "gpushare.epilog.mailprog" if key == "MailProg" else "gpushare.slurm_plugins.chain"
    fallback = (f"if ! {python} -I -c 'import {probe}' 2>/dev/null; then\n"
                f"  logger -p daemon.err -t gpushare \"{key}: {python} cannot run gpushare; the site's program runs "
                f"alone\" 2>/dev/null\n" + _sh_site(key, sites) + "fi\n")
    if key == "MailProg":
        return (head.format(what="the site's mail program, with gpushare's job summary in the body") +
                _pin(config_file) + fallback +
                f"exec {python} -I -m gpushare.epilog.mailprog --mail {shlex.quote(sites[0])} \"$@\"\n")
    ours = shlex.quote(f"{hook_dir}/{HOOK_ENTRY_POINTS[key]}")
    flags = " ".join(f"--site {shlex.quote(p)}" for p in sites)
    return (head.format(what="the site's programs, then gpushare's; the site's exit status and output are kept, "
                             "and gpushare's failure never fails the hook") + _pin(config_file) + fallback +
            f"exec {python} -I -m gpushare.slurm_plugins.chain --slot {key} {flags} --ours {ours} -- \"$@\"\n")


def hook_wrapper(key: str, hook_dir: str, config_file: str | None = None) -> str:
    """A slot's wrapper around gpushare's own program that never fails the hook.

    Why: slurmd drains a node whose Prolog or Epilog fails, and requeues the job. Our programs fail open
    once Python runs, but a console script whose interpreter cannot start (a virtualenv removed or half
    replaced during an upgrade, a missing libpython) fails before any of our code: slurmd sees exit 127
    and drains the node. The wrapper is POSIX sh, outside the virtualenv: whatever our program's status,
    the hook succeeds, with one line in syslog when it did not. Output and stdin pass through (a
    TaskProlog's ``export`` lines reach slurmd)."""
    entry = HOOK_ENTRY_POINTS[key]
    return (f"#!/bin/sh\n# generated by gpushare slurm-config for slurm.conf's {key}: gpushare's program, failing "
            "open (a Python that cannot start must not fail the hook: slurmd would drain the node)\n" + _pin(config_file) +
            f"{shlex.quote(f'{hook_dir}/{entry}')} \"$@\"\nrc=$?\n"
            f"[ \"$rc\" -eq 0 ] || logger -p daemon.err -t gpushare \"{key}: {entry} exited $rc; the job goes on\" "
            "2>/dev/null\nexit 0\n")


def install_hooks(keys: list[str], hook_dir: str, directory: Path, config_file: str | None = None) -> dict[str, str]:
    """Write the failing-open wrapper of each slot in ``keys``; slurm.conf key -> the wrapper's path."""
    written = {}
    directory.mkdir(parents=True, exist_ok=True)
    for key in keys:
        target = directory / f"gpushare-hook-{key}"
        write_text_atomic(target, hook_wrapper(key, hook_dir, config_file))
        os.chmod(target, 0o755)
        written[key] = str(target)
    return written


def _uses_slurmdbd(conf_path: str) -> bool:
    """Does the site's slurm.conf store jobs in slurmdbd (where GRES accounting and billing work)?"""
    from gpushare.slurm.conf_file import SlurmConfError, read_keys

    try:
        return "slurmdbd" in read_keys(conf_path).get("accountingstoragetype", "")
    except (SlurmConfError, OSError):
        return False


def install_chains(site: dict[str, str] | dict[str, list[str]], hook_dir: str, directory: Path,
                   config_file: str | None = None, lines: dict[str, list[str]] | None = None) -> dict[str, str]:
    """Write one wrapper per slot the site already uses; slurm.conf key -> the wrapper's path."""
    written = {}
    for key, program in site.items():
        target = directory / f"gpushare-chain-{key}"
        write_text_atomic(target, chain_wrapper(key, program, hook_dir, config_file, (lines or {}).get(key)))
        os.chmod(target, 0o755)
        written[key] = str(target)
    return written


def render_lua(cfg: Config, module_dir: str | None = None) -> str:
    """A job_submit.lua for a site without one: loads the module from ``module_dir``, or, when None, carries
    it inline (one self-contained file, as the test clusters install it)."""
    template = resources.files("gpushare.slurm_plugins").joinpath("job_submit.lua").read_text(encoding="utf-8")
    if module_dir is None:
        loader = "local gpushare = (function()\n" + render_lua_module(cfg) + "end)()"
    else:
        loader = site_lua_lines(module_dir)[0]
    return template.replace("@LOADER@", loader)


def shared_feature(cfg: Config) -> str:
    """The node feature shared jobs are constrained to (docs/agent.md, withholding); empty when off."""
    return cfg.agent.withhold_feature if cfg.agent.withhold == "feature" else ""


def group_gpus(cfg: Config, group: NodeGroup) -> list[NodeGpu]:
    """The node group's GPUs as gres.conf sees them (whole GPUs; MIG layouts come from the agent)."""
    model = cfg.gpu(group.gpu)
    return [NodeGpu(minor=i, type=model.name, shards=model.shards) for i in range(group.count)]


def expand_hostlist(names: str) -> list[str]:
    """``mig[01-03,07],gpu9`` -> each name. MIG nodes need a line of their own in slurm.conf and gres.conf
    (the MIG executor rewrites one node's lines); one bracket per name is supported."""
    try:
        return hostlist.expand_hostlist(names, strict=True)
    except hostlist.HostlistError as exc:
        raise ConfigError(str(exc)) from None


def _line_names(group: NodeGroup) -> list[str]:
    """One entry per slurm.conf/gres.conf line: the hostlist, or each node of a MIG group."""
    return expand_hostlist(group.names) if group.mig else [group.names]


def render_gres_conf(cfg: Config, node_name: str | None = None) -> str:
    """gres.conf: one gpu line per model and one shard line per GPU (shards = GiB)."""
    lines = ["# generated by gpushare slurm-config: one shard = 1 GiB of GPU memory"]
    for group in cfg.nodes:
        for names in ([node_name] if node_name else _line_names(group)):
            lines.extend(gres_conf_lines(group_gpus(cfg, group), group.device_dir, node_name=names))
    return "\n".join(lines) + "\n"


def render_slurm_conf(cfg: Config, hook_dir: str, version: SlurmVersion | None = None,
                      chains: dict[str, str] | None = None, wrappers: dict[str, str] | None = None) -> str:
    """The slurm.conf lines our parts need for ``version`` (None: 22.05); merge them into the site's."""
    version = version or SlurmVersion(22, 5)
    lines = [
        f"# generated by gpushare slurm-config for Slurm {version.release}",
        "GresTypes=gpu,shard",
        "JobSubmitPlugins=lua",
        "SelectType=select/cons_tres",
    ]
    if version.least_loaded_shared_gres:
        lines.append("# Slurm 24.11+: add LL_SHARED_GRES to SelectTypeParameters to place shards on the least-loaded "
                     "GPU instead of the first that fits (docs/compatibility.md)")
        if cfg.policy.share_when == "queued":
            lines.append("# with [policy] share_when = \"queued\" leave it out: jobs are shared only when no GPU is idle, "
                         "and first-fit then keeps whole GPUs free for jobs of several GPUs (simulated mean JCT at "
                         "offered load 1.0: -51 % first-fit, -7 % least-loaded; docs/benchmarks.md, Do no harm)")
        lines.append("# measured with the live stack on the Philly trace (docs/benchmarks.md): LL_SHARED_GRES with "
                     "[agent] thread_policy = \"gimbal-jct\" had the best makespan (-19.5 % vs -17.3 % with the "
                     "defaults, 5-seed means)")
    if any(group.mig for group in cfg.nodes) and not version.mig_devices_with_shards:
        lines.append(f"# WARNING: on Slurm {version.release}, MIG jobs past a node's first gres.conf lines start with "
                     "an empty CUDA_VISIBLE_DEVICES while GresTypes names shard (measured on 22.05, docs/mig.md): "
                     "keep MIG nodes in a Slurm cluster without shards, or upgrade")
    if cfg.agent.withhold == "feature" and cfg.agent.withhold_node_when == "any":
        lines.append("# [agent] withhold_node_when = \"any\" closed whole nodes for most of the run in every simulated "
                     "table (docs/benchmarks.md); \"all\" cost nothing there")
    chains = chains or {}
    for key, entry in HOOK_ENTRY_POINTS.items():
        if key in chains:
            lines.append(f"# {key}: the site's program and gpushare's, chained")
        lines.append(f"{key}={chains.get(key) or (wrappers or {}).get(key) or f'{hook_dir}/{entry}'}")
    if "MailProg" in chains:
        lines.append(f"MailProg={chains['MailProg']}")
    if any(group.mig for group in cfg.nodes):
        lines.append(f"# MIG nodes: their NodeName= lines below go into {cfg.mig.slurm_include} and their gres.conf "
                     f"lines into {cfg.mig.gres_include}, the only files the MIG executor writes (beside slurm.conf "
                     "and gres.conf unless absolute); slurm.conf and gres.conf each get one Include line for them "
                     "(docs/mig.md, Slurm setup)")
    for group in cfg.nodes:
        extra = ""
        if group.cpus:
            extra += f" CPUs={group.cpus}"
        if group.real_memory_mb:
            extra += f" RealMemory={group.real_memory_mb}"
        if shared_feature(cfg):
            extra += f" Features={shared_feature(cfg)}"
        for names in _line_names(group):
            lines.append(f"NodeName={names} Gres={node_gres(group_gpus(cfg, group))}{extra} State=UNKNOWN")
    partitions: dict[str, list[str]] = {}
    for group in cfg.nodes:
        partitions.setdefault(group.partition, []).append(group.names)
    if shared_feature(cfg):  # keeps shared submissions valid while every node is withheld (docs/agent.md)
        from gpushare.node.withhold import STANDBY_PREFIX, standby_node_line

        for name, members in partitions.items():
            group = max((g for g in cfg.nodes if g.partition == name), key=lambda g: cfg.gpu(g.gpu).shards)
            lines.append(standby_node_line(name, shared_feature(cfg), node_gres(group_gpus(cfg, group)),
                                           group.cpus, group.real_memory_mb))
            members.append(STANDBY_PREFIX + name)
    for name, members in partitions.items():
        mig_groups = [g for g in cfg.nodes if g.partition == name and g.mig]
        if mig_groups:
            lines.append(mig_standby_line(cfg, name, mig_groups))
            members.append(MIG_STANDBY_PREFIX + name)
    for name, members in partitions.items():
        lines.append(f"PartitionName={name} Nodes={','.join(members)} State=UP")
    return "\n".join(lines) + "\n"


MIG_STANDBY_PREFIX = "gpushare-mig-standby-"


def render_billing_lines(cfg: Config, with_slurmdbd: bool) -> str:
    """slurm.conf lines so a shared job is counted like the GPU fraction it holds.

    Why: a rewritten job asks for ``gres/shard``, not ``gres/gpu``. Without these lines accounting does not
    track shards, fair share and billing charge a shared job nothing for its GPU, and GPU-hour reports miss it.
    Weights per GiB: a GPU bills its shard count (its GiB), a shard 1. Slurm's ``billing`` is a whole number
    (measured on 22.05: GRES/shard=0.025 made shard:20 bill nothing for its half GPU), so a fraction such as
    1/40 per shard would be rounded away. Both lines need slurmdbd: without it slurmctld refuses to start
    with a GRES in AccountingStorageTRES or TRESBillingWeights (measured on 22.05), so they are printed
    commented out there."""
    off = "" if with_slurmdbd else "# "
    lines = ["# accounting and billing: track shards beside GPUs, and bill a shard its part of a GPU "
             "(docs/deployment.md, Billing and limits)"]
    if not with_slurmdbd:
        lines.append("# (commented out: they need AccountingStorageType=accounting_storage/slurmdbd; without it "
                     "slurmctld refuses to start with them)")
    lines.append(f"{off}AccountingStorageTRES=gres/gpu,gres/shard")
    shards: dict[str, set[int]] = {}
    for group in cfg.nodes:
        if not group.mig:
            shards.setdefault(group.partition, set()).add(cfg.gpu(group.gpu).shards)
    for name, counts in shards.items():
        per_gpu = max(counts)
        lines.append(f"# PartitionName={name}: add TRESBillingWeights=\"CPU=<c>,Mem=<m>,GRES/gpu={per_gpu},"
                     f"GRES/shard=1\" (a GPU bills its {per_gpu} GiB, a shard 1 GiB; multiply the site's CPU and "
                     "Mem weights by the factor its GRES/gpu weight grew by, to keep their ratio)")
    return "\n".join(lines) + "\n"


#: Where the printed lines are merged: which of them a running Slurm takes only by a restart, in which order.
RESTART_NOTE = (
    "# Restart, do not reconfigure: GresTypes takes effect only when the daemons start, and with it the lines "
    "naming shard (NodeName Gres=, gres.conf, AccountingStorageTRES); a TRESBillingWeights naming GRES/shard reread by "
    "`scontrol reconfigure` while shard is no TRES of the running slurmctld stops it (fatal: "
    "failed to parse tres weights str). Merge every line into slurm.conf and gres.conf on every host, run "
    "`gpushare doctor` (it names what the running slurmctld lacks), then restart slurmctld, then every slurmd "
    "(docs/deployment.md, Restart or reconfigure)")


def bare_hook_config(key: str, conf_path: str) -> Path:
    """The gpushare.toml our program in slot ``key`` reads when nothing pins it: slurmd passes its SLURM_CONF to
    Prolog and Epilog (the file beside it, else /etc/slurm); slurmctld passes none to EpilogSlurmctld."""
    from gpushare.config import DEFAULT_PATH, config_candidates

    if key not in ("Prolog", "Epilog"):
        return DEFAULT_PATH
    candidates = config_candidates({"SLURM_CONF": conf_path})
    return next((path for path in candidates if path.exists()), candidates[-1])


def unpinned_config_lines(checked: str | None, conf_path: str, keys: list[str]) -> list[str]:
    """One warning per slot that names our program directly and would read another gpushare.toml than the one
    slurm-config read (``checked``; None: built-in defaults)."""
    lines = []
    for key in keys:
        found = bare_hook_config(key, conf_path)
        if checked is None or os.path.realpath(found) != os.path.realpath(checked):
            lines.append(f"# WARNING: {key} runs gpushare's program without GPUSHARE_CONFIG and would read {found}, "
                         f"not {checked or 'a gpushare.toml'}: pass --install-hooks DIR (its wrappers pin the file "
                         "checked now), or install the file there")
    return lines


def uninstall_lines(conf_path: str, checked: str | None) -> list[str]:
    """What an uninstall changes in slurm.conf, as lines to paste: each slot line naming one of our chain
    wrappers gives back the site's own lines (as slurm.conf had them), each naming our program alone goes; then
    the shard lines (with a restart) and what is left on purpose. Nothing is written."""
    from gpushare.slurm.conf_file import SlurmConfError, read_settings

    try:
        settings = read_settings(conf_path)
    except (SlurmConfError, OSError) as exc:
        raise ConfigError(f"--uninstall: {exc}") from None
    out = [f"### uninstall: {conf_path}'s hook lines, each of ours replaced as below, then scontrol reconfigure "
           "(docs/deployment.md, Uninstall)"]
    keys = {key.lower(): key for key in (*CHAINED_KEYS, *HOOK_ENTRY_POINTS)}
    for name, value in settings:
        key = keys.get(name)
        path = value if value.startswith("/") else os.path.join(os.path.dirname(os.path.abspath(conf_path)), value)
        if key is None or not os.path.basename(path).startswith("gpushare-"):
            continue
        if os.path.basename(path).startswith("gpushare-chain-"):
            lines = _chained_lines(path) or _chained_site(path)
            out.append(f"# instead of {key}={value}, the site's own line(s):")
            out.extend(f"{key}={line}" for line in lines)
        else:
            out.append(f"# remove: {key}={value}")
    out += ["### then, once no job asks for shards, in one change followed by a restart of slurmctld and then every "
            "slurmd (not a reconfigure): remove GRES/shard=... from every TRESBillingWeights, gres/shard from "
            "AccountingStorageTRES, shard from GresTypes, the nodes' shard: counts and gres.conf's shard lines",
            "### left on purpose: " + ", ".join(filter(None, [
                checked, "the per-job records ([agent] records_dir), the OOM ledger ([oom] ledger_dir), the estimate "
                "cache ([submit] cache_dir) and the logs: delete them when they are no longer wanted",
                "job records in the accounting database (sacct reads them)"]))]
    return out


def _target_version(text: str) -> SlurmVersion:
    if text != "installed":
        try:
            return SlurmVersion.parse(text)
        except ValueError as exc:
            raise ConfigError(f"--slurm-version: {exc}") from None
    try:
        return SlurmClient().version
    except (SlurmError, OSError, ValueError) as exc:
        click.echo(f"gpushare slurm-config: cannot tell the installed Slurm release ({exc}); writing for 22.05, "
                   "pass --slurm-version for another", err=True)
        return SlurmVersion(22, 5)


def mig_standby_line(cfg: Config, partition: str, groups: list[NodeGroup]) -> str:
    """The hidden FUTURE node declaring every MIG profile the partition's nodes can be shaped into.

    Slurm 22.05 refuses ``--gres=gpu:3g.20gb:1`` at submission unless some node declares that type, and a
    real node declares only its current layout; with this node such a job is accepted and pends until
    a reshape (gpushare mig apply --from-demand) gives a real node the type (docs/mig.md). Counts are the
    most instances of each profile one node could hold; FUTURE nodes never run anything.
    """
    counts: dict[str, int] = {}
    for group in groups:
        model = cfg.gpu(group.gpu)
        if not model.mig_capable:
            raise ConfigError(f"{cfg.source}: [[nodes]] {group.names}: mig = true, but {model.name} has no MIG")
        for profile in model.mig_profiles:
            if not profile.media_extensions:
                counts[profile.name] = max(counts.get(profile.name, 0), profile.max_count * group.count)
    gres = ",".join(f"gpu:{name}:{n}" for name, n in counts.items())
    cpus = max(g.cpus for g in groups)
    memory = max(g.real_memory_mb for g in groups)
    return (f"NodeName={MIG_STANDBY_PREFIX}{partition} State=FUTURE Gres={gres} "
            f"CPUs={cpus or 1024} RealMemory={memory or 4194304}")


def install_lua(cfg: Config, directory: Path) -> None:
    """Write the module (ours, replaced on every install); write job_submit.lua only where none exists.

    A site's existing job_submit.lua is never replaced: it gets the two lines to add instead."""
    module = directory / f"{LUA_MODULE}.lua"
    write_text_atomic(module, render_lua_module(cfg))
    click.echo(f"### wrote {module}")
    target = directory / "job_submit.lua"
    if target.exists():
        click.echo(f"### kept {target} (the site's own); add these two lines to it, the first at the top, the "
                   "second inside its slurm_job_submit, then touch it so slurmctld reloads it:")
        for line in site_lua_lines(str(directory.resolve())):
            click.echo(line)
        return
    write_text_atomic(target, render_lua(cfg, str(directory.resolve())))
    click.echo(f"### wrote {target}")


@click.command()
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml to read.")
@click.option("--hook-dir", default=lambda: os.path.join(stable_prefix(), "bin"),
              show_default="this virtualenv's bin, through the link that points to it (/opt/gpushare/bin)",
              help="Where the gpushare-* entry points are installed.")
@click.option("--install-lua", "lua_dir", type=click.Path(file_okay=False),
              help=f"Write {LUA_MODULE}.lua into this directory (next to slurm.conf), and job_submit.lua when "
                   "the directory has none.")
@click.option("--slurm-conf", "slurm_conf_path", default=lambda: os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"),
              show_default="$SLURM_CONF or /etc/slurm/slurm.conf",
              help="The site's current slurm.conf: hook programs it already runs are chained with ours.")
@click.option("--install-chains", "chain_dir", type=click.Path(file_okay=False),
              help="Write a wrapper per hook slot the site already uses (its program, then ours) into this directory.")
@click.option("--install-hooks", "hooks_dir", type=click.Path(file_okay=False),
              help="Write a failing-open wrapper per hook slot the site does not use into this directory (outside "
                   "the virtualenv), for slurm.conf to name instead of the entry points.")
@click.option("--slurm-version", default="installed", show_default=True,
              help="Slurm release to write for (22.05, 24.11, 26.05, ...); 'installed' asks sinfo --version.")
@click.option("--uninstall", is_flag=True, help="Print what removing gpushare changes in slurm.conf (the site's "
              "own hook lines back in place of our wrappers) and what is left on purpose; writes nothing.")
def command(config_path: str | None, hook_dir: str, lua_dir: str | None, slurm_conf_path: str,
            chain_dir: str | None, hooks_dir: str | None, slurm_version: str, uninstall: bool = False) -> None:
    """Print slurm.conf and gres.conf lines for the GPUs and policy in gpushare.toml."""
    try:
        if uninstall:
            cfg = load_config(config_path, warn=False)
            for line in uninstall_lines(slurm_conf_path, os.path.abspath(cfg.source) if cfg.from_file else None):
                click.echo(line)
            return
        cfg = load_config(config_path)
        if not cfg.nodes:
            raise ConfigError(f"{cfg.source}: no [[nodes]] tables: describe the GPU nodes first")
        version = _target_version(slurm_version)
        site = site_hooks(slurm_conf_path)
        chains = {key: str(Path(chain_dir).resolve() / f"gpushare-chain-{key}") for key in site} if chain_dir else {}
        own = [key for key in HOOK_ENTRY_POINTS if key not in chains] if hooks_dir else []
        wrappers = {key: str(Path(hooks_dir).resolve() / f"gpushare-hook-{key}") for key in own} if hooks_dir else {}
        slurm_conf = render_slurm_conf(cfg, hook_dir, version, chains, wrappers)
        gres_conf = render_gres_conf(cfg)  # errors first
        checked = os.path.abspath(cfg.source) if cfg.from_file else None
        if chain_dir:
            install_chains(site, hook_dir, Path(chain_dir).resolve(), checked, site_lines(slurm_conf_path))
        if hooks_dir:
            install_hooks(own, hook_dir, Path(hooks_dir).resolve(), checked)
        click.echo("### slurm.conf")
        for key, programs in site.items():
            several = f" ({len(programs)} lines: replace every {key}= line with the one below)" if len(programs) > 1 else ""
            click.echo(f"# {slurm_conf_path} runs {key}={' and '.join(programs)}{several}: "
                       + ("chained with ours (the site's status and output kept)" if chain_dir
                          else "pass --install-chains DIR to run it and ours from one wrapper"))
        bare = [key for key in HOOK_ENTRY_POINTS if key not in chains and key not in wrappers]
        for line in unpinned_config_lines(checked, slurm_conf_path, bare):
            click.echo(line)
            click.echo(f"gpushare slurm-config: {line[2:]}", err=True)
        click.echo(RESTART_NOTE)
        click.echo(slurm_conf, nl=False)
        click.echo(render_billing_lines(cfg, _uses_slurmdbd(slurm_conf_path)), nl=False)
        click.echo("### gres.conf")
        click.echo(gres_conf, nl=False)
        if version.cgroup_disabled:
            click.echo("### cgroup.conf (only on nodes without a mounted cgroup file system, e.g. containers)")
            click.echo("CgroupPlugin=disabled")
        if lua_dir:
            install_lua(cfg, Path(lua_dir))
        else:
            click.echo(f"### job_submit.lua: write {LUA_MODULE}.lua with --install-lua DIR, then add to the site's "
                       "job_submit.lua (first line at the top, second inside slurm_job_submit)")
            for line in site_lua_lines("DIR"):
                click.echo(line)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
