"""Beside the site's own hooks, on a real Slurm: a site job_submit.lua with its own rule that loads our module
with the two printed lines, and a site TaskProlog chained with ours by the wrapper slurm-config writes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from devcluster.local_cluster import LocalCluster
from devcluster.processes import scaled
from gpushare.slurm.client import SlurmError
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm_plugins.decision import parse_record
from gpushare.slurm_plugins.slurm_config import install_chains, render_lua_module, site_lua_lines

pytestmark = pytest.mark.slurm

SITE_LUA = """-- the site's own job_submit.lua
{load}
function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.name == "forbidden" then
    slurm.log_user("site policy: no job may be called forbidden")
    return slurm.ERROR
  end
  job_desc.comment = "site-rule-ran"
  {call}
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
"""


def test_site_job_submit_and_task_prolog_run_beside_ours(make_cluster, tmp_path: Path) -> None:
    cluster: LocalCluster = make_cluster()
    etc, bin_dir = cluster.base / "etc", cluster.base / "bin"
    (etc / "gpushare_submit.lua").write_text(render_lua_module(cluster.config()))
    load, call = site_lua_lines(str(etc))
    time.sleep(1.1)  # slurmctld reloads job_submit.lua when its mtime (seconds) is newer than the last load
    (etc / "job_submit.lua").write_text(SITE_LUA.format(load=load, call=call))

    site = bin_dir / "site-taskprolog"
    site.write_text("#!/bin/sh\necho export SITE_TASKPROLOG=ran\n")
    site.chmod(0o755)
    chains = install_chains({"TaskProlog": str(site)}, str(bin_dir), bin_dir)
    conf = cluster.conf.read_text()
    conf = "\n".join(f"TaskProlog={chains['TaskProlog']}" if line.startswith("TaskProlog=") else line
                     for line in conf.splitlines()) + "\n"
    cluster.conf.write_text(conf)
    cluster.client.run("scontrol", "reconfigure")
    time.sleep(2)

    os.chmod(tmp_path, 0o755)
    job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "job-%j.out"), "--gres=gpu:1",
                                      "-J", "train", script="#!/bin/bash\n#GPUSHARE mem=4G\n"
                                      "echo SITE_TASKPROLOG=$SITE_TASKPROLOG\n")
    record = cluster.wait_job(job_id)
    assert record.state == "COMPLETED"
    assert plain_gres(record.tres_per_node).startswith("shard:")  # ours, from inside the site's function
    assert cluster.client.show_job_text(job_id).get("Comment") == "site-rule-ran"  # the site's rule too
    assert "SITE_TASKPROLOG=ran" in (tmp_path / f"job-{job_id}.out").read_text()  # the site's TaskProlog

    with pytest.raises(SlurmError) as refused:  # the site's rejection still stands
        cluster.client.sbatch("-D", str(tmp_path), "--gres=gpu:1", "-J", "forbidden", script="#!/bin/bash\ntrue\n")
    assert "site policy" in str(refused.value)


SITE_ROUTING_LUA = """-- a site's routing rules: a GPU job sent to the CPU partition goes to gpu; the QoS follows the time limit
{load}
function slurm_job_submit(job_desc, part_list, submit_uid)
  local gres = job_desc.tres_per_node or ""
  if job_desc.partition == "cpu" and string.find(gres, "gpu") then
    job_desc.partition = "gpu"
  end
  if job_desc.time_limit ~= nil and job_desc.time_limit < 4294967294 and job_desc.time_limit > 60 then
    job_desc.qos = "long"
  else
    job_desc.qos = "short"
  end
  {call}
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid) return slurm.SUCCESS end
return slurm.SUCCESS
"""


def test_a_sites_partition_and_qos_rules_act_before_ours(make_cluster, tmp_path: Path) -> None:
    """Sites route jobs and pick their QoS in job_submit.lua (HCC's router, ARCHER2's and others' partition and
    QoS rules, benchmarks/site_corpus.json). With our call after them, ours judges the job as they left it:
    a GPU job sent to partition cpu is moved to gpu and shared; [policy] qos = ["long"] shares the job the
    site's rule made long and leaves the one it made short, saying why."""
    cluster: LocalCluster = make_cluster(toml_extra='[policy]\nqos = ["long"]\n')
    etc = cluster.base / "etc"
    (etc / "gpushare_submit.lua").write_text(render_lua_module(cluster.config()))
    load, call = site_lua_lines(str(etc))
    (etc / "job_submit.lua").write_text(SITE_ROUTING_LUA.format(load=load, call=call))
    future = time.time() + 2  # slurmctld reloads job_submit.lua when its mtime is newer than the last load
    os.utime(etc / "job_submit.lua", (future, future))
    cluster.conf.write_text(cluster.conf.read_text() + "PartitionName=cpu Nodes=n1 MaxTime=INFINITE State=UP\n")
    cluster.client.run("scontrol", "reconfigure")
    deadline = time.monotonic() + scaled(30)
    while "cpu" not in cluster.client.run("sinfo", "-h", "-o", "%P"):
        assert time.monotonic() < deadline, "partition cpu did not appear"
        time.sleep(0.2)
    os.chmod(tmp_path, 0o755)

    def submit(*args: str) -> int:
        job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", "/dev/null", "--gres=gpu:1", *args,
                                          script="#!/bin/bash\n#GPUSHARE mem=4G\ntrue\n")
        return job_id

    long_job, short_job = submit("-p", "cpu", "-t", "120"), submit("-t", "30")
    record = cluster.wait_job(long_job)
    assert record.state == "COMPLETED" and record.partition == "gpu"  # the site's routing
    assert plain_gres(record.tres_per_node).startswith("shard:")  # ours, on the QoS the site set
    record = cluster.wait_job(short_job)
    assert record.state == "COMPLETED" and plain_gres(record.tres_per_node) == "gpu:1"
    found = parse_record(record.admin_comment)
    assert found and found["decision"] == "out-of-scope" and found["why"].startswith("QOS short is not in"), found


def test_scope_sees_the_default_partition_and_observe_changes_nothing(make_cluster, tmp_path: Path) -> None:
    """The shim names the default partition from part_list (flag_default) for a job that gives none; a
    reload to observe mode records what enforce would do and leaves the job's request alone."""
    cluster: LocalCluster = make_cluster(toml_extra='[policy]\npartitions = ["elsewhere"]\n')
    os.chmod(tmp_path, 0o755)

    def submit() -> int:
        job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "job-%j.out"), "--gres=gpu:1",
                                          script="#!/bin/bash\n#GPUSHARE mem=4G\ntrue\n")
        return job_id

    record = cluster.wait_job(submit())
    assert record.state == "COMPLETED" and plain_gres(record.tres_per_node) == "gpu:1"
    found = parse_record(record.admin_comment)
    assert found and found["decision"] == "out-of-scope"
    assert found["why"].startswith("partition gpu is not in [policy] partitions")  # the default one, by name

    text = cluster.gpushare_conf.read_text().replace('partitions = ["elsewhere"]', 'mode = "observe"')
    cluster.gpushare_conf.write_text(text)
    log = cluster.base / "log" / "submitd.log"
    reloads = log.read_text().count("configuration reloaded")
    os.kill(cluster.pids["submitd"], signal.SIGHUP)
    deadline = time.monotonic() + scaled(15)
    while log.read_text().count("configuration reloaded") == reloads:
        assert time.monotonic() < deadline, log.read_text()[-1000:]
        time.sleep(0.1)
    record = cluster.wait_job(submit())
    assert record.state == "COMPLETED" and plain_gres(record.tres_per_node) == "gpu:1"
    found = parse_record(record.admin_comment)
    assert found and found["decision"] == "observe" and found["would"] == "shared"
    assert plain_gres(found["new"]).startswith("shard:")


def test_a_glob_prolog_chained_runs_each_site_script_and_ours(make_cluster, tmp_path: Path) -> None:
    """jobstats' layout, Prolog=<dir>/prolog.d/*.sh, chained by the documented command: the job runs, slurmd's
    order holds (z before a), ours runs after, and the node stays up (the pattern itself once ran: exit 127,
    node drained)."""
    import subprocess
    import sys

    cluster: LocalCluster = make_cluster(with_submitd=False, with_hook=False)
    base, log = cluster.base, cluster.base / "prolog-ran.log"
    scripts = base / "prolog.d"
    scripts.mkdir()
    for name in ("10-first.sh", "20-second.sh"):
        (scripts / name).write_text(f"#!/bin/sh\necho {name} $SLURM_JOB_ID >> {log}\n")
        (scripts / name).chmod(0o755)
    ours = base / "ours-bin"
    ours.mkdir()
    (ours / "gpushare-prolog").write_text(f"#!/bin/sh\necho ours $SLURM_JOB_ID >> {log}\nexec {base}/bin/gpushare-prolog\n")
    (ours / "gpushare-prolog").chmod(0o755)
    conf = cluster.conf.read_text().splitlines()
    cluster.conf.write_text("\n".join(f"Prolog={scripts}/*.sh" if line.startswith("Prolog=") else line
                                      for line in conf) + "\n")
    cluster.client.run("scontrol", "reconfigure")
    time.sleep(2)
    os.chmod(tmp_path, 0o755)
    alone, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", "/dev/null", script="#!/bin/sh\ntrue\n")
    assert cluster.wait_job(alone).state == "COMPLETED"  # slurmd's own order, which the chain follows
    assert log.read_text().splitlines() == [f"20-second.sh {alone}", f"10-first.sh {alone}"]
    log.unlink()

    printed = subprocess.run([sys.executable, "-m", "gpushare.cli", "slurm-config", "--config",
                              str(cluster.gpushare_conf), "--hook-dir", str(ours), "--slurm-conf", str(cluster.conf),
                              "--slurm-version", "22.05", "--install-chains", str(base / "chains")],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(line for line in printed.splitlines() if line.startswith("Prolog="))
    assert line == f"Prolog={base}/chains/gpushare-chain-Prolog"
    cluster.conf.write_text("\n".join(line if old.startswith("Prolog=") else old for old in conf) + "\n")
    cluster.client.run("scontrol", "reconfigure")
    time.sleep(2)

    job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "job-%j.out"),
                                      script="#!/bin/sh\necho job ran\n")
    assert cluster.wait_job(job_id).state == "COMPLETED"
    assert log.read_text().splitlines() == [f"20-second.sh {job_id}", f"10-first.sh {job_id}", f"ours {job_id}"]
    state = cluster.client.node_states().get("n1", "")
    assert "drain" not in state and "down" not in state, state


def test_the_doctor_names_what_only_a_restart_applies_before_a_reconfigure_stops_slurmctld(make_cluster) -> None:
    """slurm.conf gains a GRES in GresTypes and a billing weight for it while slurmctld runs: the doctor's restart
    line names both, and says a reconfigure would stop slurmctld, which `scontrol reconfigure` then does
    (measured here, without slurmdbd: the weight names no TRES of the running slurmctld). With the weight
    taken out and slurmctld and slurmd restarted, the line is ok."""
    from gpushare.slurm_plugins.controller_doctor import restart_check

    cluster: LocalCluster = make_cluster(with_submitd=False, with_hook=False)
    cfg = cluster.config()
    check = restart_check(cfg, str(cluster.conf))
    assert check is not None and check.status == "ok", check
    conf = cluster.conf.read_text().replace("GresTypes=gpu,shard", "GresTypes=gpu,shard,nic")
    conf = conf.replace("PartitionName=gpu ", 'PartitionName=gpu TRESBillingWeights="CPU=1,GRES/nic=1" ')
    cluster.conf.write_text(conf)
    check = restart_check(cfg, str(cluster.conf))
    assert check is not None and check.status == "problem", check
    assert "GresTypes: slurm.conf has nic" in check.detail and "names gres/nic" in check.detail, check.detail
    assert "reconfigure` now stops it" in check.detail
    assert "restart slurmctld, then every slurmd" in check.detail

    log = cluster.base / "log" / "slurmctld.log"
    cluster.client.run("scontrol", "reconfigure", check=False)
    deadline = time.monotonic() + scaled(30)
    while "failed to parse tres weights" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
        time.sleep(0.5)
    cluster.conf.write_text(conf.replace(' TRESBillingWeights="CPU=1,GRES/nic=1"', ""))
    cluster.restart_slurm()
    check = restart_check(cfg, str(cluster.conf))
    assert check is not None and check.status == "ok", check


def test_epilogslurmctld_reads_the_checked_file_through_its_wrapper(make_cluster, tmp_path: Path) -> None:
    """slurm.conf outside /etc/slurm: slurmctld passes no SLURM_CONF to EpilogSlurmctld, so our program named
    directly finds no file and does nothing (its ERROR line goes to syslog, not the [oom] log_file); the wrapper
    --install-hooks writes pins the file, and the hook logs where that file says."""
    from gpushare.config import DEFAULT_PATH
    from gpushare.slurm_plugins.controller_doctor import slot_problems
    from gpushare.slurm_plugins.slurm_config import install_hooks

    if DEFAULT_PATH.exists():
        pytest.skip(f"{DEFAULT_PATH} exists here: a bare hook would read it")
    cluster: LocalCluster = make_cluster(with_submitd=False, with_hook=False)
    oom_log, cfg = cluster.base / "log" / "oom.log", cluster.config()
    conf = cluster.conf.read_text().splitlines()

    def run_with(epilog: str) -> str:
        cluster.conf.write_text("\n".join(f"EpilogSlurmctld={epilog}" if line.startswith("EpilogSlurmctld=") else line
                                          for line in conf) + "\n")
        cluster.client.run("scontrol", "reconfigure")
        time.sleep(2)
        job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", "/dev/null", script="#!/bin/sh\ntrue\n")
        assert cluster.wait_job(job_id).state == "COMPLETED"
        return str(job_id)

    os.chmod(tmp_path, 0o755)
    bare = f"{cluster.bin_dir}/gpushare-epilog-slurmctld"
    assert any("finds no gpushare.toml" in p for p in slot_problems(cfg, str(cluster.conf), "EpilogSlurmctld", bare))
    first = run_with(bare)
    wrapper = install_hooks(["EpilogSlurmctld"], cluster.bin_dir, cluster.base / "hooks", str(cluster.gpushare_conf))
    assert slot_problems(cfg, str(cluster.conf), "EpilogSlurmctld", wrapper["EpilogSlurmctld"]) == []
    second = run_with(wrapper["EpilogSlurmctld"])
    deadline = time.monotonic() + scaled(30)  # EpilogSlurmctld runs after the job is reported complete
    while not (oom_log.exists() and f"job {second}:" in oom_log.read_text()):
        assert time.monotonic() < deadline, "the pinned EpilogSlurmctld did not log to [oom] log_file"
        time.sleep(0.5)
    assert f"job {first}:" not in oom_log.read_text()  # the bare one found no file: its line went elsewhere


@pytest.mark.version_sensitive("several Prolog lines in slurm.conf from Slurm 24.05 on; 22.05 takes one (skipped there)")
def test_several_prolog_lines_run_as_slurmd_runs_them(make_cluster, tmp_path: Path) -> None:
    """Slurm 24.05+ takes Prolog on several lines: slurmd runs each line's files (a pattern's z before a), line
    after line. Measured alone, then chained into one line by slurm-config: the same order, ours after."""
    import subprocess
    import sys

    cluster: LocalCluster = make_cluster(with_submitd=False, with_hook=False)
    if not cluster.slurm_at_least("24.05"):
        pytest.skip(f"Slurm {cluster.slurm_version} takes one Prolog line")
    base, log = cluster.base, cluster.base / "prolog-ran.log"
    (base / "prolog.d").mkdir()
    for path in (base / "prolog.d" / "10-first.sh", base / "prolog.d" / "20-second.sh", base / "late.sh"):
        path.write_text(f"#!/bin/sh\necho {path.name} >> {log}\n")
        path.chmod(0o755)
    ours = base / "ours-bin"
    ours.mkdir()
    (ours / "gpushare-prolog").write_text(f"#!/bin/sh\necho ours >> {log}\n")
    (ours / "gpushare-prolog").chmod(0o755)
    conf = [line for line in cluster.conf.read_text().splitlines() if not line.startswith("Prolog=")]
    site = [f"Prolog={base}/prolog.d/*.sh", f"Prolog={base}/late.sh"]

    def job_order(lines: list[str]) -> list[str]:
        cluster.conf.write_text("\n".join([*conf, *lines]) + "\n")
        cluster.client.run("scontrol", "reconfigure")
        time.sleep(2)
        if log.exists():
            log.unlink()
        job_id, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", "/dev/null", script="#!/bin/sh\ntrue\n")
        assert cluster.wait_job(job_id).state == "COMPLETED"
        state = cluster.client.node_states().get("n1", "")
        assert "drain" not in state and "down" not in state, state
        return log.read_text().splitlines()

    os.chmod(tmp_path, 0o755)
    assert job_order(site) == ["20-second.sh", "10-first.sh", "late.sh"]
    cluster.conf.write_text("\n".join([*conf, *site]) + "\n")
    printed = subprocess.run([sys.executable, "-m", "gpushare.cli", "slurm-config", "--config",
                              str(cluster.gpushare_conf), "--hook-dir", str(ours), "--slurm-conf", str(cluster.conf),
                              "--slurm-version", cluster.slurm_version, "--install-chains", str(base / "chains")],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    chained = [line for line in printed.splitlines() if line.startswith("Prolog=")]
    assert chained == [f"Prolog={base}/chains/gpushare-chain-Prolog"] and "2 lines: replace every Prolog=" in printed
    assert job_order(chained) == ["20-second.sh", "10-first.sh", "late.sh", "ours"]
