"""The module as a site loads it: a site's own job_submit.lua with its own rule, plus the two printed lines,
under every Lua Slurm links, against a real gpushare-submitd. Both the site's rule and ours apply; the
site's rejection still wins; a Lua error in ours leaves the site's rule applied and the job unchanged by us.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpushare.config import parse_config
from gpushare.slurm_plugins.slurm_config import render_lua_module, site_lua_lines
from tests.submit.test_lua_versions import SLURM_PRELUDE, LUA_VERSIONS, lua_interpreter, service  # noqa: F401 (fixture)

SITE = """-- a site's job_submit.lua: its own account rule around ours
{load}
function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.account == nil then job_desc.account = "site-default" end
  if job_desc.name == "forbidden" then slurm.log_user("site: no such name"); return slurm.ERROR end
  {call}
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
"""

DRIVER = SLURM_PRELUDE + r"""
local function run(label, fields)
  logs = {}
  local job, store = descriptor(fields)
  local rc = slurm_job_submit(job, {}, 1000.0)
  print(label .. "|" .. tostring(rc) .. "|" .. tostring(store.tres_per_node) .. "|" .. tostring(store.account)
        .. "|" .. table.concat(logs, " ; "))
end
run("shared", {tres_per_node = "gres/gpu:1", name = "train", min_nodes = 1.0, partition = "gpu",
               script = "#!/bin/sh\n#GPUSHARE mem=12G\npython train.py\n", work_dir = "/tmp"})
run("forbidden", {tres_per_node = "gres/gpu:1", name = "forbidden", script = "#!/bin/sh\n"})
run("broken", {tres_per_node = "gres/gpu:1", name = "odd", script = {}})
"""


@pytest.mark.parametrize("version", LUA_VERSIONS)
def test_a_sites_job_submit_lua_runs_its_rule_and_ours(service, tmp_path: Path, version: str) -> None:  # noqa: F811
    shim, _ = service
    lua = lua_interpreter(version)
    socket_line = next(line for line in shim.read_text().splitlines() if line.startswith("local SOCKET_PATH"))
    socket_path = socket_line.split('"')[1]
    cfg = parse_config({"submit": {"socket": socket_path, "timeout_ms": 900}})
    (tmp_path / "gpushare_submit.lua").write_text(render_lua_module(cfg))
    load, call = site_lua_lines(str(tmp_path))
    (tmp_path / "job_submit.lua").write_text(SITE.format(load=load, call=call))
    (tmp_path / "driver.lua").write_text(DRIVER)
    out = subprocess.run([lua, str(tmp_path / "driver.lua"), str(tmp_path / "job_submit.lua")], capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[0]: line.split("|")[1:] for line in out.stdout.splitlines()}
    rc, tres, account, logs = rows["shared"]
    assert (rc, account) == ("0", "site-default") and tres.startswith("gres/shard:"), rows["shared"]
    assert rows["forbidden"][:3] == ["-1", "gres/gpu:1", "site-default"]  # the site's rejection, before ours
    rc, tres, account, logs = rows["broken"]
    assert (rc, tres, account) == ("0", "gres/gpu:1", "site-default")  # our error: the site's rule still applied
    assert "error: gpushare: hook error, job accepted unchanged" in logs
