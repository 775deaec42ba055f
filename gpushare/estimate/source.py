"""Where a job's memory estimate comes from: its directives, a gpu-estimate JSON it names, or the cache.

Security: the service that runs this is privileged (root or SlurmUser) and the estimate path comes from
the user's script. A file is used only if it is a regular file owned by the submitting user and small;
symlinks at the last component are refused (O_NOFOLLOW) and a symlinked directory cannot smuggle in
another user's file because ownership is checked on the opened descriptor. Nothing from the file is
echoed back beyond our own messages.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpushare.config import Config
from gpushare.errors import GpushareError
from gpushare.estimate.cache import command_cache_key, read_document, script_cache_key
from gpushare.estimate.directives import MAX_GPU_MEMORY, Directives
from gpushare.estimate.schema import byte_field, target_rows


@dataclass(frozen=True)
class Estimate:
    """Peak GPU memory a job needs as nvidia-smi would show it (reserved + CUDA context)."""

    total_bytes: int
    source: str  # "directive:mem", "directive:estimate", "cache", "learned" (raised after an OOM), "default"
    detail: str = ""
    # the estimate's split for the chosen GPU (Salus: weights + optimizer state vs per-iteration memory);
    # None when the estimate document has none
    persistent_bytes: int | None = None
    ephemeral_bytes: int | None = None


class EstimateUnavailable(GpushareError, ValueError):
    """The job named an estimate we cannot use; the message is safe to show the user."""


def read_user_file(path: str, work_dir: str | None, uid: int, max_bytes: int) -> bytes:
    """Read a small regular file owned by ``uid`` without following a final symlink.

    Why ``O_PATH`` first: this runs with the service's privileges on a path the user chose. Opening it for
    reading would already act (a device's open side effects, a FIFO's writer released), so the path is
    only *looked up* (``O_PATH|O_NOFOLLOW``), checked on that descriptor (regular, the user's, small), and
    re-opened for reading through it (same inode) only then. Every refusal is the same message, so the
    answer never tells a user whether a path they cannot see exists.
    """
    refused = EstimateUnavailable(f"estimate={path[:200]}: not usable (it must be a regular file that you own, "
                                  f"at most {max_bytes} bytes, not a symbolic link, on a file system the "
                                  "controller can read; gpu-estimate --annotate puts the estimate in the script "
                                  "itself)")
    target = Path(path)
    if not target.is_absolute():
        if not work_dir:
            raise EstimateUnavailable(f"estimate={path[:200]}: relative path and no working directory")
        target = Path(work_dir) / target
    try:
        handle = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        raise refused from None
    try:
        info = os.fstat(handle)
        # an unknown user (uid < 0) owns nothing: never a reason to skip the owner check
        if not stat.S_ISREG(info.st_mode) or uid < 0 or info.st_uid != uid or info.st_size > max_bytes:
            raise refused
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        raise refused from None
    finally:
        os.close(handle)
    try:
        return os.read(fd, max_bytes + 1)[:max_bytes]
    except OSError:
        raise refused from None
    finally:
        os.close(fd)


def peak_total_from_json(document: Any, gpu_names: list[str]) -> tuple[int, str]:
    """Pick the nvidia-smi-equivalent peak for the cluster's GPUs from a gpu-estimate JSON document.

    Accepts the estimator's schema (``targets``: a list of per-GPU results with ``gpu`` and
    ``peak_total_bytes``) and, for hand-written files, a top-level ``peak_total_bytes``. With several
    cluster GPU types the largest peak wins: the request must fit wherever Slurm places the job.
    """
    if not isinstance(document, dict):
        raise EstimateUnavailable("estimate JSON: expected an object")
    rows = target_rows(document)
    wanted = {name.lower() for name in gpu_names}
    chosen = [t for t in rows if str(t.get("gpu", "")).lower() in wanted] or rows
    peaks: list[tuple[int, str]] = []
    for row in chosen:
        value = byte_field(row, "peak_total_bytes")
        if value is not None:
            peaks.append((value, str(row.get("gpu", "?"))))
    top = byte_field(document, "peak_total_bytes")
    if not peaks and top is not None:
        peaks.append((top, "any"))
    if not peaks:
        raise EstimateUnavailable("estimate JSON: no peak_total_bytes found")
    best = max(peaks)
    if not 0 < best[0] <= MAX_GPU_MEMORY:
        raise EstimateUnavailable(f"estimate JSON: implausible peak_total_bytes {best[0]}")
    return best


def split_from_json(document: Any, gpu: str) -> tuple[int, int] | None:
    """(persistent_bytes, ephemeral_bytes) of the estimate's target ``gpu``, when the document has both
    for it (lanes, docs/agent.md); None otherwise or when implausible."""
    rows = [t for t in target_rows(document) if str(t.get("gpu", "?")) == gpu]
    if not rows and isinstance(document, dict):
        rows = [document]  # a hand-written file with top-level fields
    for row in rows:
        p, e = byte_field(row, "persistent_bytes"), byte_field(row, "ephemeral_bytes")
        if p is not None and e is not None and p >= 0 and e >= 0 and p + e <= MAX_GPU_MEMORY:
            return p, e
    return None


def _with_split(estimate: Estimate, document: Any, gpu: str) -> Estimate:
    split = split_from_json(document, gpu)
    if split is None:
        return estimate
    return Estimate(estimate.total_bytes, estimate.source, estimate.detail, split[0], split[1])


def cache_lookup(cfg: Config, script: str, gpu_names: list[str], uid: int,
                 command_key: str | None = None) -> Estimate | None:
    """An estimate cached for this exact batch script of this user (or, with ``command_key``, the OOM lesson
    of its training command), if one exists and parses."""
    try:
        document = read_document(cfg, command_key if command_key is not None else script_cache_key(script, uid))
    except ValueError:  # a bad uid
        return None
    if document is None:
        return None
    try:
        total, gpu = peak_total_from_json(document, gpu_names)
    except ValueError:
        return None
    source = "learned" if isinstance(document, dict) and isinstance(document.get("learned"), dict) else "cache"
    estimate = Estimate(total, source, _learned_detail(document) if source == "learned" else f"cached estimate for {gpu}")
    return estimate if source == "learned" else _with_split(estimate, document, gpu)


def _learned_detail(document: dict[str, Any]) -> str:
    lesson = document["learned"]
    job = str(lesson.get("from_job", "?"))[:12]
    failed = lesson.get("failed_gib")
    failed_text = f"{failed} GiB" if isinstance(failed, (int, float)) and not isinstance(failed, bool) else "its share"
    return f"raised after job {job} ran out of GPU memory in {failed_text}"


def find_estimate(cfg: Config, directives: Directives, script: str, work_dir: str | None, uid: int,
                  gpu_names: list[str]) -> Estimate | None:
    """The estimate to size the job with; raises EstimateUnavailable for a named but unusable file.

    An OOM lesson (gpushare.estimate.cache) is a floor under the script's own directives: a ``#GPUSHARE mem=``
    or ``estimate=`` line that an OOM has proven too small would otherwise size the rerun, or the next
    submission of the same script, into the same OOM. A directive above the lesson still wins.
    """
    chosen = _directive_estimate(cfg, directives, work_dir, uid, gpu_names)
    exact = cache_lookup(cfg, script, gpu_names, uid)
    key = command_cache_key(script, directives.script, work_dir, uid)
    lessons = [e for e in (exact, cache_lookup(cfg, script, gpu_names, uid, key) if key else None)
               if e is not None and e.source == "learned"]
    lesson = max(lessons, key=lambda e: e.total_bytes) if lessons else None
    if chosen is None and exact is not None and exact.source != "learned":
        chosen = exact
    if chosen is None:
        return lesson
    if lesson is not None and lesson.total_bytes > chosen.total_bytes:
        return Estimate(lesson.total_bytes, "learned", f"{lesson.detail}; {chosen.source} said "
                                                       f"{chosen.total_bytes / (1 << 30):.1f} GiB")
    return chosen


def _directive_estimate(cfg: Config, directives: Directives, work_dir: str | None, uid: int,
                        gpu_names: list[str]) -> Estimate | None:
    if directives.mem_bytes is not None:
        return Estimate(directives.mem_bytes, "directive:mem", f"line {directives.lines.get('mem', '?')}")
    if directives.inline is not None:
        document = {"targets": directives.inline}
        total, gpu = peak_total_from_json(document, gpu_names)
        return _with_split(Estimate(total, "directive:est", f"line {directives.lines.get('est', '?')} for {gpu}"),
                           document, gpu)
    if directives.estimate_path:
        raw = read_user_file(directives.estimate_path, work_dir, uid, cfg.submit.max_estimate_file_bytes)
        try:
            document = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise EstimateUnavailable(f"estimate={directives.estimate_path}: not JSON") from None
        total, gpu = peak_total_from_json(document, gpu_names)
        return _with_split(Estimate(total, "directive:estimate", f"{Path(directives.estimate_path).name} for {gpu}"),
                           document, gpu)
    return None
