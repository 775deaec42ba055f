"""Lets the executor tests import their shared doubles (mig_exec_fakes) under --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
