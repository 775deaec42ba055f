"""Run one executor apply against file-backed doubles and SIGKILL ourselves at the N-th journaled step.

Usage: python kill_runner.py STATE.json SLURM.json JOURNAL_DIR N TARGET   (N < 0: never; prints labels)
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpushare.gres.sim_backend import SimBackend  # noqa: E402
from gpushare.mig_manager.executor import ExecSettings, Executor  # noqa: E402
from gpushare.mig_manager.journal import JournalStore  # noqa: E402
from gpushare.policy.layout import parse_layout  # noqa: E402
from gpushare.policy.fsm import MigSpace  # noqa: E402
from gpushare.policy.profiles import all_profiles  # noqa: E402
from gpushare.gpus import BUILTIN_GPUS  # noqa: E402
from mig_exec_fakes import NODE, FileSlurm  # noqa: E402


def main() -> int:
    state, slurm_path, journal_dir, kill_at, target = sys.argv[1:6]
    seen: list[str] = []

    def hook(label: str) -> None:
        seen.append(label)
        if len(seen) - 1 == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

    model = BUILTIN_GPUS["a100-40gb"]
    layout = {0: parse_layout(target, MigSpace.of(model, all_profiles(model)))}
    ex = Executor(NODE, SimBackend.open(state), FileSlurm(Path(slurm_path)), JournalStore(journal_dir),
                  ExecSettings(poll_s=0.01, wait_timeout_s=1), hook=hook)
    result = ex.apply(layout)
    print(" ".join(seen))
    print(result.outcome)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
