"""Decide whether a finished job died of GPU out-of-memory, from the tail of its logs and its exit.

Why the log tail: Slurm records a CUDA OOM as a plain FAILED job with exit code 1; only the framework's
message says what happened. Every pattern below is a message text the framework itself formats (the
source of each is listed in docs/oom-messages.md), so a generic "out of memory" from the host or from an
unrelated program does not trigger a requeue.

Rules, in order: a job that exited 0 is never an OOM, whatever it printed (training scripts log caught
OOMs and retry with smaller batches); a job whose last lines contain no recognised GPU OOM message is
never an OOM; otherwise the last matching line is the verdict. Only the last ``tail_bytes`` of each file
are read, so an old, recovered OOM far up a long log does not count either.

Reading the tails is gpushare.user_files ``read_tail``: this code runs as root (or SlurmUser) and the paths
come from the job, so the read happens in a child that has dropped to the job's uid/gid, opens with
O_NOFOLLOW and refuses anything but a regular file (docs/oom-messages.md, "Security").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from gpushare.policy.oom_recovery import OomVerdict


MAX_MESSAGE_CHARS = 300  # what we keep of a matched line: the ledger and the admin comment stay small


MAX_LINE_CHARS = 16384  # a longer line is judged by its last 16 KiB: the final error is at the end


@dataclass(frozen=True)
class OomPattern:
    """``regex`` (a head with no unbounded wildcard) plus, optionally, a literal that must (``after``) or
    must not (``not_after``) follow it on the line.

    Why split: ``head[^\n]*tail`` and ``head(?![^\n]*x)`` rescan the rest of the line at every head
    occurrence, quadratic on a long line of repeated heads (3 s at 256 KiB). Checking the literal once
    after the first (``after``) or last (``not_after``) head gives the same answer in linear time.
    """

    family: str  # "pytorch", "cuda-runtime", "cuda-libraries", "nccl", "tensorflow", "xla", "gpushare-backstop", "site"
    regex: re.Pattern[str]
    source: str  # where the text is formatted (file in the upstream repository)
    after: str | None = None
    not_after: str | None = None

    def matches(self, line: str) -> bool:
        if self.not_after is not None:
            last = None
            for last in self.regex.finditer(line):
                pass
            return last is not None and self.not_after not in line[last.end():]
        match = self.regex.search(line)
        return match is not None and (self.after is None or self.after in line[match.end():])


def _p(family: str, regex: str, source: str, after: str | None = None, not_after: str | None = None) -> OomPattern:
    return OomPattern(family, re.compile(regex), source, after, not_after)


BUILTIN_PATTERNS: tuple[OomPattern, ...] = (
    _p("pytorch", r"(?:CUDA|HIP) out of memory\. Tried to allocate", "pytorch c10/cuda/CUDACachingAllocator.cpp"),
    _p("pytorch", r"\btorch\.(?:cuda\.)?OutOfMemoryError: ", "pytorch torch/__init__.py (exception class)"),
    _p("cuda-runtime", r"CUDA error: out of memory", "pytorch c10/cuda/CUDAException.cpp + cudaGetErrorString"),
    _p("cuda-runtime", r"CUDA driver error: out of memory", "pytorch aten/src/ATen/cuda/Exceptions.h"),
    _p("cuda-runtime", r"\bcudaErrorMemoryAllocation\b", "CUDA runtime cudaError_t name"),
    _p("cuda-runtime", r"\bCUDA_ERROR_OUT_OF_MEMORY\b", "CUDA driver CUresult name (TF, JAX, MPS clients)"),
    _p("cuda-libraries", r"\bCUBLAS_STATUS_ALLOC_FAILED\b", "cuBLAS status; pytorch TORCH_CUDABLAS_CHECK"),
    _p("cuda-libraries", r"\bCUDNN_STATUS_ALLOC_FAILED", "cuDNN status; pytorch AT_CUDNN_CHECK"),
    _p("cuda-libraries", r"\bCUSOLVER_STATUS_ALLOC_FAILED\b", "cuSOLVER status"),
    _p("cuda-libraries", r"\bCUFFT_ALLOC_FAILED\b", "cuFFT result"),
    _p("nccl", r"Cuda failure (?:\d+ )?'out of memory'", "nccl src/include/checks.h CUDACHECK/CUCHECK"),
    _p("tensorflow", r"OOM when allocating tensor", "tensorflow core/framework/op_kernel.cc",
       not_after="device:CPU"),
    _p("xla", r"(?:RESOURCE_EXHAUSTED|XlaRuntimeError)\b", "xla stream_executor/integrations/tf_allocator_adapter.cc",
       after="Out of memory while trying to allocate"),
    _p("gpushare-backstop", r"^gpushare-agent: GPU out of memory \(backstop\): job \S+ stopped",
       "gpushare agent/backstop.py oom_message (the agent stopped the job over its memory cap)"),
    _p("xla", r"RESOURCE_EXHAUSTED: Failed to allocate request for ", "xla stream_executor/stream_executor_memory_allocator.cc",
       after=" on device ordinal"),
)


def compile_patterns(extra: Iterable[str] = ()) -> tuple[OomPattern, ...]:
    """Built-in patterns plus the site's ``[oom] patterns_extra`` (validated at config load)."""
    return BUILTIN_PATTERNS + tuple(_p("site", text, "site configuration [oom] patterns_extra") for text in extra)


def _clean(line: str) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in line).strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def find_oom(text: str, patterns: tuple[OomPattern, ...]) -> tuple[OomPattern, str] | None:
    """The last line of ``text`` that matches a pattern, with that pattern (None: no match)."""
    lines = re.split(r"[\r\n]+", text)
    for line in reversed(lines):
        if len(line) > MAX_LINE_CHARS:  # one giant line: only its end can be the final error
            line = line[-MAX_LINE_CHARS:]
        for pattern in patterns:
            if pattern.matches(line):
                return pattern, _clean(line)
    return None


def classify(tails: list[tuple[str, str | None]], exit_code: int, exit_signal: int,
             patterns: tuple[OomPattern, ...], problems: tuple[str, ...] = ()) -> OomVerdict:
    """Pure decision from (path, tail text or None) pairs and the job's exit status."""
    if exit_code == 0 and exit_signal == 0:
        return OomVerdict(False, "job exited 0: not a failure", problems=problems)
    for path, text in tails:
        if not text:
            continue
        found = find_oom(text, patterns)
        if found:
            pattern, line = found
            return OomVerdict(True, f"GPU out of memory ({pattern.family}) in {path}", pattern.family, line,
                              path, problems)
    status = f"exit {exit_code}" + (f", signal {exit_signal}" if exit_signal else "")
    if not any(text for _, text in tails):
        return OomVerdict(False, f"failed ({status}) and no log could be read", problems=problems, unread=True)
    return OomVerdict(False, f"failed ({status}) without a GPU out-of-memory message", problems=problems)
