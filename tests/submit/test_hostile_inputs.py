"""Hostile inputs to the privileged submit service: named estimate files and batch-script expansion.

Each test here reproduces an abuse found in a security read (docs/security.md) against the real functions.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import pytest

from gpushare.estimate.source import EstimateUnavailable, read_user_file
from gpushare.estimate.script_discovery import (MAX_COMMAND_BYTES, NotFound, TrainingCommand,
                                                     find_training_command)

UID = os.geteuid()


def test_fifo_with_a_waiting_writer_is_never_opened(tmp_path: Path) -> None:
    """Opening a FIFO for reading releases a writer blocked in open(); the service must only look it up."""
    fifo = tmp_path / "est.json"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # blocks until some reader opens the FIFO
        opened.set()
        os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    time.sleep(0.05)
    with pytest.raises(EstimateUnavailable, match="not usable"):
        read_user_file(str(fifo), None, UID, 1 << 20)
    assert not opened.wait(0.3), "the FIFO was opened with the service's privileges"
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
    thread.join(2)


def test_one_error_whether_or_not_a_hidden_path_exists(tmp_path: Path) -> None:
    """A path the user cannot see must not be probed through the error text."""
    present = tmp_path / "present.json"
    present.write_text("{}")
    errors = set()
    for path in (present, tmp_path / "absent.json", tmp_path / "absent" / "deeper.json"):
        with pytest.raises(EstimateUnavailable) as caught:
            read_user_file(str(path), None, UID + 1, 1 << 20)  # not the owner of the present file
        errors.add(str(caught.value).replace(str(path), "PATH"))
    assert len(errors) == 1, errors


def _peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_expansion_bomb_is_refused_before_it_is_built() -> None:
    """``A=<30 KB>`` then ``python t.py $A$A…``: once ~0.5 GB and 1.7 s per request."""
    script = "#!/bin/sh\nA=" + "x" * 30000 + "\npython t.py " + "$A" * 4000 + "\n"  # ~120 MB once expanded
    assert len(script) < 64 * 1024
    before = _peak_rss_kib()
    started = time.perf_counter()
    found = find_training_command(script)
    elapsed = time.perf_counter() - started
    assert isinstance(found, NotFound) and "expands" in found.reason
    assert elapsed < 0.5
    assert _peak_rss_kib() - before < 32 * 1024  # well under 32 MiB more than before


def test_many_words_each_within_the_word_cap_still_hit_the_command_cap() -> None:
    script = "A=" + "y" * 4000 + "\npython t.py " + " ".join(["$A"] * 40) + "\n"
    found = find_training_command(script)
    assert isinstance(found, NotFound) and str(MAX_COMMAND_BYTES) in found.reason


def test_ordinary_commands_with_variables_still_expand() -> None:
    found = find_training_command("BS=64\nDATA=/scratch/d\npython train.py --bs $BS --data ${DATA}/x\n")
    assert isinstance(found, TrainingCommand)
    assert found.args == ("--bs", "64", "--data", "/scratch/d/x")


@pytest.mark.parametrize("script", [
    "#!/bin/sh\n" + "a\n" * 32768,  # 64 KiB of short lines
    "#!/bin/sh\npython t.py " + "z" * 65000 + "\n",  # one huge line
    "#!/bin/sh\n" + "\x00" * 65000,  # NULs
    "#!/bin/sh\n" + "python t.py \\\n" * 4600,  # continuation lines joining into one
])
def test_hostile_shapes_are_fast(script: str) -> None:
    started = time.perf_counter()
    find_training_command(script)
    assert time.perf_counter() - started < 1.0


def test_busy_service_sheds_load_by_accepting_at_once(tmp_path: Path) -> None:
    """Worker threads are bounded; a request past the bound is answered 'accept' at once, not queued."""
    import socket

    from gpushare.config import parse_config
    from gpushare.slurm_plugins.submitd import SubmitServer

    path = str(tmp_path / "s.sock")
    server = SubmitServer(path, parse_config({}), max_workers=1)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    try:
        slow = socket.socket(socket.AF_UNIX)
        slow.connect(path)  # takes the only worker and sends nothing
        time.sleep(0.2)
        started = time.perf_counter()
        second = socket.socket(socket.AF_UNIX)
        second.settimeout(2)
        second.connect(path)
        reply = second.recv(100)
        assert reply == b"action=accept\nend\n" and time.perf_counter() - started < 0.5
        assert server.shed == 1
        slow.close()
        second.close()
    finally:
        server.shutdown()
        server.server_close()


def test_only_slurmctlds_user_may_ask_and_the_socket_is_born_private(tmp_path: Path) -> None:
    import pwd
    import socket
    import stat

    from gpushare.config import parse_config
    from gpushare.slurm_plugins.submitd import SubmitServer

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    other = next((p for p in pwd.getpwall() if p.pw_uid not in (0, os.geteuid())), None)
    if other is None:
        pytest.skip("no other user")
    import shutil
    import tempfile

    outer = tempfile.mkdtemp(prefix="gpushare-sock-", dir="/tmp")  # pytest's tmp is root-only
    os.chmod(outer, 0o755)
    path = os.path.join(outer, "s.sock")
    old_umask = os.umask(0)  # a careless environment: the service must still create a private socket
    try:
        server = SubmitServer(path, parse_config({}))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    os.chmod(path, 0o666)  # even if an admin opened the socket up, the kernel's peer uid decides
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    try:
        pid = os.fork()
        if pid == 0:  # the child becomes an ordinary user and asks
            code = 1
            try:
                os.setgid(other.pw_gid)
                os.setuid(other.pw_uid)
                conn = socket.socket(socket.AF_UNIX)
                conn.settimeout(2)
                conn.connect(path)
                try:
                    conn.sendall(b'{"op":"submit","user_id":0,"script":"#!/bin/sh\\n"}\n')
                    code = 0 if conn.recv(100) == b"" else 2  # closed without an answer
                except (BrokenPipeError, ConnectionResetError):
                    code = 0  # closed before or while we asked: also no answer
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        mine = socket.socket(socket.AF_UNIX)
        mine.settimeout(2)
        mine.connect(path)
        mine.sendall(b'{"op":"submit","user_id":0,"script":"#!/bin/sh\\n"}\n')
        assert mine.recv(100).startswith(b"action=")
        mine.close()
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(outer)
