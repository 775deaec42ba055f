"""Lets the OOM tests import their shared helper (oom_fake_slurm) under --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
