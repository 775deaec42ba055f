"""``gpushare doctor``: is this host set up, and do the other hosts hold the same configuration?

Why it exists: every gpushare component reads its own copy of gpushare.toml (configless Slurm does not ship
it, docs/configuration.md), so a node with a missing or older copy would size, cap and record jobs by other
rules than the controller, silently. The doctor compares without a shared disk or a login on each node: each
GPU node's agent publishes the sha256 of the file it read (``gpushare_config_info`` on its metrics
endpoint, agent/metrics.py), and the doctor reads it over HTTP the way Prometheus does.

Output: one line per check and per host, ``<name> <status> <detail>``; hosts are ``ok``, ``differs``
(another file or another gpushare release: both digests shown), ``no config`` (an agent on built-in
defaults), ``unreachable`` or ``unknown`` (an endpoint without the metric). Exit 1 on any problem, 0 when
everything agrees. ``--json`` prints the same as one object.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import click

from gpushare.config import (NO_DIGEST, Config, ConfigError, config_candidates, config_path, file_digest,
                             installed_version, load_config, settings_table)

OK, DIFFERS, NO_CONFIG, UNREACHABLE, UNKNOWN, PROBLEM, NOTE = (
    "ok", "differs", "no config", "unreachable", "unknown", "problem", "note")
_INFO_LINE = re.compile(r"^gpushare_config_info\{(?P<labels>.*)\}\s+(?P<value>\S+)\s*$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
MAX_METRICS_BYTES = 8 << 20  # a node's whole scrape, with per-job series; more is not an agent


@dataclass
class Check:
    """One local finding: the configuration file, Slurm, a setting that needs a path shared between hosts."""

    name: str
    status: str  # ok | problem | note
    detail: str


@dataclass
class HostReport:
    """What one node's agent says about its configuration, compared with this host's."""

    node: str
    address: str
    status: str  # ok | differs | no config | unreachable | unknown
    detail: str
    sha256: str | None = None
    path: str | None = None
    version: str | None = None


@dataclass
class Report:
    config_path: str
    sha256: str
    version: str
    checks: list[Check] = field(default_factory=list)
    hosts: list[HostReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != PROBLEM for c in self.checks) and all(h.status == OK for h in self.hosts)

    def lines(self) -> list[str]:
        width = max([len(c.name) for c in self.checks] + [len(h.node) for h in self.hosts] + [6])
        out = [f"{c.name:{width}}  {c.status:11}  {c.detail}" for c in self.checks]
        out += [f"{h.node:{width}}  {h.status:11}  {h.detail}" for h in self.hosts]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "config": {"path": self.config_path, "sha256": self.sha256, "version": self.version},
                "checks": [asdict(c) for c in self.checks], "hosts": [asdict(h) for h in self.hosts]}


def _short(digest: str | None) -> str:
    return (digest or "?")[:12] if digest != NO_DIGEST else NO_DIGEST


def local_config(explicit: str | None) -> tuple[Config, Check, str, str]:
    """This host's configuration, the check line about it, the file's path and digest.

    A file that exists but does not parse still has a digest: the other hosts are compared with it, so the
    admin sees at once whether they hold the same broken file or another one."""
    path, named = config_path(explicit)
    if not path.exists():
        if named:
            return Config(), Check("config", PROBLEM, f"{path}: no such file"), "", NO_DIGEST
        tried = ", ".join(str(p) for p in config_candidates())
        return (Config(), Check("config", PROBLEM, f"no gpushare.toml (tried {tried}): every gpushare program here "
                                "runs on built-in defaults; the services refuse to start"), "", NO_DIGEST)
    digest = NO_DIGEST
    try:
        digest = file_digest(path.read_bytes())
        cfg = load_config(explicit)
    except (ConfigError, OSError) as exc:
        return Config(), Check("config", PROBLEM, str(exc)), str(path), digest
    return cfg, Check("config", OK, f"{path} sha256 {digest[:12]} (gpushare {installed_version()})"), str(path), digest


def environment_check() -> Check | None:
    """``GPUSHARE_*`` variables override the file here and are not part of its digest: name them."""
    settings = {env for _, env, _, _ in settings_table()}
    names = sorted(n for n in os.environ if n in settings)
    if not names:
        return None
    return Check("environment", NOTE, f"{', '.join(names)} override the file on this host (not in its digest)")


def shared_path_checks(cfg: Config) -> list[Check]:
    """Settings whose path must be the same directory on two kinds of host (docs/deployment.md)."""
    checks = []
    if cfg.agent.admin_comment == "no":
        checks.append(Check("shared", NOTE, f"[agent] records_dir {cfg.agent.records_dir}: with [agent] "
                                            "admin_comment = no, OOM corroboration on the controller reads the GPU "
                                            "nodes' records there (shared), else it finds no measurement"))
    if any(group.mig for group in cfg.nodes) and cfg.mig.coordination == "node":
        checks.append(Check("shared", NOTE, "[mig] gres_conf (empty: beside [slurm] conf): the MIG executor on a GPU "
                                            "node rewrites the gres.conf slurmctld reads and runs [mig] "
                                            "restart_commands: the controller's Slurm files must be that node's"))
    return checks


def hardcap_check(cfg: Config, limits_dir: str | None = None) -> Check | None:
    """Would the hard cap shim cap jobs on this host? None where it is off or this is no GPU node (neither the
    shim nor the agent's socket folder here: a controller has a runtime directory too). The shim reads its
    limits from inside the job as the job's user, so every folder on the way to ``limits_dir`` (the path
    compiled into it) must be searchable by an ordinary user: checked as ``nobody`` when the doctor runs as
    root, from the folders' modes otherwise. A runtime directory made 0700 once left every job of a node
    uncapped with "cannot open limits file (Permission denied)" on each job's stderr and nothing else to show
    for it."""
    from gpushare.run_dir import HARDCAP_DIR, reachable_by_others

    limits_dir = limits_dir or HARDCAP_DIR
    library = cfg.agent.hardcap_library
    if cfg.agent.hardcap not in ("shim", "auto") or not (os.path.exists(library)
                                                          or os.path.isdir(os.path.join(cfg.agent.run_dir, "agent"))):
        return None
    if not os.path.isfile(library):
        return Check("hardcap", PROBLEM, f"[agent] hardcap_library {library}: no such file; jobs would run "
                                         "uncapped: copy build/hardcap/libgpushare-hardcap.so there")
    ok, folder = reachable_by_others(limits_dir)
    if ok and os.geteuid() == 0:  # the modes say yes: ask as an ordinary user (ACLs, mounts)
        probe = subprocess.run(["test", "-x", folder], user=65534, group=65534, check=False)
        ok = probe.returncode == 0
    if not ok:
        return Check("hardcap", PROBLEM, f"{folder}: an ordinary user cannot reach it, so the shim cannot read "
                                         f"the limits under {limits_dir} and caps no job: chmod 755 {folder}")
    return Check("hardcap", OK, f"{limits_dir} reachable by job users; shim {library}")


def slurm_check(cfg: Config) -> tuple[Check, list[dict[str, str]] | None]:
    """Can this host reach slurmctld (``scontrol ping``)? Also the node list, when it can."""
    from gpushare.slurm.client import SlurmClient, SlurmError

    client = SlurmClient.from_config(cfg, timeout_s=10.0)
    try:
        answer = " ".join(client.run("scontrol", "ping").split())
        nodes = client.nodes()
    except (SlurmError, OSError) as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1:] or ["no answer"]
        return Check("slurm", PROBLEM, f"scontrol ping: {last[0].strip()} ([slurm] conf, [slurm] bin_dir)"), None
    if "DOWN" in answer:
        return Check("slurm", PROBLEM, answer), nodes
    return Check("slurm", OK, answer or "scontrol ping answered"), nodes


def gpu_nodes_from_slurm(nodes: list[dict[str, str]]) -> dict[str, str]:
    """GPU nodes (a ``gpu`` GRES) Slurm knows, name → address (NodeAddr, else the name); FUTURE nodes are
    placeholders (the withholding standby node), not hosts."""
    found = {}
    for node in nodes:
        if "gpu" not in node.get("Gres", "") or "FUTURE" in node.get("State", ""):
            continue
        found[node["NodeName"]] = node.get("NodeAddr") or node["NodeName"]
    return found


def gpu_nodes_from_config(cfg: Config) -> dict[str, str]:
    from gpushare.slurm.hostlist import expand_hostlist

    return {name: name for group in cfg.nodes for name in expand_hostlist(group.names)}


def fetch_config_info(address: str, port: int, timeout_s: float) -> dict[str, str] | None:
    """The labels of ``gpushare_config_info`` at ``address:port``; None when the endpoint lacks it.
    Raises OSError (urllib's errors are OSErrors) when the endpoint cannot be read."""
    host = f"[{address}]" if ":" in address else address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:  # noqa: S310
        text = response.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    match = _INFO_LINE.search(text)
    if match is None:
        return None
    return {key: bytes(value, "utf-8").decode("unicode_escape") for key, value in _LABEL.findall(match["labels"])}


def compare_host(node: str, address: str, port: int, digest: str, version: str, timeout_s: float,
                 loopback_only: bool) -> HostReport:
    where = f"{address}:{port}"
    try:
        info = fetch_config_info(address, port, timeout_s)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        reason = getattr(reason, "strerror", None) or reason  # "Connection refused", not "[Errno 111] ..."
        hint = (" ([agent] metrics_address is a loopback address: agents answer only on their own host; set the "
                "node's address or 0.0.0.0)") if loopback_only else ""
        return HostReport(node, address, UNREACHABLE, f"{where}: {reason}{hint}")
    if info is None:
        return HostReport(node, address, UNKNOWN, f"{where}: no gpushare_config_info (an older gpushare-agent?)")
    theirs, path, release = info.get("sha256", ""), info.get("path", ""), info.get("version", "")
    report = HostReport(node, address, OK, "", theirs, path, release)
    if theirs == NO_DIGEST:
        report.status, report.detail = NO_CONFIG, f"{where}: agent runs on built-in defaults (no gpushare.toml)"
    elif theirs != digest:
        report.status = DIFFERS
        report.detail = f"{where}: sha256 {_short(theirs)} at {path} (here {_short(digest)})"
    elif release != version:
        report.status = DIFFERS
        report.detail = f"{where}: gpushare {release} (here {version}); same file sha256 {_short(theirs)}"
    else:
        report.detail = f"{where}: sha256 {_short(theirs)} at {path}"
    return report


#: More checks for a kind of host (the controller's, slurm_plugins/controller_doctor.py): (config, forced) → checks.
HostChecks = Callable[[Config, bool], list[Check]]


def diagnose(explicit_config: str | None, nodes: dict[str, str] | None, ask_slurm: bool, timeout_s: float,
             host_checks: HostChecks | None = None, force_host_checks: bool = False) -> Report:
    """Everything ``gpushare doctor`` prints; ``nodes`` (name → address) replaces the discovered GPU nodes."""
    cfg, config_line, path, digest = local_config(explicit_config)
    version = installed_version()
    report = Report(path, digest, version, [config_line])
    env = environment_check()
    if env:
        report.checks.append(env)
    if host_checks is not None:
        report.checks += host_checks(cfg, force_host_checks)
    hardcap = hardcap_check(cfg)
    if hardcap:
        report.checks.append(hardcap)
    slurm_nodes = None
    if ask_slurm:
        line, slurm_nodes = slurm_check(cfg)
        report.checks.append(line)
    report.checks += shared_path_checks(cfg)
    if nodes is None:
        nodes = gpu_nodes_from_config(cfg)
        nodes.update(gpu_nodes_from_slurm(slurm_nodes or []))
    port = cfg.agent.metrics_port
    if not nodes:
        return report
    if not port:
        # a deliberate setting, not a fault: say what it costs, without failing the doctor for it
        report.checks.append(Check("nodes", NOTE, f"{len(nodes)} GPU node(s) not compared: [agent] metrics_port = 0 "
                                                  "turns the agents' metrics (and their digest) off; run gpushare "
                                                  "doctor on each GPU node, or compare sha256sum of their files"))
        return report
    loopback = cfg.agent.metrics_address.startswith("127.") or cfg.agent.metrics_address == "::1"
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        futures = [pool.submit(compare_host, name, address, port, digest, version, timeout_s, loopback)
                   for name, address in sorted(nodes.items())]
        report.hosts = [f.result() for f in futures]
    return report


def _parse_node(value: str) -> tuple[str, str]:
    name, _, address = value.partition("=")
    if not name or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
        raise click.BadParameter(f"{value!r}: expected NAME or NAME=ADDRESS", param_hint="--node")
    return name, address or name


def build_command(host_checks: HostChecks | None = None) -> click.Command:
    """The ``gpushare doctor`` command, with ``host_checks`` for the kinds of host a higher layer knows."""

    @click.command("doctor")
    @click.option("--config", "config_file", envvar="GPUSHARE_CONFIG", help="gpushare.toml to check (default: the "
                  "one every gpushare program here would read).")
    @click.option("--node", "node_args", multiple=True, metavar="NAME[=ADDRESS]",
                  help="Compare this GPU node's agent (repeatable); default: Slurm's GPU nodes and [[nodes]].")
    @click.option("--no-slurm", is_flag=True, help="Do not ask Slurm (a host that is no Slurm client): nodes from "
                  "--node and [[nodes]] only.")
    @click.option("--controller", is_flag=True, help="Check the slurmctld path (as SlurmUser) even where this host "
                  "is no SlurmctldHost of slurm.conf.")
    @click.option("--timeout", "timeout_s", type=click.FloatRange(0.1, 60.0), default=3.0, show_default=True,
                  help="Seconds to wait for each agent.")
    @click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
    def command(config_file: str | None, node_args: tuple[str, ...], no_slurm: bool, controller: bool,
                timeout_s: float, as_json: bool) -> int:
        """Check this host's gpushare setup and compare the GPU nodes' configuration with it.

        On the slurmctld host, also the controller path as slurmctld's own account. Exit status 0 when every
        check passes and every node holds the same gpushare.toml and release, 1 otherwise."""
        nodes = dict(_parse_node(value) for value in node_args) if node_args else None
        report = diagnose(config_file, nodes, not no_slurm, timeout_s, host_checks, controller)
        if as_json:
            click.echo(json.dumps(report.as_dict(), indent=2))
        else:
            for line in report.lines():
                click.echo(line)
        return 0 if report.ok else 1

    return command


command = build_command()


__all__ = ["Check", "HostReport", "Report", "command", "compare_host", "diagnose", "fetch_config_info"]
