"""The root of every error the suite raises on purpose.

Why one root: entry points (hooks, services, CLIs) turn our errors into a one-line message and an exit
status, and let anything else through to the fail-open handler with its traceback logged. Each error class
keeps its standard-library base too (ValueError, OSError, …) so callers that catch those keep working.
The message of every such error is one line saying what is wrong and where (the file, key, job or node).
"""

from __future__ import annotations


class GpushareError(Exception):
    """An error of ours: ``str(exc)`` is one line naming what is wrong and where."""
