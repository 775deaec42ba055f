"""Lets the estimator tests import their shared helper (estimator_run) under --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
