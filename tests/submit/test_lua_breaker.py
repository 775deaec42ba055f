"""The real job_submit.lua under lua5.1 against a hung service: deadline bounded, then a circuit breaker.

slurmctld holds its job write lock while the shim waits, so a hung gpushare-submitd must not cost every
GPU job the full deadline: after ``breaker_timeouts`` deadlines in a row the shim skips the service for
``breaker_open_s`` (jobs accepted unchanged at once), then tries again.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from gpushare.config import ConfigError, parse_config
from gpushare.slurm_plugins.slurm_config import render_lua

DRIVER = r"""
local logs = {}
slurm = {SUCCESS = 0, ERROR = -1,
  log_error = function(fmt, ...) table.insert(logs, string.format(fmt, ...)) end,
  log_info = function(fmt, ...) end, log_user = function(fmt, ...) end}
dofile(arg[1])
local socket = require("socket")
for i = 1, tonumber(arg[2]) do
  local job = {tres_per_node = "gres:gpu:1", script = "#!/bin/sh\n", name = "j"}
  local t0 = socket.gettime()
  local rc = slurm_job_submit(job, {}, 1000)
  print(string.format("%d %.3f %s", rc, socket.gettime() - t0, logs[#logs] or ""))
end
"""


def lua_with_sockets() -> str:
    """The lua5.1 interpreter the shim runs under, with lua-socket; the test is skipped without them."""
    lua = shutil.which("lua5.1")
    if not lua or subprocess.run([lua, "-e", 'require("socket.unix")'], capture_output=True).returncode:
        pytest.skip("lua5.1 with lua-socket not installed")
    return lua


def unix_server(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return server


def test_hung_service_trips_the_breaker(tmp_path: Path) -> None:
    lua = lua_with_sockets()
    path = tmp_path / "s.sock"
    server = unix_server(path)
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_hang() -> None:  # a service that takes the connection and never answers
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_hang, daemon=True)
    thread.start()
    cfg = parse_config({"submit": {"socket": str(path), "timeout_ms": 200, "breaker_timeouts": 3,
                                   "breaker_open_s": 60}})
    shim = tmp_path / "job_submit.lua"
    shim.write_text(render_lua(cfg))
    driver = tmp_path / "driver.lua"
    driver.write_text(DRIVER)
    try:
        out = subprocess.run([lua, str(driver), str(shim), "6"], capture_output=True, text=True, timeout=30,
                             check=True).stdout.splitlines()
    finally:
        stop.set()
        thread.join(2)
        server.close()
        for conn in held:
            conn.close()
    rows = [line.split(" ", 2) for line in out]
    assert all(rc == "0" for rc, _, _ in rows)  # every job accepted
    waits = [float(w) for _, w, _ in rows]
    assert all(0.15 < w < 0.5 for w in waits[:3]), waits  # each bounded by the deadline
    assert all(w < 0.02 for w in waits[3:]), waits  # then skipped at once
    assert "skipped" in rows[-1][2]


def test_the_deadline_is_capped_near_one_second() -> None:
    with pytest.raises(ConfigError, match="timeout_ms"):
        parse_config({"submit": {"timeout_ms": 5000}})


FIELDS_DRIVER = r"""
slurm = {SUCCESS = 0, ERROR = -1, log_error = function(fmt, ...) end, log_info = function(fmt, ...) end,
  log_user = function(fmt, ...) end}
dofile(arg[1])
local job = {tres_per_node = "gres/gpu:1", script = "#!/bin/sh\n#GPUSHARE mem=4G\n", name = "j", partition = "mig,mig80",
  min_nodes = 1}
print(slurm_job_submit(job, {}, 1000), job.tres_per_node)
local plain = {tres_per_node = "gres/gpu:1", script = "#!/bin/sh\n", name = "k"}
print(slurm_job_submit(plain, {}, 1000), plain.tres_per_node)
"""


def test_the_shim_sends_what_the_decision_reads_partition_included(tmp_path: Path) -> None:
    """The real shim's request, decoded by the service's own parser: the fields the decision uses arrive
    (the partition is what lets an estimate pick a MIG slice), and the service's reply is applied."""
    from gpushare.slurm_plugins.protocol import decode_request

    lua = lua_with_sockets()
    path = tmp_path / "s.sock"
    server = unix_server(path)
    server.listen(8)
    server.settimeout(20)
    lines: list[bytes] = []

    def answer() -> None:
        for reply in (b"action=modify\ntres_per_node=gres/gpu:1g.10gb:1\nend\n", b"action=accept\nend\n"):
            conn = server.accept()[0]
            with conn, conn.makefile("rb") as reader:
                lines.append(reader.readline())
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    shim, driver = tmp_path / "job_submit.lua", tmp_path / "driver.lua"
    shim.write_text(render_lua(parse_config({"submit": {"socket": str(path), "timeout_ms": 900}})))
    driver.write_text(FIELDS_DRIVER)
    try:
        out = subprocess.run([lua, str(driver), str(shim)], capture_output=True, text=True, timeout=30, check=True)
    finally:
        thread.join(5)
        server.close()
    assert out.stdout.split() == ["0", "gres/gpu:1g.10gb:1", "0", "gres/gpu:1"]
    _, request, _ = decode_request(lines[0])
    assert (request.partition, request.tres_per_node, request.min_nodes) == ("mig,mig80", "gres/gpu:1", 1)
    assert "#GPUSHARE mem=4G" in request.script and request.user_id == 1000
    assert decode_request(lines[1])[1].partition is None  # no --partition: Slurm's default one
