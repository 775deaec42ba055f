"""``--policy live``: the deployed stack from a gpushare.toml and a Slurm release (gpushare.simulator.live)."""

import json

from click.testing import CliRunner

from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.simulator.cli import command
from gpushare.simulator.engine import SimConfig, Simulation
from gpushare.simulator.interference import Interference
from gpushare.simulator.live import setup
from gpushare.simulator.policies import GpuState, JobRequest, make_policy
from gpushare.simulator.trace import parse


def test_settings_map_to_the_parts_that_implement_them():
    shipped = setup(parse_config({}), "22.05")
    assert (shipped.least_loaded, shipped.withhold, shipped.thread_policy, shipped.caps, shipped.recovery) == (
        False, "none", "fixed", True, True)
    # shard placement: what gpushare slurm-config advises unless the site says otherwise
    assert not setup(parse_config({}), "24.11").least_loaded and not setup(parse_config({}), "26.05").least_loaded
    always = parse_config({"policy": {"share_when": "always"}})
    assert setup(always, "24.11").least_loaded and setup(always, "26.05").least_loaded
    assert not setup(always, "22.05").least_loaded
    assert setup(parse_config({}), "24.11", "least-loaded").least_loaded
    assert not setup(always, "26.05", "first-fit").least_loaded
    changed = setup(parse_config({
        "agent": {"withhold": "feature", "withhold_node_when": "all", "thread_policy": "gimbal-jct",
                  "framework_caps": "no", "backstop": "none"},
        "oom": {"max_retries": 0}, "policy": {"margin_fraction": 0.2, "exclusive_above_fraction": 0.5}}), "22.05")
    assert (changed.withhold, changed.withhold_when, changed.thread_policy) == ("feature", "all", "gimbal-jct")
    assert (changed.caps, changed.recovery, changed.margin_fraction, changed.exclusive_above) == (False, False, 0.2, 0.5)


def _gpu(index, node, risky=False, free_shards=40, exclusive=False):
    return GpuState(index=index, node=node, total_bytes=40 * GiB, free_bytes=free_shards * GiB, jobs=1,
                    exclusive=exclusive, risky=risky, shards_total=40, shards_free=free_shards)


def test_withholding_closes_a_node_as_the_agent_does():
    job = JobRequest("j", 1, 8 * GiB, 8)
    # node 0: GPU 0 full but risky, GPU 1 free; node 1: GPU 2 free
    gpus = [_gpu(0, 0, risky=True, free_shards=0), _gpu(1, 0), _gpu(2, 1)]
    assert make_policy("live").choose(job, gpus) == [1]  # no withholding: first fit
    assert make_policy("live", withhold="feature").choose(job, gpus) == [2]  # one busy GPU closes node 0
    assert make_policy("live", withhold="feature", withhold_when="all").choose(job, gpus) == [1]
    # a GPU held by a whole-GPU job does not close its node
    held = [_gpu(0, 0, risky=True, free_shards=0, exclusive=True), _gpu(1, 0), _gpu(2, 1)]
    assert make_policy("live", withhold="feature").choose(job, held) == [1]
    assert make_policy("live", least_loaded=True).choose(job, [_gpu(0, 0, free_shards=20), _gpu(1, 0)]) == [1]
    assert make_policy("live", thread_policy="gimbal-makespan").engine == "gimbal"


def test_an_estimate_above_the_whole_gpu_fraction_keeps_a_whole_gpu():
    # 37 GiB + 10 % margin > 90 % of 40 GiB: the job is kept on a GPU of its own, the 4 GiB one shares
    jobs = parse("job_id,submit_s,duration_s,mem_gib,util,ttfk_s\nbig,0,100,37,light,5\nsmall,0,100,4,light,5\n", "t.csv")
    live = setup(parse_config({"policy": {"share_when": "always"}}), "22.05")
    config = SimConfig(gpus_per_node=2, policy="live", estimator="measured", live=live, caps=live.caps,
                       interference="share")
    sim = Simulation(jobs, config, Interference(None, mode="share")).run()
    assert sim.jobs["big"].whole and not sim.jobs["small"].whole
    assert sim.jobs["big"].gpus == [0] and sim.jobs["small"].gpus == [1]
    assert sim.jobs["big"].state == sim.jobs["small"].state == "done"


def test_cli_runs_the_configured_stack(tmp_path):
    conf = tmp_path / "gpushare.toml"
    conf.write_text('version = 1\n[agent]\nwithhold = "feature"\nthread_policy = "gimbal-jct"\n')
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_s,duration_s,mem_gib,util,ttfk_s\na,0,600,4,heavy,5\nb,0,600,4,heavy,5\n")
    result = CliRunner().invoke(command, ["--trace", str(trace), "--policy", "live", "--config", str(conf),
                                          "--slurm", "24.11", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["summary"]
    assert summary["estimator"] == "measured" and summary["caps"] is True and summary["completed"] == 2
    assert "Slurm 24.11 first-fit shards, withhold any, threads gimbal-jct" in summary["live"]  # as advised, queued
    placed = CliRunner().invoke(command, ["--trace", str(trace), "--policy", "live", "--config", str(conf),
                                          "--slurm", "24.11", "--shard-placement", "least-loaded", "--json"])
    assert placed.exit_code == 0, placed.output
    assert "Slurm 24.11 least-loaded shards" in json.loads(placed.stdout)["summary"]["live"]
    old = CliRunner().invoke(command, ["--trace", str(trace), "--policy", "live", "--config", str(conf),
                                       "--slurm", "22.05", "--shard-placement", "least-loaded"])
    assert old.exit_code == 2 and "--shard-placement" in old.output and "24.11 or later, not 22.05" in old.output
    bad = CliRunner().invoke(command, ["--trace", str(trace), "--policy", "live", "--config", str(tmp_path / "no.toml")])
    assert bad.exit_code == 2 and "no.toml" in bad.output


def test_advised_placement_is_what_slurm_config_advises():
    """The simulator's default follows the advice ``gpushare slurm-config`` writes into slurm.conf."""
    from gpushare.simulator.live import advised_placement
    from gpushare.slurm.version import SlurmVersion
    from gpushare.slurm_plugins.slurm_config import render_slurm_conf

    for share_when in ("queued", "always"):
        cfg = parse_config({"policy": {"share_when": share_when}})
        for version in (SlurmVersion(22, 5), SlurmVersion(24, 11), SlurmVersion(26, 5)):
            conf = render_slurm_conf(cfg, "/etc/slurm", version)
            offered = "add LL_SHARED_GRES" in conf and "leave it out" not in conf
            assert (advised_placement(cfg, version) == "least-loaded") == offered, (share_when, version)
