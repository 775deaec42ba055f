"""OOM detection: real message texts per family, negatives, and hostile or broken log files."""

from __future__ import annotations

import multiprocessing
import os
import pwd
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Iterator

import pytest

from gpushare.epilog.oom_detect import BUILTIN_PATTERNS, classify, compile_patterns, find_oom
from gpushare.user_files import TailError, append_note, read_tail

MESSAGES = Path(__file__).parent / "messages"
POSITIVE = sorted(MESSAGES.glob("pos_*.txt"))
NEGATIVE = sorted(MESSAGES.glob("neg_*.txt"))
ME = os.geteuid()  # files the test itself wrote: read with our own credentials
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")


def _family(path: Path) -> str:
    stem = path.stem[len("pos_"):]
    return next(f for f in ("pytorch", "cuda_runtime", "cuda_libraries", "nccl", "tensorflow", "xla", "gpushare_backstop")
                if stem.startswith(f)).replace("_", "-")


def test_every_family_has_a_captured_message() -> None:
    families = {p.family for p in BUILTIN_PATTERNS}
    assert families == {_family(p) for p in POSITIVE}


@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_real_messages_are_recognised(path: Path) -> None:
    verdict = classify([(str(path), path.read_text())], 1, 0, BUILTIN_PATTERNS)
    assert verdict.is_oom, verdict.reason
    assert verdict.family == _family(path)
    assert verdict.message and len(verdict.message) <= 300


@pytest.mark.parametrize("path", NEGATIVE, ids=lambda p: p.stem)
def test_other_failures_are_not_oom(path: Path) -> None:
    verdict = classify([(str(path), path.read_text())], 1, 0, BUILTIN_PATTERNS)
    assert not verdict.is_oom
    assert "without a GPU out-of-memory message" in verdict.reason


def test_a_job_that_exits_0_is_never_an_oom() -> None:
    text = (MESSAGES / "exit0_caught_oom.txt").read_text()
    assert find_oom(text, BUILTIN_PATTERNS) is not None  # it does mention one...
    assert not classify([("log", text)], 0, 0, BUILTIN_PATTERNS).is_oom  # ...but it succeeded


def test_killed_by_signal_with_oom_message_is_oom() -> None:
    text = "Cuda failure 'out of memory'\n"
    assert classify([("log", text)], 0, 6, BUILTIN_PATTERNS).is_oom


def test_real_pytorch_traceback_from_the_allocator_format() -> None:
    """PyTorch's own exception class raised with the allocator's message format
    (c10/cuda/CUDACachingAllocator.cpp), printed by Python's own traceback machinery: the text a job's
    stderr holds after an uncaught CUDA OOM."""
    torch = pytest.importorskip("torch")
    message = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 39.39 GiB of "
               "which 1.20 GiB is free. Of the allocated memory 36.00 GiB is allocated by PyTorch, and 1.10 GiB "
               "is reserved by PyTorch but unallocated.")

    def step() -> None:
        raise torch.OutOfMemoryError(message)

    try:
        step()
    except torch.OutOfMemoryError:
        stderr = traceback.format_exc()  # the same formatter the interpreter uses for uncaught errors
    assert stderr.splitlines()[-1] == f"torch.OutOfMemoryError: {message}"
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError  # one class, printed as torch.OutOfMemoryError
    verdict = classify([("stderr", stderr)], 1, 0, BUILTIN_PATTERNS)
    assert verdict.is_oom and verdict.family == "pytorch"
    assert verdict.message.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")


def test_site_patterns_from_config() -> None:
    patterns = compile_patterns([r"MYSOLVER: device allocation failed"])
    verdict = classify([("log", "x\nMYSOLVER: device allocation failed (8 GB)\n")], 3, 0, patterns)
    assert verdict.is_oom and verdict.family == "site"


def test_last_match_wins_and_progress_bars_split(tmp_path: Path) -> None:
    text = "a\rprogress 1\rprogress 2\rRuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED\r"
    found = find_oom(text, BUILTIN_PATTERNS)
    assert found and found[1] == "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED"


# --- reading logs -----------------------------------------------------------------------------------


def test_enormous_sparse_log_reads_only_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "big.err"
    with open(log, "wb") as handle:
        handle.truncate(8 << 30)  # 8 GiB, sparse
        handle.seek(8 << 30)
        handle.write(b"\nRuntimeError: CUDA error: out of memory\n")
    started = time.monotonic()
    text = read_tail(str(log), 65536, uid=ME)
    assert time.monotonic() - started < 2.0
    assert len(text) <= 65536 and "CUDA error: out of memory" in text


def test_binary_junk_is_tolerated(tmp_path: Path) -> None:
    log = tmp_path / "junk.err"
    log.write_bytes(os.urandom(200_000) + b"\x00\xff\xfe\nCUBLAS_STATUS_ALLOC_FAILED\n" + b"\x00" * 100)
    text = read_tail(str(log), 4096, uid=ME)
    assert "\0" not in text
    assert classify([(str(log), text)], 1, 0, BUILTIN_PATTERNS).is_oom


def test_missing_and_relative_paths_raise_tail_error(tmp_path: Path) -> None:
    with pytest.raises(TailError, match="No such file"):
        read_tail(str(tmp_path / "absent.err"), 1024, uid=ME)
    with pytest.raises(TailError, match="absolute"):
        read_tail("relative.err", 1024, uid=ME)


def test_fifo_and_directory_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "job.err"
    os.mkfifo(fifo)
    with pytest.raises(TailError, match="regular file"):
        read_tail(str(fifo), 1024, uid=ME)
    with pytest.raises(TailError, match="regular file"):
        read_tail(str(tmp_path), 1024, uid=ME)


def test_symlink_at_the_log_path_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("CUDA error: out of memory\n")
    link = tmp_path / "job.err"
    link.symlink_to(secret)
    with pytest.raises(TailError, match="symbolic link"):
        read_tail(str(link), 1024, uid=ME)


def test_as_root_an_unknown_owner_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("root-only rule")
    log = tmp_path / "job.err"
    log.write_text("x\n")
    with pytest.raises(TailError, match="owner unknown"):
        read_tail(str(log), 1024, uid=None)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A scratch directory another uid can traverse (pytest's own tmp root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpushare-oom-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@root_only
def test_reads_happen_with_the_job_owners_credentials(open_tmp: Path) -> None:
    """A user cannot make root read a root-only file through a directory symlink or a copy in place."""
    nobody = pwd.getpwnam("nobody")
    secret_dir = open_tmp / "root-only"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "shadow").write_text("root:$6$secret:CUDA error: out of memory\n")
    user_dir = open_tmp / "user"
    user_dir.mkdir()
    os.chown(user_dir, nobody.pw_uid, nobody.pw_gid)
    (user_dir / "logs").symlink_to(secret_dir)  # intermediate-directory symlink: O_NOFOLLOW cannot see it
    with pytest.raises(TailError, match="Permission denied"):
        read_tail(str(user_dir / "logs" / "shadow"), 1024, nobody.pw_uid, nobody.pw_gid)
    own = user_dir / "job.err"
    own.write_text("ok\nCUDA error: out of memory\n")
    os.chown(own, nobody.pw_uid, nobody.pw_gid)
    os.chmod(own, 0o600)
    assert "out of memory" in read_tail(str(own), 1024, nobody.pw_uid, nobody.pw_gid)


@root_only
def test_note_is_appended_as_the_user_and_never_through_a_symlink(open_tmp: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    own = open_tmp / "job.err"
    own.write_text("trace\n")
    os.chown(own, nobody.pw_uid, nobody.pw_gid)
    append_note(str(own), "gpushare: requeued", nobody.pw_uid, nobody.pw_gid)
    assert own.read_text().endswith("\ngpushare: requeued\n")
    target = open_tmp / "root-file"
    target.write_text("keep\n")
    os.chmod(target, 0o644)
    (open_tmp / "evil.err").symlink_to(target)
    with pytest.raises(TailError):
        append_note(str(open_tmp / "evil.err"), "x", nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(TailError):  # and a root-owned file is simply not writable for the user
        append_note(str(target), "x", nobody.pw_uid, nobody.pw_gid)
    assert target.read_text() == "keep\n"


def _read_as_unprivileged_slurmuser(path: str, job_uid: int, out: "multiprocessing.Queue") -> None:
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
    try:
        out.put(("ok", read_tail(path, 1024, job_uid, job_uid)))
    except TailError as exc:
        out.put(("error", str(exc)))


@root_only
def test_unprivileged_slurmuser_reads_only_what_it_may(open_tmp: Path) -> None:
    """With SlurmUser=slurm the hook is not root: it reads as itself and can never read more, and only the
    job's user's own files (a world-readable file of someone else's is no log of the job's)."""
    ctx = multiprocessing.get_context("fork")
    readable = open_tmp / "group-readable.err"
    readable.write_text("CUDA error: out of memory\n")
    os.chmod(readable, 0o644)
    os.chown(readable, 4242, 4242)
    private = open_tmp / "private.err"
    private.write_text("CUDA error: out of memory\n")
    os.chmod(private, 0o600)
    results = []
    for path in (readable, private):
        queue = ctx.Queue()
        proc = ctx.Process(target=_read_as_unprivileged_slurmuser, args=(str(path), 4242, queue))
        proc.start()
        results.append(queue.get(timeout=20))
        proc.join(20)
    assert results[0] == ("ok", "CUDA error: out of memory\n")
    assert results[1][0] == "error" and "not a file of the job's user" in results[1][1]


def test_the_agents_backstop_stop_is_an_oom_of_the_job_its_own() -> None:
    """The line the agent writes when it stops a job over its cap is recognised (corroboration still
    decides whether it earns a re-run, as for any other message)."""
    from gpushare.agent.backstop import oom_message, oom_record
    from gpushare.epilog.oom_detect import BUILTIN_PATTERNS, classify

    record = oom_record(0, 9 << 30, 6 << 30, 1 << 29, 100.0, 112.0, "stop")
    verdict = classify([("/home/a/job.err", "step 1\n" + oom_message("42", record))], 0, 9, BUILTIN_PATTERNS)
    assert verdict.is_oom and verdict.family == "gpushare-backstop"
    warned = oom_record(0, 9 << 30, 6 << 30, 1 << 29, 100.0, 112.0, "record")  # only recorded, not stopped
    assert not classify([("/e", oom_message("42", warned))], 1, 0, BUILTIN_PATTERNS).is_oom
