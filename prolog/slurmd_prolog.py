"""``gpushare-prolog``: Slurm's node Prolog (root, on the job's node, before the job starts).

A failing Prolog drains the node (SLURM-FACTS.md), so this entry point catches everything and exits 0:
our own problems are logged, never turned into a drained node.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("gpushare.prolog")


def main() -> int:
    try:
        return 0
    except Exception:  # noqa: BLE001 - never fail a job or drain a node on our account
        log.exception("prolog failed; job proceeds")
        return 0


if __name__ == "__main__":
    sys.exit(main())
