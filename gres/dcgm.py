"""SM activity, SM occupancy and DRAM activity from DCGM, for the NVML backend's utilisation samples.

Why DCGM: CARMA's risk score needs SMACT/SMOCC/DRAMA (DCGM profiling fields 1002, 1003, 1005); NVML only
has coarse "a kernel ran" and "memory was touched" rates, which read 100 % for a GPU running one tiny
kernel in a loop. DCGM is optional: its Python bindings ship with the datacenter-gpu-manager package (not
on PyPI) and need the ``nv-hostengine`` daemon, so :func:`dcgm_source` returns None when the bindings are
absent and a :class:`DcgmSource` answers None (→ NVML fallback, ``source="nvml"``) while DCGM is down.

Assumes DCGM GPU ids equal NVML indices (DCGM's default enumeration on a node without GPU exclusions).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gpushare.gres.na import NA

log = logging.getLogger(__name__)

SMACT, SMOCC, DRAMA = 1002, 1003, 1005  # DCGM_FI_PROF_SM_ACTIVE, _SM_OCCUPANCY, _DRAM_ACTIVE
BINDING_DIRS = ("/usr/share/datacenter-gpu-manager-4/bindings/python3", "/usr/local/dcgm/bindings/python3")


def _import_reader() -> Any | None:
    """DCGM's ``DcgmReader`` class, or None when the bindings are not installed."""
    for directory in BINDING_DIRS:
        if Path(directory).is_dir() and directory not in sys.path:
            sys.path.append(directory)
    try:
        return importlib.import_module("DcgmReader").DcgmReader
    except Exception as exc:  # ImportError, or a binding that fails to load its library
        log.debug("DCGM bindings not usable: %s", exc)
        return None


class DcgmSource:
    """Callable ``index -> (smact, smocc, drama) | None``; one DCGM query serves all GPUs for ``max_age_s``."""

    def __init__(self, make_reader: Callable[[], Any], max_age_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._make_reader = make_reader
        self._reader: Any = None
        self._max_age_s = max_age_s
        self._clock = clock
        self._at = -float("inf")
        self._latest: dict[int, dict[int, Any]] = {}
        self._warned = False

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._at < self._max_age_s:
            return
        self._at = now
        try:
            if self._reader is None:
                self._reader = self._make_reader()
            self._latest = self._reader.GetLatestGpuValuesAsFieldIdDict() or {}
        except Exception as exc:  # hostengine down or profiling busy: fall back, say so once
            if not self._warned:
                log.warning("DCGM unavailable (%s); utilisation falls back to NVML", exc)
                self._warned = True
            self._latest = {}

    def __call__(self, index: int) -> tuple[float, float, float] | None:
        self._refresh()
        values = self._latest.get(index)
        if not values:
            return None
        return tuple(float(values[f]) if f in values else NA for f in (SMACT, SMOCC, DRAMA))  # type: ignore[return-value]


def dcgm_source(update_us: int = 1_000_000) -> DcgmSource | None:
    """A DcgmSource watching SMACT/SMOCC/DRAMA every ``update_us``, or None without DCGM bindings."""
    reader_cls = _import_reader()
    if reader_cls is None:
        return None
    return DcgmSource(lambda: reader_cls(fieldIds=[SMACT, SMOCC, DRAMA], updateFrequency=update_us))
