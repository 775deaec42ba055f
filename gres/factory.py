"""Open the device backend a node should use: ``nvml`` or ``sim:<state file>``.

Why one function: the agent, the prolog/epilog and the executor all take ``--device-backend`` (or the
``GPUSHARE_DEVICE_BACKEND`` environment variable), so a test cluster can point every one of them at the
same simulated state file with a single variable, and production defaults to NVML.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from gpushare.gres.device import GpuBackend

ENV_VAR = "GPUSHARE_DEVICE_BACKEND"
DEFAULT_SPEC = "nvml"


def open_backend(spec: str | None = None, clock: Callable[[], float] = time.time) -> GpuBackend:
    """``spec`` (else ``$GPUSHARE_DEVICE_BACKEND``, else ``nvml``): ``nvml`` | ``sim:<state file>``.

    ``clock`` only matters for the simulated backend. Raises ``ValueError`` naming the variable on a bad
    spec; opening NVML never fails here (the first call does, with a clear GpuError).
    """
    raw = spec if spec is not None else os.environ.get(ENV_VAR, DEFAULT_SPEC)
    kind, _, arg = raw.strip().partition(":")
    if kind == "nvml" and not arg:
        from gpushare.gres.dcgm import dcgm_source
        from gpushare.gres.nvml_backend import NvmlBackend

        return NvmlBackend(dcgm=dcgm_source())  # DCGM fields when its bindings are installed
    if kind == "sim" and arg:
        from gpushare.gres.sim_backend import SimBackend

        return SimBackend.open(arg, clock=clock)
    source = "device backend" if spec is not None else ENV_VAR
    raise ValueError(f"{source}: {raw!r} is not a backend; use 'nvml' or 'sim:/path/to/state.json'")
