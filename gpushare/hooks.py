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


def run_hook(program: str, body: Callable[[Config], Any], log_file: Callable[[Config], str],
             on_failure: str) -> int:
    """Load the configuration, log to ``log_file(cfg)`` as ``program``, run ``body(cfg)``; always 0.

    ``on_failure`` finishes the log line of a failure (what happens to the job or node instead)."""
    try:
        cfg = load_config(warn=False)
    except Exception as exc:  # noqa: BLE001 - a bad configuration must not fail jobs or drain nodes
        setup_logging(program, "", syslog_fallback=True)
        log.error("%s: configuration unusable (%s); %s", program, exc, on_failure)
        return 0
    setup_logging(program, log_file(cfg), syslog_fallback=True)
    if cfg.missing_line():  # loud, in the hook's own log too, but the job goes on (defaults)
        log.warning("%s: %s", program, cfg.missing_line())
    try:
        body(cfg)
    except Exception:  # noqa: BLE001 - docs/style.md #10: never fail a job or drain a node on our account
        log.exception("%s failed (job %s); %s", program, os.environ.get("SLURM_JOB_ID", "-")[:20], on_failure)
    return 0
