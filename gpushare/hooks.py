"""How every hook Slurm runs as root starts and ends: configuration, logging, and exit 0 whatever happens.

Why one function: a Prolog that exits non-zero drains the node and an Epilog that does the same can
fail or requeue jobs (docs/compatibility.md), so each hook catches everything, logs it loudly and exits
0. Written once here, the three hooks cannot drift apart on that rule (one once returned early without a
log line when its configuration was unreadable).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from gpushare.config import Config, load_config
from gpushare.logs import setup_logging

log = logging.getLogger("gpushare")


def no_file_line(program: str, cfg: Config) -> str:
    """The one ERROR line of a hook that found no gpushare.toml, which then does nothing.

    Why nothing, not the built-in defaults: the admin checked one file (``gpushare config check``, ``gpushare
    doctor``), and a hook on defaults would act on other settings than those, unseen (a site that set
    ``[policy] mode = "off"`` or its own OOM policy would still have jobs requeued by the defaults'). The job
    goes on untouched, as with gpushare off for it; the line names every path tried and the fix."""
    tried = ", ".join(cfg.tried) or "nothing"
    return (f"{program}: no gpushare.toml (tried {tried}): doing nothing for job "
            f"{os.environ.get('SLURM_JOB_ID', '-')[:20]}, which goes on untouched; install the site's file there, "
            "or name it in the hook's environment (GPUSHARE_CONFIG: the wrappers gpushare slurm-config "
            "--install-hooks/--install-chains writes do), then run gpushare doctor")


def run_hook(program: str, body: Callable[[Config], Any], log_file: Callable[[Config], str],
             on_failure: str) -> int:
    """Load the configuration, log to ``log_file(cfg)`` as ``program``, run ``body(cfg)``; always 0.

    No file found: one ERROR line (``no_file_line``) and nothing else. ``on_failure`` finishes the log line
    of a failure (what happens to the job or node instead)."""
    try:
        cfg = load_config(warn=False)
    except Exception as exc:  # noqa: BLE001 - a bad configuration must not fail jobs or drain nodes
        setup_logging(program, "", syslog_fallback=True)
        log.error("%s: configuration unusable (%s); %s", program, exc, on_failure)
        return 0
    setup_logging(program, log_file(cfg), syslog_fallback=True)
    if not cfg.from_file:
        log.error("%s", no_file_line(program, cfg))
        return 0
    try:
        body(cfg)
    except Exception:  # noqa: BLE001 - docs/style.md #10: never fail a job or drain a node on our account
        log.exception("%s failed (job %s); %s", program, os.environ.get("SLURM_JOB_ID", "-")[:20], on_failure)
    return 0
