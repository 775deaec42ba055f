"""The real job_submit.lua under every Lua that Slurm's job_submit/lua plugin links, against a real
gpushare-submitd.

Debian's Slurm links Lua 5.1 in all three supported releases; RHEL-family builds link 5.3 (RHEL 8) or 5.4
(RHEL 9). The driver below calls the shim the way the plugin does: a global ``slurm`` table of log functions
and return codes, the script run once, then ``slurm_job_submit(job_desc, part_list, submit_uid)`` with
``job_desc`` behind ``__index``/``__newindex`` (the plugin's job descriptor is no plain table) and numbers
pushed as Lua numbers (floats from 5.3 on). A Lua error inside the shim must be logged loudly and the job
accepted unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpushare.config import parse_config
from gpushare.slurm_plugins.slurm_config import render_lua

LUA_VERSIONS = ("5.1", "5.3", "5.4")

#: What job_submit/lua gives a script: the ``slurm`` table (logs collected in ``logs``), then the script run
#: once (it must return slurm.SUCCESS), and ``descriptor(fields)``: a job descriptor behind metamethods.
SLURM_PRELUDE = r"""
logs = {}
local function logger(level)
  return function(fmt, ...) table.insert(logs, level .. ": " .. string.format(fmt, ...)) end
end
slurm = {SUCCESS = 0, FAILURE = -1, ERROR = -1, log_error = logger("error"), log_info = logger("info"),
  log_verbose = logger("verbose"), log_debug = logger("debug"), log_user = logger("user"),
  user_msg = logger("user")}
local loaded = dofile(arg[1])
assert(loaded == slurm.SUCCESS, "the script must return slurm.SUCCESS")

function descriptor(fields)
  local store = {}
  for k, v in pairs(fields) do store[k] = v end
  return setmetatable({}, {__index = function(_, k) return store[k] end,
                           __newindex = function(_, k, v) store[k] = v end}), store
end
"""

DRIVER = SLURM_PRELUDE + r"""

local function run(label, fields, uid)
  logs = {}
  local job, store = descriptor(fields)
  local rc = slurm_job_submit(job, {}, uid)
  print(label .. "|" .. tostring(rc) .. "|" .. tostring(store.tres_per_node) .. "|" .. tostring(store.admin_comment ~= nil)
        .. "|" .. table.concat(logs, " ; "))
end

run("shared", {tres_per_node = "gres/gpu:1", name = "train", min_nodes = 1.0, partition = "gpu",
               script = "#!/bin/sh\n#GPUSHARE mem=12G\npython train.py\n", work_dir = "/tmp"}, 1000.0)
run("cpu", {tres_per_node = nil, name = "cpu", script = "#!/bin/sh\n"}, 1000.0)
run("broken", {tres_per_node = "gres/gpu:1", name = "odd", script = {}}, 1000.0)
"""


def lua_interpreter(version: str) -> str:
    """``lua<version>`` with lua-socket; `make setup` installs all three (Makefile DEBS)."""
    lua = shutil.which(f"lua{version}")
    if not lua or subprocess.run([lua, "-e", 'require("socket.unix")'], capture_output=True).returncode:
        pytest.skip(f"lua{version} with lua-socket not installed (apt-get install lua{version} lua-socket)")
    return lua


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real gpushare-submitd on a socket of its own, sizing jobs for one A100-80GB node group."""
    base = tmp_path_factory.mktemp("lua-versions")
    socket_path = base / "submitd.sock"
    toml = base / "gpushare.toml"
    toml.write_text(f'version = 1\n[submit]\nsocket = "{socket_path}"\ncache_dir = "{base / "cache"}"\n'
                    f'timeout_ms = 900\n[oom]\nledger_dir = "{base / "ledger"}"\n'
                    '[[nodes]]\nnames = "n1"\ngpu = "a100-80gb"\ncount = 2\npartition = "gpu"\n')
    env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}
    (base / "slurm.conf").write_text("ClusterName=lua\nSlurmUser=root\n")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "gpushare-submitd"), "--config", str(toml)],
                            stdout=subprocess.DEVNULL, stderr=open(base / "submitd.log", "wb"), env=env)
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"gpushare-submitd did not listen: {(base / 'submitd.log').read_text()[-500:]}")
        time.sleep(0.05)
    shim = base / "job_submit.lua"
    shim.write_text(render_lua(parse_config({"submit": {"socket": str(socket_path), "timeout_ms": 900}})))
    driver = base / "driver.lua"
    driver.write_text(DRIVER)
    yield shim, driver
    proc.terminate()
    proc.wait(10)


@pytest.mark.parametrize("version", LUA_VERSIONS)
def test_the_shim_runs_under_each_lua_slurm_links(service, version: str) -> None:  # type: ignore[no-untyped-def]
    shim, driver = service
    lua = lua_interpreter(version)
    out = subprocess.run([lua, str(driver), str(shim)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[0]: line.split("|")[1:] for line in out.stdout.splitlines()}
    rc, tres, commented, logs = rows["shared"]
    assert rc == "0" and tres.startswith("gres/shard:") and commented == "true", rows["shared"]
    assert "share" in logs  # the researcher is told, through log_user
    assert rows["cpu"][:2] == ["0", "nil"]  # no GPU: untouched, no service round trip
    rc, tres, commented, logs = rows["broken"]
    assert (rc, tres, commented) == ("0", "gres/gpu:1", "false")  # a Lua error: the job goes through unchanged
    assert "error: gpushare: hook error, job accepted unchanged" in logs  # ... and it is logged as an error
