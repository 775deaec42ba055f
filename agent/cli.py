"""Command line and daemon wiring of ``gpushare-agent`` (kept apart so ``agent.py`` stays the logic).

Exit codes: 0 after SIGTERM/SIGINT, 2 for a bad configuration or an unusable device backend (systemd
restarts it; the message names the key or backend to fix).
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

import click

log = logging.getLogger("gpushare.agent")


def setup_logging(log_file: str, level: str = "INFO", program: str = "gpushare-agent") -> None:
    """The agent's (and the node hooks') logging: gpushare.logs, with syslog when no file is usable."""
    from gpushare.logs import setup_logging as setup

    setup(program, log_file, level, syslog_fallback=True)


@dataclass(frozen=True)
class AgentArgs:
    config: str | None = None
    node: str | None = None
    backend: str | None = None
    log_level: str = "INFO"
    defaults: bool = False


@click.command(name="gpushare-agent", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", help="gpushare.toml (default: $GPUSHARE_CONFIG, else /etc/slurm/gpushare.toml)")
@click.option("--node", help="this node's Slurm name (overrides [agent] node_name)")
@click.option("--backend", help="nvml or sim:<state.json> (overrides [agent] device_backend)")
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
@click.option("--defaults", is_flag=True, help="run on the built-in defaults when no gpushare.toml is found "
              "(without it the agent refuses to start: a node on defaults disagrees silently with the controller)")
def _command(config: str | None, node: str | None, backend: str | None, log_level: str, defaults: bool) -> AgentArgs:
    """The gpushare node agent."""
    return AgentArgs(config, node, backend, log_level, defaults)


def parse_args(argv: list[str]) -> AgentArgs:
    """Command-line options; usage errors exit 2 through click's own path, --help exits 0."""
    try:
        result = _command.main(args=argv, prog_name="gpushare-agent", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    if not isinstance(result, AgentArgs):  # --help printed its text
        raise SystemExit(0)
    return result


def run_agent(argv: list[str], agent_cls: type, open_backend: Callable[[str | None], Any]) -> int:
    from gpushare.config import ConfigError, load_config
    from gpushare.gres import GpuError

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, require=not args.defaults, warn=False)
    except ConfigError as exc:
        print(f"gpushare-agent: {exc}")
        return 2
    agent_cfg = cfg.agent
    setup_logging(agent_cfg.log_file, args.log_level)
    if cfg.missing_line():
        log.warning("%s", cfg.missing_line())
    from gpushare.slurm.client import SlurmClient

    slurm = SlurmClient.from_config(cfg)
    try:
        agent_cfg.node_name = args.node or agent_cfg.node_name or own_slurm_node(slurm)
    except ConfigError as exc:
        log.error("%s", exc)
        print(f"gpushare-agent: {exc}")
        return 2
    spec = args.backend or agent_cfg.device_backend or None
    try:
        backend = open_backend(spec)
        backend.gpus()
    except (GpuError, OSError, ValueError) as exc:
        log.error("device backend %s unusable: %s (set [agent] device_backend or GPUSHARE_DEVICE_BACKEND)",
                  spec or "default", exc)
        return 2
    from gpushare.node.api import node_name, socket_path

    feature = None
    if agent_cfg.withhold == "feature":
        from gpushare.node.withhold import NodeFeature

        feature = NodeFeature(slurm, node_name(agent_cfg), agent_cfg.withhold_feature)
    registry = None
    metrics_server = None
    if agent_cfg.metrics_port:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        from gpushare.agent.metrics import register_config_info

        register_config_info(registry, cfg.sha256, cfg.source)
    # always given: AdminComment summaries check admin_comment themselves; the guard needs it for job logs
    from gpushare.agent.sampler import process_job

    here = node_name(agent_cfg)
    agent = agent_cls(agent_cfg, backend, feature=feature, registry=registry, slurm=slurm,
                      evidence_fraction=cfg.oom.corroborate_fraction,
                      pid_job=lambda pid: process_job(pid, node=here))
    agent.load()
    if registry is not None:
        from gpushare.agent.metrics import serve

        try:
            metrics_server = serve(registry, agent_cfg.metrics_port, agent_cfg.metrics_address)
        except OSError as exc:
            log.error("metrics on %s:%d unavailable: %s; agent continues", agent_cfg.metrics_address,
                      agent_cfg.metrics_port, exc)
    # one socket server, three times (gpushare.agent.sockets): a thread it cannot start holds the backstop
    trouble = getattr(agent, "thread_trouble", None)
    api = agent_cls_api(socket_path(agent_cfg), agent.handle, trouble)
    from gpushare.agent.lane_api import LaneServer
    from gpushare.node.api import lanes_socket_path

    lanes = LaneServer(lanes_socket_path(agent_cfg.run_dir), agent.lanes, agent.lane_owner,
                       max_sessions=agent_cfg.lane_sessions, on_trouble=trouble).start()
    from gpushare.agent.live_api import LiveServer
    from gpushare.node.api import live_socket_path

    live = LiveServer(live_socket_path(agent_cfg.run_dir), agent.live, on_trouble=trouble).start()  # jobstats
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("agent up: %d GPU(s) via %s, node %s, socket %s, configuration %s (sha256 %s)",
             len(agent.sampler.views), backend.name, node_name(agent_cfg), socket_path(agent_cfg), cfg.source,
             cfg.sha256[:12])
    try:
        agent.run(stop)
    finally:
        api.stop()
        lanes.stop()
        live.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
        log.info("agent stopped")
    return 0


def own_slurm_node(slurm: Any, hostname: str | None = None) -> str:
    """This host's Slurm node name, when neither ``--node`` nor ``[agent] node_name`` says it.

    Why ask Slurm: the service runs outside slurmd (no ``SLURMD_NODENAME``), and a node whose Slurm name
    differs from its host name (``NodeName=gpu01 NodeHostname=rack3-07``) would otherwise register jobs,
    withhold features and name records under a node Slurm does not know. One match by NodeHostname (else by
    NodeName), full or short host name; none or several is an error naming the setting."""
    import socket

    from gpushare.config import ConfigError
    from gpushare.slurm.client import SlurmError

    host = hostname or socket.gethostname()
    names = {host, host.split(".")[0]}
    try:
        nodes = slurm.nodes()
    except (SlurmError, OSError) as exc:
        raise ConfigError(f"cannot find this host's Slurm node ({exc}); set [agent] node_name or pass --node") from None
    for key in ("NodeHostName", "NodeName"):
        matches = sorted({n["NodeName"] for n in nodes if n.get(key) in names})
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ConfigError(f"several Slurm nodes have {key} {host.split('.')[0]!r} ({', '.join(matches)}); "
                              "set [agent] node_name or pass --node")
    raise ConfigError(f"no Slurm node has NodeHostname or NodeName {host!r}; set [agent] node_name or pass --node")


def agent_cls_api(path: Any, handler: Callable[[dict], dict], on_trouble: Callable[[str], None] | None = None) -> Any:
    from gpushare.agent.api_server import ApiServer

    return ApiServer(path, handler, on_trouble=on_trouble).start()
