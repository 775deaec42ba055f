"""What concurrent test sessions on one machine must not share, and how each gets its own.

Several test clusters may run at once: ``make test`` runs the Slurm tiers with pytest-xdist workers, and two
separate pytest sessions may run side by side. Almost everything a cluster uses is already its own (a scratch
folder under /tmp with its config, state, logs, munge socket and key, MariaDB data and socket; ports the kernel
hands out free; the chroots' mounts in private namespaces). What is not is named here:

- :func:`slot`: a small index, the lowest one whose lock file (``/tmp/gpushare-test-slot-N.lock``) this process
  could lock, held until the process ends. Each xdist worker and each separate session holds a different
  one; a process that dies releases its slot with its descriptors. The multi-host cluster puts its hosts'
  loopback addresses in the slot's own range (127.0.10.x for slot 0, 127.0.11.x for slot 1, ...), so two
  multi-host clusters never bind the same ``address:port`` (the node agents' metrics port is fixed).
- :func:`host_lock`: one holder at a time, machine-wide, for what exists once per machine: creating the test
  users (two ``useradd`` of the same name at once: the second fails), and the hard cap's directory
  (/run/gpushare/hardcap, compiled into the shim; per-job files named by job id, which every cluster numbers
  from 1).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR = Path("/tmp")
SLOTS = 64  # loopback third octets 10..73
_held: dict[str, tuple[int, int]] = {}


def slot_lock(index: int) -> Path:
    return LOCK_DIR / f"gpushare-test-slot-{index}.lock"


def slot() -> int:
    """This process's test slot: taken on first use (the lowest free one), held until the process exits."""
    held = _held.get("slot")
    if held is not None and held[1] == os.getpid():  # a forked child takes its own
        return held[0]
    for index in range(SLOTS):
        fd = os.open(slot_lock(index), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held["slot"] = (index, os.getpid())
        return index
    raise RuntimeError(f"all {SLOTS} test slots are held ({slot_lock(0)} ...): too many test sessions at once")


def shifted_address(address: str, index: int) -> str:
    """``address`` (a loopback IPv4 address) in slot ``index``'s range: the third octet plus ``index``."""
    parts = address.split(".")
    if index == 0 or len(parts) != 4 or parts[0] != "127":
        return address
    third = int(parts[2]) + index
    if third > 255:
        raise ValueError(f"{address}: slot {index} leaves the loopback range")
    return ".".join((parts[0], parts[1], str(third), parts[3]))


@contextlib.contextmanager
def host_lock(name: str) -> Iterator[None]:
    """Hold ``/tmp/gpushare-test-<name>.lock`` (blocking) for the block: one holder on the machine at a time."""
    with open(LOCK_DIR / f"gpushare-test-{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
