"""``gpushare-task-prolog``: Slurm's TaskProlog (the job's user, inside the job's environment).

Its stdout shapes the job's environment (``export K=V``); printing nothing leaves the job as it is,
which is what happens on any error here.
"""

from __future__ import annotations

import sys


def main() -> int:
    return 0


if __name__ == "__main__":
    sys.exit(main())
