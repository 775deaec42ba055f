"""The warm worker (estimator_cli/warm_worker.py): a forked capture behaves exactly like a fresh
interpreter — same estimate, the caller's argv/env/cwd, limits, timeouts, no process left behind — and
the worker is private to its user, per import environment, and goes away when idle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpushare.estimator_cli import warm_worker
from gpushare.estimator_cli.cli import EXIT_LIMIT, EXIT_OK, main

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def estimate(capsys, *args: str) -> dict:
    capsys.readouterr()
    code = main(["--json", "--no-cache", *args])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    return json.loads(out)


def _pid_gone(pid: int) -> bool:
    """Gone, or a zombie waiting for a reaper (killed all the same)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_warm_capture_equals_a_cold_one_and_the_second_estimate_is_warm(capsys):
    args = [str(EXAMPLES / "grad_accum_train.py")]
    cold = estimate(capsys, "--no-warm", *args)
    first = estimate(capsys, *args)  # starts the worker if this session has none yet
    second = estimate(capsys, *args)
    assert cold["capture_process"] == "cold" and second["capture_process"] == "warm"
    for doc in (first, second):
        assert doc["targets"] == cold["targets"] and doc["iterations"] == cold["iterations"]


def test_the_script_sees_the_callers_argv_environment_and_directory(capsys, tmp_path, monkeypatch):
    script = tmp_path / "where.py"
    report = tmp_path / "seen.json"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, torch
        json.dump({{"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("GPUSHARE_TEST_VAR"),
                    "path0": sys.path[0]}}, open({str(report)!r}, "w"))
        model = torch.nn.Linear(8, 8).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            model(torch.randn(4, 8, device="cuda")).sum().backward()
            opt.step()
    """))
    seen = {}
    for process in ("cold", "warm"):
        workdir = tmp_path / process
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        monkeypatch.setenv("GPUSHARE_TEST_VAR", process)
        flags = ["--no-warm"] if process == "cold" else []
        estimate(capsys, *flags, str(script), "--lr", "3")  # twice warm: the first may start the worker
        doc = estimate(capsys, *flags, str(script), "--lr", "3")
        assert doc["capture_process"] == process
        seen[process] = json.loads(report.read_text())
        assert seen[process]["cwd"] == str(workdir) and seen[process]["var"] == process
    assert seen["warm"]["argv"] == seen["cold"]["argv"] == [str(script), "--lr", "3"]
    assert seen["warm"]["path0"] == seen["cold"]["path0"] == str(tmp_path)


def test_timeout_kills_the_forked_script_and_what_it_started(capsys, tmp_path):
    pids = tmp_path / "pids"
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(300)
    """))
    estimate(capsys, str(EXAMPLES / "forward_only.py"))  # make sure the worker is up
    capsys.readouterr()
    assert main(["--no-cache", "--timeout", "4", str(script)]) == EXIT_LIMIT
    time.sleep(0.5)
    assert all(_pid_gone(int(p)) for p in pids.read_text().split())


def test_a_killed_caller_takes_its_script_with_it(tmp_path):
    pids = tmp_path / "pids"
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        open({str(pids)!r}, "w").write(str(os.getpid()))
        time.sleep(300)
    """))
    command = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--no-cache", "--timeout", "200", str(script)]
    env = dict(os.environ)
    subprocess.run([sys.executable, "-m", "gpushare.estimator_cli.cli", "--no-cache", str(EXAMPLES / "forward_only.py")],
                   env=env, capture_output=True, check=True)  # the worker for this environment is up
    caller = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not pids.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    script_pid = int(pids.read_text())
    caller.send_signal(signal.SIGKILL)  # no chance to clean up: the worker's supervisor must
    caller.wait()
    deadline = time.monotonic() + 5
    while not _pid_gone(script_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pid_gone(script_pid)


def test_runtime_dir_must_be_private_to_the_user(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    env = {"XDG_RUNTIME_DIR": str(shared)}
    os.makedirs(shared / "gpushare", exist_ok=True)
    os.chmod(shared / "gpushare", 0o777)
    # XDG dir not private: not used at all (falls back to /tmp/gpushare-<uid>, itself checked)
    assert warm_worker.runtime_dir(env) == Path(f"/tmp/gpushare-{os.geteuid()}")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    (private / "gpushare").mkdir(mode=0o755)
    os.chmod(private / "gpushare", 0o755)  # someone loosened it: refuse rather than trust it
    with pytest.raises(warm_worker.WarmUnavailable, match="not a directory private"):
        warm_worker.runtime_dir({"XDG_RUNTIME_DIR": str(private)})


def test_fingerprint_follows_what_import_torch_reads_only():
    base = {"PATH": "/usr/bin", "HOME": "/home/a"}
    same = warm_worker.fingerprint(base)
    assert warm_worker.fingerprint({**base, "SLURM_JOB_ID": "7", "PATH": "/bin"}) == same
    for key, value in (("OMP_NUM_THREADS", "1"), ("PYTHONPATH", "/x"), ("TORCH_LOGS", "+dynamo"),
                       ("LD_PRELOAD", "/lib/x.so")):
        assert warm_worker.fingerprint({**base, key: value}) != same, key


def test_fingerprint_covers_the_environment_not_just_the_resolved_interpreter(tmp_path, monkeypatch):
    """Two venvs of one Python resolve to the same interpreter; their prefixes and installed
    distributions differ, and an in-place upgrade renames a ``*.dist-info`` directory."""
    base = {"HOME": "/home/a"}
    same = warm_worker.fingerprint(base)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert warm_worker.fingerprint(base) != same
    monkeypatch.undo()
    site = tmp_path / "site-packages"
    (site / "torch-2.13.0.dist-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(site))
    before = warm_worker.fingerprint(base)
    assert before != same
    (site / "torch-2.13.0.dist-info").rename(site / "torch-2.14.0.dist-info")
    assert warm_worker.fingerprint(base) != before


def _start_worker(tmp_path: Path, idle_s: float) -> tuple[subprocess.Popen, Path]:
    """A worker on a socket of the test's own, once it answers."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700, exist_ok=True)
    sock = runtime / "estimate-test.sock"
    proc = subprocess.Popen([sys.executable, "-m", "gpushare.estimator_cli.warm_worker", "--socket", str(sock),
                             "--idle", str(idle_s)])
    deadline = time.monotonic() + 60
    while warm_worker._hello(sock) is None and time.monotonic() < deadline:
        assert proc.poll() is None, "worker died while starting"
        time.sleep(0.1)
    return proc, sock


def test_an_idle_worker_exits_and_removes_its_socket(tmp_path):
    proc, sock = _start_worker(tmp_path, 1)
    assert warm_worker._hello(sock)["pid"] == proc.pid
    assert proc.wait(30) == 0
    assert not sock.exists()


def test_a_second_worker_for_the_same_socket_steps_aside(tmp_path):
    first, sock = _start_worker(tmp_path, 60)
    try:
        second = subprocess.run([sys.executable, "-m", "gpushare.estimator_cli.warm_worker", "--socket", str(sock),
                                 "--idle", "60"], timeout=30)
        assert second.returncode == 0 and warm_worker._hello(sock)["pid"] == first.pid
        assert warm_worker.stop_workers(sock.parent) == 1
        assert first.wait(10) == 0 and not sock.exists()
    finally:
        if first.poll() is None:
            first.kill()


def test_a_worker_that_went_idle_is_replaced_and_used_at_once(capsys):
    """The lock file outlives an idle worker; the next estimate must start a new one and use it, not
    mistake the free lock for a worker that died while starting."""
    args = [str(EXAMPLES / "forward_only.py")]
    estimate(capsys, *args)
    directory = warm_worker.runtime_dir()
    old = warm_worker._hello(warm_worker.socket_path())
    assert old and warm_worker.stop_workers(directory) >= 1  # others: tests with another environment
    deadline = time.monotonic() + 10
    while not _pid_gone(old["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(directory.glob("estimate-*.lock"))  # what the next start must not be fooled by
    doc = estimate(capsys, *args)
    assert doc["capture_process"] == "warm", doc.get("capture_process_note")
