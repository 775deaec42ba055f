"""The executor's settings and result records (split out so the CLI and tests need not import the machine).

``ExecSettings`` mirrors ``[mig]`` in gpushare.toml (``gpushare.config.MigSection``; ``reshape.settings``
maps one to the other); a ``Result`` is what ``apply`` and ``reconcile`` return and the CLI prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Outcome = Literal["applied", "already", "rolled_back", "busy", "rate_limited", "nothing", "proposed"]


@dataclass(frozen=True)
class ExecSettings:
    """The ``[mig]`` settings the executor uses (see gpushare.config.MigSection)."""

    drain: str = "node"  # "node": drain while reshaping; "none": rely on the busy checks alone
    wait: str = "affected"  # "affected": wait for jobs on affected profiles; "node": for every GPU job
    wait_timeout_s: float = 600.0
    verify_timeout_s: float = 60.0
    poll_s: float = 2.0
    max_per_hour: int = 2
    dev_dir: str = "/dev"
    cap_device_major: int = 0  # >0: create missing nvidia-cap devices with this major (simulated nodes)
    shards: bool = True  # shard lines for GPUs not in MIG mode
    reason_prefix: str = "gpushare-mig"
    mode: str = "enforce"  # [policy] mode: observe proposes a reshape (recorded) and applies none; off: nothing


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str
