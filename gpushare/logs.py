"""One logging setup for every gpushare program (services, hooks, CLIs).

Why one: the agent, the submit service, the estimation process and the hooks each wrote their own
handler and format, so one site's logs looked three ways and a hook that could not open its file lost
its messages. Here every program logs as ``<time> <program>[<pid>] <LEVEL> <logger>: <message>`` to its
configured file; when the file cannot be opened (or none is set) to standard error, and for hooks run by
Slurm (whose standard error nobody reads) also to syslog.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys


def setup_logging(program: str, log_file: str = "", level: str | int = "INFO", syslog_fallback: bool = False,
                  logger: str = "gpushare") -> logging.Logger:
    """Configure the ``logger`` tree for ``program``; returns it. Never raises for an unusable file."""
    handlers: list[logging.Handler] = []
    if log_file:
        try:
            # reopened when logrotate has moved the file (etc/logrotate.d/gpushare: no copytruncate, no signal)
            handlers.append(logging.handlers.WatchedFileHandler(log_file))
        except OSError as exc:
            sys.stderr.write(f"{program}: cannot write {log_file} ({exc.strerror or exc}); logging to stderr\n")
    if not handlers:
        handlers.append(logging.StreamHandler(sys.stderr))
        if syslog_fallback and os.path.exists("/dev/log"):
            try:
                handlers.append(logging.handlers.SysLogHandler(address="/dev/log"))
            except OSError:
                pass
    form = logging.Formatter(f"%(asctime)s {program}[%(process)d] %(levelname)s %(name)s: %(message)s")
    for handler in handlers:
        handler.setFormatter(form)
    root = logging.getLogger(logger)
    root.handlers[:] = handlers
    root.setLevel(level)
    return root
