"""Hard per-job device memory caps set by the Prolog and cleared by the Epilog (docs/isolation.md).

Two backends, chosen by ``[agent] hardcap`` for each fraction-capped shared job:

- ``driver``: the NVIDIA driver's own per-cgroup limits (r615+; ``gpushare.gres.memlimits`` behind the device
  interface): the job's cgroup (``…/slurmstepd.scope/job_<id>``, which exists at Prolog time only under
  ``proctrack/cgroup`` with ``PrologFlags=Contain``) gets hard limit = the job's cap (soft 0: a soft limit
  propagates into the shared ``slurmstepd.scope`` ancestor) on each of the job's GPUs. Where it cannot be
  set (driver too old, accounting off, MIG, no job cgroup) the reason is logged once per node until it
  changes, and ``auto`` falls back to the shim. What was set is recorded in the job's directory for the
  Epilog, which clears it (removing the cgroup would too, but Slurm may remove it after the Epilog).
- ``shim`` (gres/hardcap/hardcap.c): ``<dir>/job_<id>/gpu<ordinal>`` = ``"<limit_bytes> <context_bytes> <uuid>"``
  (``context_bytes``: ``context_charge`` of that GPU) for each of the job's GPUs as the job numbers them
  (0..n-1: Slurm's device cgroup and ``CUDA_VISIBLE_DEVICES`` renumber them), root-owned 0644 (the shim
  ignores anything else), and the job's shared usage files ``gpu<ordinal>.state`` owned by the job's user,
  0600 (the shim maps them from inside the job). The TaskProlog then preloads the library (``preload_line``).

Everything here runs as root: the job id is checked against digits before it becomes a path, the cgroup
is found by globbing that id under the cgroup root (never taken from the job's environment), and the
Epilog's record is read back with ``O_NOFOLLOW`` and used only when root owns it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from gpushare.atomic import flock_within, write_json_atomic, write_text_atomic
from gpushare.cuda_context import DEFAULT_SM_ARCH, context_bytes_for, sm_arch_of
from gpushare.run_dir import HARDCAP_DIR, make_run_dir

if TYPE_CHECKING:
    from gpushare.gres.device import GpuBackend, GpuInfo

# Charged once per process and GPU for the CUDA context and the library kernels loaded into it, which the
# driver allocates out of the shim's sight but which count against the job's share on the device (and in the
# backstop's samples). Per GPU it is gpushare.cuda_context's figure for the GPU's generation (``context_charge``):
# the same number the estimator adds to a job's need and the agent subtracts from it for PyTorch's fraction, so
# the three agree on what a job's allocations may take. This is the figure for a GPU the backend cannot name.
CONTEXT_BYTES = context_bytes_for(DEFAULT_SM_ARCH)
_JOB_RE = re.compile(r"^\d{1,10}$")
_PATH_RE = re.compile(r"^[A-Za-z0-9_./+@-]{1,4096}$")
_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}$")
CGROUP_ROOT = "/sys/fs/cgroup"
DRIVER_RECORD = "driver"  # in the job's directory: {"cgroup": path, "gpus": [NVML indices]} for the Epilog
UNAVAILABLE_NOTE = "driver-unavailable"  # in the hard cap directory: the reason last logged

log = logging.getLogger("gpushare.prolog")


def job_dir(job: str, root: str = HARDCAP_DIR) -> Path:
    if not _JOB_RE.match(job):
        raise ValueError(f"job id {job[:20]!r} is not a number")
    return Path(root) / f"job_{job}"


def _make_dirs(root: str) -> None:
    """The runtime directory and the hard cap folder in it, both reachable by every user: the shim opens the
    limits as the job's user (``gpushare.run_dir``; a runtime directory made 0700 by anything else before
    once left every job of the node uncapped)."""
    make_run_dir(Path(root).parent)
    make_run_dir(root)


def context_charge(info: GpuInfo) -> int:
    """The shim's per-process charge on this GPU: its CUDA context and library kernels, by compute
    capability (as the agent's ``outside_allocator_bytes`` in gpushare.node.jobs.build_entry)."""
    return context_bytes_for(sm_arch_of(info.model, info.name))


def write_limits(job: str, uid: int, gpus: int, limit_bytes: int, root: str = HARDCAP_DIR,
                 context_bytes: int | Sequence[int] = CONTEXT_BYTES, uuids: Sequence[str] = ()) -> Path:
    """Write the limits and usage files of ``job``'s ``gpus`` GPUs; returns the job's directory.

    ``context_bytes``: the per-process context charge, one for all GPUs or one per GPU in the job's order
    (``CONTEXT_BYTES`` for a GPU without one). ``uuids`` (the GPUs' in the job's order) go into the limits
    files as a third field: the shim matches NVML's devices by them to clamp NVML's memory info; without
    them NVML is not clamped."""
    if uid < 0 or gpus < 1 or limit_bytes <= 0:
        raise ValueError(f"job {job}: uid {uid}, {gpus} GPUs, limit {limit_bytes} B: nothing to cap")
    contexts = [context_bytes] * gpus if isinstance(context_bytes, int) else list(context_bytes)
    contexts += [CONTEXT_BYTES] * (gpus - len(contexts))
    if not all(isinstance(c, int) and 0 <= c < 1 << 40 for c in contexts):
        raise ValueError(f"job {job}: context charges {contexts} are not byte counts")
    directory = job_dir(job, root)
    _make_dirs(root)
    directory.mkdir(mode=0o755, exist_ok=True)
    if directory.is_symlink() or (directory.stat().st_uid != 0 and os.geteuid() == 0):
        raise ValueError(f"{directory} is not root's own directory")
    os.chmod(directory, 0o755)
    for ordinal in range(gpus):
        uuid = uuids[ordinal] if ordinal < len(uuids) and _UUID_RE.match(uuids[ordinal]) else ""
        write_text_atomic(directory / f"gpu{ordinal}", f"{limit_bytes} {contexts[ordinal]} {uuid}".rstrip() + "\n",
                          mode=0o644)
        state = directory / f"gpu{ordinal}.state"
        fd = os.open(state, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, 0)  # a fresh budget: nothing of an earlier job with this id survives
            if os.geteuid() == 0:
                os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
    return directory


def clear(job: str, root: str | None = None, backend: GpuBackend | None = None, device_backend: str | None = None) -> None:
    """The Epilog's step: clear the driver limits the Prolog recorded for ``job`` (while its cgroup still
    exists), then remove the job's limits and usage files. Never raises: a failure is logged."""
    try:
        directory = job_dir(job, root or HARDCAP_DIR)
    except ValueError:
        return
    record = _read_record(directory / DRIVER_RECORD, job)
    if record is not None and os.path.isdir(record[0]):
        cgroup, gpus = record
        try:
            if backend is None:
                from gpushare.gres import open_backend

                backend = open_backend(device_backend)
            for index in gpus:
                backend.clear_memory_limit(index, cgroup)
        except Exception as exc:  # noqa: BLE001 - removing the cgroup clears them too
            log.warning("job %s: driver memory limits on %s not cleared (%s); they go with the cgroup", job, cgroup, exc)
    shutil.rmtree(directory, ignore_errors=True)


def _read_record(path: Path, job: str) -> tuple[str, list[int]] | None:
    """The Prolog's driver record: only a root-owned regular file (O_NOFOLLOW) naming this job's cgroup."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (os.geteuid() == 0 and st.st_uid != 0) or st.st_size > 4096:
            return None
        raw = json.loads(os.read(fd, 4096))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    cgroup, gpus = (raw.get("cgroup"), raw.get("gpus")) if isinstance(raw, dict) else (None, None)
    if (not isinstance(cgroup, str) or not _PATH_RE.match(cgroup) or "/../" in cgroup + "/"
            or not cgroup.endswith(f"/job_{job}") or not isinstance(gpus, list)
            or not all(isinstance(g, int) and 0 <= g < 4096 for g in gpus)):
        log.warning("job %s: driver limits record %s is malformed; ignored", job, path)
        return None
    return cgroup, gpus


def job_cgroup(job: str, cgroup_root: str = CGROUP_ROOT) -> tuple[str | None, str]:
    """The job's cgroup v2 directory (``…/slurmstepd.scope/job_<id>``), or None and why there is none."""
    job_dir(job)  # digits only: safe in a glob
    base = Path(cgroup_root)
    if not (base / "cgroup.controllers").is_file():
        return None, f"{cgroup_root} is not a cgroup v2 hierarchy"
    hits = {p for pattern in (f"system.slice/*slurmstepd.scope/job_{job}", f"*slurmstepd.scope/job_{job}")
            for p in base.glob(pattern) if p.is_dir() and not p.is_symlink()}
    if len(hits) != 1:
        return None, (f"no job cgroup under {cgroup_root} (jobs get one before the Prolog only with "
                      "proctrack/cgroup, cgroup/v2 and PrologFlags=Contain)" if not hits
                      else f"several job cgroups under {cgroup_root}")
    return str(hits.pop()), ""


def _driver_reason(exc: Exception) -> str:
    from gpushare.gres.errors import GpuError, NvmlCode

    code = exc.code if isinstance(exc, GpuError) else None
    if code is NvmlCode.FUNCTION_NOT_FOUND:
        return "the driver has no per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1 needs r615 or newer)"
    if code is NvmlCode.NOT_SUPPORTED:
        return (f"the driver does not account device memory per cgroup here ({exc}; kernel {os.uname().release}: "
                "dmem needs 6.14+, older kernels the driver's own accounting)")
    if code is NvmlCode.NO_PERMISSION:
        return "setting driver memory limits needs root"
    return f"driver memory limits failed: {exc}"


def apply_driver(job: str, gpus: Sequence[int], limit_bytes: int, backend: GpuBackend, root: str = HARDCAP_DIR,
                 cgroup_root: str = CGROUP_ROOT) -> str:
    """Set the driver's hard limit on the job's cgroup for each of its GPUs; "" when set, else why not
    (then nothing is left set: a GPU that took its limit is cleared again)."""
    cgroup, why = job_cgroup(job, cgroup_root)
    if cgroup is None:
        return why
    done: list[int] = []
    try:
        for index in gpus:
            if backend.gpu(index).mig_current is True:
                return f"GPU {index} is in MIG mode (the driver's memory limits do not cover MIG)"
            backend.set_memory_limit(index, cgroup, limit_bytes, 0)
            done.append(index)
        directory = job_dir(job, root)
        _make_dirs(root)
        directory.mkdir(mode=0o755, exist_ok=True)
        write_json_atomic(directory / DRIVER_RECORD, {"cgroup": cgroup, "gpus": list(done)}, mode=0o644)
        return ""
    except Exception as exc:  # noqa: BLE001 - any failure: undo, say why, the next backend applies
        for index in done:
            try:
                backend.clear_memory_limit(index, cgroup)
            except Exception:  # noqa: BLE001 - the cgroup's removal clears it at the job's end
                pass
        return _driver_reason(exc)


def _say_once(root: str, job: str, why: str, then: str) -> None:
    """Log why the driver backend does not apply at WARNING once per node until the reason changes (under
    a lock: the Prologs of jobs starting together must not all say it)."""
    note = Path(root) / UNAVAILABLE_NOTE
    fd = -1
    try:
        _make_dirs(root)
        fd = os.open(f"{note}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if not flock_within(fd, 2.0):
            raise OSError("lock busy")
        seen = note.read_text() if note.is_file() and not note.is_symlink() else ""
        if seen.strip() != why:
            write_text_atomic(note, why + "\n", mode=0o644)
    except OSError:
        seen = ""  # cannot remember: say it
    finally:
        if fd >= 0:
            os.close(fd)
    if seen.strip() == why:
        log.debug("job %s: driver memory limits unavailable (%s); %s", job, why, then)
    else:
        log.warning("job %s: driver memory limits unavailable: %s; %s (said once until this changes)", job, why, then)


def apply(job: str, uid: int, gpus: Sequence[int], exports: Mapping[str, str], mode: str, root: str | None = None,
          backend: GpuBackend | None = None, device_backend: str | None = None, cgroup_root: str = CGROUP_ROOT) -> str:
    """The Prolog's step for a fraction-capped job: "driver" (limits set), "shim" (files written: the
    TaskProlog is to preload the shim) or "" (not hard-capped; the backstop still holds). Never raises."""
    if mode not in ("shim", "driver", "auto") or exports.get("GPUSHARE_CAPS_MODE") != "fraction":
        return ""
    root = root or HARDCAP_DIR  # read now, not at import: tests point it elsewhere
    try:
        limit = int(str(exports.get("GPUSHARE_MEM_LIMIT_MIB", ""))) << 20
        if limit <= 0:
            raise ValueError(f"limit {limit} B")
        job_dir(job, root)
        if mode in ("driver", "auto"):
            try:
                if backend is None:
                    from gpushare.gres import open_backend

                    backend = open_backend(device_backend)
                why = apply_driver(job, gpus, limit, backend, root, cgroup_root)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot open: the next one applies
                why = f"device backend unavailable ({exc})"
            if not why:
                log.info("job %s: driver memory limit %d MiB set on GPUs %s", job, limit >> 20, list(gpus))
                return "driver"
            _say_once(root, job, why, "using the shim" if mode == "auto" else "not hard-capped (the backstop holds)")
            if mode == "driver":
                return ""
        uuids, contexts = _gpu_facts(gpus, backend, device_backend)
        write_limits(job, uid, len(gpus), limit, root, context_bytes=contexts, uuids=uuids)
        return "shim"
    except (OSError, ValueError) as exc:
        log.warning("job %s: hard cap not set (%s); the job runs without the hard cap", job, exc)
        return ""


def _gpu_facts(gpus: Sequence[int], backend: GpuBackend | None,
               device_backend: str | None) -> tuple[list[str], list[int]]:
    """The GPUs' UUIDs for the shim's NVML clamp and their context charges (``context_charge``); ([], [])
    when the device backend cannot say: NVML is not clamped and each GPU is charged ``CONTEXT_BYTES``."""
    try:
        if backend is None:
            from gpushare.gres import open_backend

            backend = open_backend(device_backend)
        infos = [backend.gpu(index) for index in gpus]
        return [info.uuid for info in infos], [context_charge(info) for info in infos]
    except Exception as exc:  # noqa: BLE001 - the cap itself does not need them
        log.info("GPU facts unavailable (%s); NVML's memory info is not clamped, the context charge is %d MiB",
                 exc, CONTEXT_BYTES >> 20)
        return [], []


def preload_line(env: Mapping[str, str], library: str) -> list[str]:
    """``export LD_PRELOAD=<library>[:<user's>]`` for the TaskProlog; nothing where the library is missing
    or a path has characters that cannot be passed on safely."""
    if not _PATH_RE.match(library) or not os.path.isfile(library):
        return []
    user = [p for p in re.split(r"[: ]", env.get("LD_PRELOAD", "")) if p and p != library]
    value = ":".join([library] + user)
    if not _PATH_RE.match(value.replace(":", "/")):
        return []
    return [f"export LD_PRELOAD={value}"]
