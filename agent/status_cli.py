"""``gpushare status``: what the node agent sees now — per GPU memory, risk, TTFK state and jobs.

Why through the agent's socket (root only): the agent holds the risk window and TTFK table; reading NVML
directly would show memory but not whether the node is withheld or why. Exit status 1 when the agent does
not answer, with the unit to start.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click


def _num(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "N/A"
    return f"{value / scale:.{digits}f}"


def render(status: dict[str, Any]) -> str:
    """The human table (pure, for tests)."""
    state = {True: "open", False: "withheld", None: "not managed"}[status.get("node_open")]
    lines = [f"node: {state} for new shared jobs"]
    holding = (status.get("failsafe") or {}).get("reasons") or {}
    if holding:
        lines.append("backstop fail-safe: stops nothing it cannot attribute to a job, because "
                     + "; ".join(f"{reason}: {detail}" for reason, detail in sorted(holding.items())))
    lines.append(f"{'GPU':>3}  {'used/total GiB':>15}  {'SMACT':>5} {'SMOCC':>5} {'DRAMA':>5}  {'state':<9} jobs")
    for gpu in status["gpus"]:
        risk = gpu["risk"]
        flag = "ERROR" if gpu.get("error") else "risky" if gpu["risky"] else "warming" if gpu["warming"] else "ok"
        used = f"{_num(gpu['memory_used'], 2**30, 1)}/{_num(gpu['memory_total'], 2**30, 1)}"
        lines.append(f"{gpu['index']:>3}  {used:>15}  {_num(risk['smact']):>5} {_num(risk['smocc']):>5} "
                     f"{_num(risk['drama']):>5}  {flag:<9} {','.join(gpu['jobs']) or '-'}")
    if status["jobs"]:
        lines.append("")
        lines.append(f"{'job':>10}  {'gpus':<6} {'caps':<8} {'TTFK s':>7}  {'energy J':>9}  peak GiB")
        for job in status["jobs"]:
            energy = sum(job["share_mj"].values()) / 1000 if job["share_mj"] else None
            peak = max(job["peak_bytes"].values()) if job["peak_bytes"] else None
            lines.append(f"{job['job']:>10}  {','.join(map(str, job['gpus'])):<6} {job['mode']:<8} "
                         f"{_num(job['ttfk_s'], digits=1):>7}  {_num(energy, digits=0):>9}  {_num(peak, 2**30)}")
    return "\n".join(lines)


@click.command()
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml to read.")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's status object.")
def command(config_path: str | None, as_json: bool) -> int:
    """Show this node's GPUs as the gpushare agent sees them (run as root on a GPU node)."""
    from gpushare.config import ConfigError, load_config
    from gpushare.node.api import AgentUnavailable, call, socket_path

    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        status = call(socket_path(cfg.agent), {"op": "status"})
    except AgentUnavailable as exc:
        click.echo(f"gpushare status: {exc} (is gpushare-agent running? systemctl status gpushare-agent)", err=True)
        return 1
    if not status.get("ok"):
        click.echo(f"gpushare status: agent refused: {status.get('error')}", err=True)
        return 1
    click.echo(json.dumps(status, indent=2, default=str) if as_json else render(status))
    return 0
