"""The agent's logic with a fake clock and the simulated backend: no Slurm, no sleeping."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpushare.config import parse_config
from gpushare.gres.sim_backend import SimBackend
from gpushare.agent.daemon import Agent
from gpushare.node.caps import Caps, allocator_fraction, decide_caps, need_mib, task_env
from gpushare.node.framework_caps import fraction_text
from gpushare.cuda_context import context_bytes_for, sm_arch_of
from gpushare.gpus import BUILTIN_GPUS as CATALOGUE, GiB, MiB
from gpushare.node.jobs import clean_facts, final_record
from gpushare.policy.withhold import node_open
from gpushare.agent.adopt import MAX_REMEMBERED, Adopter
from gpushare.slurm.jobs import job_from_json

SCENARIO = {"version": 1, "name": "unit", "processes": [],
            "gpus": [{"model": "a100-40gb", "idle_power_w": 50, "max_power_w": 350},
                     {"model": "a100-40gb", "idle_power_w": 50, "max_power_w": 350}]}


class FakeFeature:
    """Stands in for NodeFeature: records what the agent asked for."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def apply(self, want_open: bool) -> bool:
        self.calls.append(want_open)
        return True


def honest_uids(holder: list, pids: dict | None, default: int = 1000):
    """The uid of each fake pid: its claimed job's owner (an honest process), else ``default``."""
    def uid_of(pid):
        acc = holder[0].sampler.jobs.get((pids or {}).get(pid)) if holder else None
        return acc.uid if acc is not None else None
    return uid_of


def make_agent(tmp_path, clock, pids=None, backend=None, uids=None, **agent):
    backend = backend or SimBackend.from_scenario(SCENARIO, clock=clock)
    cfg = parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                  "window_samples": 5, "flush_every_s": 3.0, **agent}}).agent
    registry = CollectorRegistry()
    feature = FakeFeature()
    holder: list = []
    agent_obj = Agent(cfg, backend, clock=clock, feature=feature, registry=registry,
                      pid_job=lambda pid: (pids or {}).get(pid),
                      pid_uid=uids.get if uids is not None else honest_uids(holder, pids))
    holder.append(agent_obj)
    return agent_obj, backend, registry, feature


def job(job_id, uid=1000, gpus=(0,), shared=True, est=4.0, margin=1.0, shards=5):
    return {"job": job_id, "uid": uid, "user": f"u{uid}", "gpus": list(gpus), "shared": shared,
            "est_gib": est, "margin_gib": margin, "shards": shards}


def run(agent, clock, seconds):
    for _ in range(int(seconds)):
        agent.tick()
        clock.advance(1.0)


def test_ttfk_is_the_first_kernel_not_the_context(tmp_path, clock):
    agent, sim, registry, _ = make_agent(tmp_path, clock, pids={501: "7"}, collocation="fraction")
    agent.register(job("7"))
    run(agent, clock, 2)
    sim.start_process(0, 501, 1 * GiB)  # CUDA context created: no kernel yet (data loading, compilation)
    run(agent, clock, 3)
    assert agent.sampler.jobs["7"].kernel_at is None and agent.snapshot()["gpus"][0]["warming"]
    sim.update_process(501, smact=0.5)
    run(agent, clock, 1)
    acc = agent.sampler.jobs["7"]
    assert acc.kernel_at - acc.start == pytest.approx(5.0, abs=1.0) and acc.ttfk_source == "kernel"
    assert registry.get_sample_value("gpushare_job_ttfk_seconds", {"jobid": "7", "source": "kernel"}) is not None


def test_ttfk_falls_back_to_first_process_where_the_gpu_cannot_sample_per_process(tmp_path, clock):
    scenario = {**SCENARIO, "gpus": [{**g, "unsupported": ["process_utilization"]} for g in SCENARIO["gpus"]]}
    backend = SimBackend.from_scenario(scenario, clock=clock)
    agent, sim, registry, _ = make_agent(tmp_path, clock, pids={501: "7"}, backend=backend, collocation="fraction")
    agent.register(job("7"))
    run(agent, clock, 2)
    sim.start_process(0, 501, 1 * GiB)  # context only, yet the only evidence this GPU gives
    run(agent, clock, 1)
    acc = agent.sampler.jobs["7"]
    assert acc.kernel_at is not None and acc.ttfk_source == "first-process"
    assert registry.get_sample_value("gpushare_job_ttfk_seconds", {"jobid": "7", "source": "first-process"}) == 2.0
    agent.close("7")
    assert agent.store.get("7")["ttfk_source"] == "first-process"


def test_ttfk_is_first_process_of_the_job_and_warming_lasts_one_window(tmp_path, clock):
    agent, sim, registry, feature = make_agent(tmp_path, clock, pids={501: "7"})
    agent.register(job("7"))
    assert feature.calls[-1] is False  # a GPU that just received a job is warming: node withheld
    run(agent, clock, 4)
    assert agent.snapshot()["gpus"][0]["warming"] and agent.sampler.jobs["7"].kernel_at is None
    sim.start_process(0, 501, 2 * GiB, smact=0.3)
    run(agent, clock, 1)
    # an MPS job: its kernels are reported under the MPS server's pid, so its first process stands in
    assert registry.get_sample_value("gpushare_job_ttfk_seconds", {"jobid": "7", "source": "first-process"}) == 4.0
    run(agent, clock, 3)
    assert agent.snapshot()["gpus"][0]["warming"]  # 4 s after the kernel: kernel + window (5 s) not over
    run(agent, clock, 2)
    assert not agent.snapshot()["gpus"][0]["warming"] and feature.calls[-1] is True


def test_metrics_follow_prometheus_conventions_and_job_series_end_with_the_job(tmp_path, clock):
    agent, sim, registry, _ = make_agent(tmp_path, clock, pids={501: "7"}, collocation="fraction")
    agent.register(job("7"))
    sim.start_process(0, 501, 2 * GiB, smact=0.5)
    run(agent, clock, 4)
    value = registry.get_sample_value
    mode = agent.snapshot()["jobs"][0]["mode"]
    assert value("gpushare_job_info", {"jobid": "7", "user": "u1000", "mode": mode}) == 1.0
    assert value("gpushare_job_memory_used_bytes", {"jobid": "7", "gpu": "0"}) == 2 * GiB
    assert value("gpushare_job_memory_peak_bytes", {"jobid": "7", "gpu": "0"}) == 2 * GiB
    assert value("gpushare_job_memory_limit_bytes", {"jobid": "7"}) == 5 * GiB  # 4 GiB estimate + 1 GiB margin
    assert value("gpushare_job_energy_joules_total", {"jobid": "7", "gpu": "0"}) > 0
    assert value("gpushare_gpu_energy_joules_total", {"gpu": "0"}) >= value("gpushare_job_energy_joules_total",
                                                                           {"jobid": "7", "gpu": "0"})
    assert value("gpushare_gpu_power_watts", {"gpu": "0"}) > 50
    assert value("gpushare_guard_actions_total", {"action": "backstop_stops"}) == 0
    assert value("gpushare_node_open") == 0.0  # the job is still warming its GPU: withheld
    families = list(registry.collect())
    for family in families:  # base units in names, counters as counters ending in _total, info as _info
        assert family.name.startswith("gpushare_")
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name
            else:
                assert not sample.name.endswith("_total"), sample.name
            if family.type == "info":
                assert sample.name.endswith("_info") and sample.value == 1.0
    assert {f.name for f in families if f.type == "counter"} >= {"gpushare_gpu_energy_joules",
                                                                  "gpushare_job_energy_joules",
                                                                  "gpushare_guard_actions"}
    agent.close("7")
    # a job's series (and with them its user label) exist only while it runs on the node
    assert not [s for f in registry.collect() for s in f.samples if "jobid" in s.labels or "user" in s.labels]


def test_job_that_ends_before_its_first_kernel_releases_the_gpu(tmp_path, clock):
    agent, _, _, feature = make_agent(tmp_path, clock)
    agent.register(job("8"))
    run(agent, clock, 3)
    agent.close("8")
    assert not agent.snapshot()["gpus"][0]["warming"] and feature.calls[-1] is True


def test_risky_gpu_by_carma_thresholds_and_metrics(tmp_path, clock):
    agent, sim, registry, feature = make_agent(tmp_path, clock)
    sim.start_process(1, 900, 8 * GiB, smact=0.9, smocc=0.5, drama=0.1)
    run(agent, clock, 6)
    gpus = agent.snapshot()["gpus"]
    assert gpus[1]["risky"] and not gpus[0]["risky"] and feature.calls[-1] is False
    assert registry.get_sample_value("gpushare_gpu_risky", {"gpu": "1"}) == 1.0
    assert registry.get_sample_value("gpushare_gpu_risk_score", {"gpu": "1", "metric": "smact"}) == pytest.approx(0.9)
    assert registry.get_sample_value("gpushare_gpu_memory_used_bytes", {"gpu": "1"}) == 8 * GiB
    sim.update_process(900, smact=0.5)
    run(agent, clock, 6)
    assert not agent.snapshot()["gpus"][1]["risky"] and feature.calls[-1] is True


def test_whole_gpu_job_does_not_close_the_node(tmp_path, clock):
    agent, sim, _, feature = make_agent(tmp_path, clock, pids={31: "9"})
    agent.register(job("9", gpus=(1,), shared=False, est=None, margin=None, shards=None))
    sim.start_process(1, 31, 30 * GiB, smact=0.95, smocc=0.7)
    run(agent, clock, 8)
    assert feature.calls and all(feature.calls)  # busy and warming, but nobody else can get that GPU
    assert agent.sampler.jobs["9"].kernel_at is not None  # its TTFK is still recorded


def test_no_mps_pipe_when_the_daemon_cannot_start(tmp_path, clock):
    from gpushare.gres import GpuError, NvmlCode

    agent, sim, _, _ = make_agent(tmp_path, clock)

    class BrokenMps:
        def running(self, device):
            return False

        def start(self, device):
            raise GpuError(NvmlCode.NOT_SUPPORTED, "nvidia-cuda-mps-control not found")

    agent.mps = BrokenMps()
    entry = agent.register(job("12"))
    assert entry["caps"]["mode"] == "fraction" and "CUDA_MPS_PIPE_DIRECTORY" not in entry["env"]
    assert "CUDA_VISIBLE_DEVICES" not in entry["env"]


def test_job_without_any_gpu_process_stops_pinning_its_gpu(tmp_path, clock):
    from gpushare.agent.daemon import MAX_WARMING_S

    agent, _, _, feature = make_agent(tmp_path, clock)
    agent.register(job("13"))
    run(agent, clock, 5)
    assert feature.calls[-1] is False
    clock.advance(MAX_WARMING_S)
    run(agent, clock, 2)
    assert feature.calls[-1] is True and "13" in agent.sampler.jobs  # still recorded, no longer withheld


def test_closed_entries_are_not_reloaded_or_counted_as_tenants(tmp_path, clock):
    agent, _, _, _ = make_agent(tmp_path, clock)
    agent.register(job("14", uid=2000))
    agent.close("14")  # Epilog crashed after this: the entry stays, marked closed
    again, _, _, _ = make_agent(tmp_path, clock)
    assert again.load() == 0
    assert again.register(job("15", uid=1000))["caps"]["mode"] == "mps"


def test_withhold_any_vs_all():
    assert node_open([False, False], "any") and not node_open([True, False], "any")
    assert node_open([True, False], "all") and not node_open([True, True], "all")
    assert node_open([], "any")


def test_energy_split_between_collocated_jobs_and_whole_device_delta(tmp_path, clock):
    agent, sim, _, _ = make_agent(tmp_path, clock, pids={11: "1", 12: "2"})
    agent.register(job("1"))
    agent.register(job("2"))
    sim.start_process(0, 11, 3 * GiB, smact=0.5)
    sim.start_process(0, 12, 5 * GiB, smact=0.5)
    run(agent, clock, 11)  # 10 sampled intervals with both active at 350 W (ΣSMACT = 1)
    entry = agent.close("1")
    record = final_record(entry, sim, end=clock())
    gpu = record["gpus"]["0"]
    assert gpu["share_j"] == pytest.approx(350 * 10 / 2)  # half of each interval's energy
    assert gpu["energy_j"] == pytest.approx(350 * 11)  # the counter from the Prolog's read to now
    assert gpu["peak_bytes"] == 3 * GiB and record["ttfk_s"] == 0.0


def test_caps_policy_same_user_mps_else_fraction():
    kw = dict(shared=True, gpus=1, need=5120, gpu_total_bytes=40 * GiB)
    assert decide_caps("mps-same-user", uid=1, tenants=[], **kw).mode == "mps"
    assert decide_caps("mps-same-user", uid=1, tenants=[(1, "mps")], **kw).mode == "mps"
    other = decide_caps("mps-same-user", uid=1, tenants=[(2, "mps")], **kw)
    assert other.mode == "fraction" and other.fraction == 0.125 and "another user" in other.reason
    assert decide_caps("mps", uid=1, tenants=[(2, "mps")], **kw).mode == "mps"
    assert decide_caps("fraction", uid=1, tenants=[], **kw).mode == "fraction"
    assert decide_caps("mps", uid=1, tenants=[], **{**kw, "shared": False}).mode == "none"
    assert decide_caps("mps", uid=1, tenants=[], **{**kw, "gpus": 2}).mode == "fraction"
    assert need_mib(4.0, 1.0, 5) == 5120 and need_mib(None, None, 7) == 7168 and need_mib(None, None, None) is None
    # a grant beyond the rounded estimate (OOM recovery's whole GPU) is the cap; rounding up to a shard is not
    assert need_mib(4.0, 1.0, 40) == 40 * 1024 and need_mib(4.5, 1.0, 6) == 5632


def test_caps_from_dict_reverses_as_dict_and_keeps_defaults_for_missing_fields():
    caps = decide_caps("fraction", shared=True, gpus=1, uid=1, need=5120, gpu_total_bytes=40 * GiB, tenants=[])
    assert Caps.from_dict(caps.as_dict()) == caps
    # a record with only a mode (an older or hand-written entry) keeps a string reason, as the type says
    assert Caps.from_dict({"mode": "none"}) == Caps(mode="none")


def test_task_env_for_mps_and_fraction():
    mps = decide_caps("mps", shared=True, gpus=1, uid=1, need=5120, gpu_total_bytes=40 * GiB, tenants=[],
                      thread_percentage=50)
    env = task_env(mps, "/run/gpushare/mps-1/pipe")
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5120M" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50" and env["CUDA_MPS_PIPE_DIRECTORY"].endswith("pipe")
    frac = task_env(decide_caps("fraction", shared=True, gpus=1, uid=1, need=5120, gpu_total_bytes=40 * GiB,
                                tenants=[]), None)
    assert frac == {"GPUSHARE_CAPS_MODE": "fraction", "GPUSHARE_MEMORY_FRACTION": "0.125",
                    "GPUSHARE_MEM_LIMIT_MIB": "5120", "GPUSHARE_FRAMEWORK_CAPS": "1"}


def test_mps_daemon_started_for_mps_jobs_and_stopped_when_idle(tmp_path, clock):
    agent, sim, _, _ = make_agent(tmp_path, clock)
    agent.register(job("3", gpus=(1,)))
    assert sim.mps(str(tmp_path / "run")).running(1)
    agent.close("3")
    assert not sim.mps(str(tmp_path / "run")).running(1)


def test_restart_restores_jobs_and_accumulators(tmp_path, clock):
    sim = SimBackend.from_scenario(SCENARIO, clock=clock)
    agent, _, _, _ = make_agent(tmp_path, clock, pids={21: "4"}, backend=sim)
    agent.register(job("4"))
    sim.start_process(0, 21, 2 * GiB, smact=0.4)
    run(agent, clock, 7)  # flushes every 3 s
    before = agent.sampler.jobs["4"].fields()
    again, _, _, _ = make_agent(tmp_path, clock, pids={21: "4"}, backend=sim)  # a new process, same store
    assert again.load() == 1
    restored = again.sampler.jobs["4"].fields()
    assert restored["kernel_at"] == before["kernel_at"] and restored["peak_bytes"] == {"0": 2 * GiB}
    assert restored["share_mj"]["0"] >= 0.5 * before["share_mj"]["0"]  # at most one flush period lost


def test_register_is_idempotent_and_validates(tmp_path, clock):
    agent, _, _, _ = make_agent(tmp_path, clock)
    first = agent.register(job("5"))
    assert agent.register(job("5"))["start"] == first["start"]
    for bad in ({**job("5"), "job": "5; rm -rf /"}, {**job("5"), "gpus": []}, {**job("5"), "gpus": ["0"]},
                {**job("5"), "uid": "0"}):
        with pytest.raises(ValueError):
            clean_facts(bad)
    assert clean_facts({**job("5"), "user": "../../etc"})["user"] == ""
    assert agent.handle({"op": "register", "job": {"job": "x"}})["ok"] is False
    assert agent.handle({"op": "nope"})["ok"] is False


def test_lost_gpu_does_not_stop_sampling_the_others(tmp_path, clock):
    agent, sim, _, _ = make_agent(tmp_path, clock)
    sim.set_knobs(1, lost_at_s=2.0)
    run(agent, clock, 5)
    gpus = agent.snapshot()["gpus"]
    assert gpus[0]["samples"] == 5 and gpus[0]["error"] is None
    assert "GPU_IS_LOST" in gpus[1]["error"]


def test_nvml_only_utilisation_is_never_risky(tmp_path, clock):
    scenario = {**SCENARIO, "gpus": [{"model": "a100-40gb", "utilization_source": "nvml"}]}
    sim = SimBackend.from_scenario(scenario, clock=clock)
    agent, _, registry, _ = make_agent(tmp_path, clock, backend=sim)
    sim.start_process(0, 1, GiB, smact=1.0, smocc=1.0, drama=1.0)
    run(agent, clock, 6)
    assert not agent.snapshot()["gpus"][0]["risky"]
    assert math.isnan(registry.get_sample_value("gpushare_gpu_risk_score", {"gpu": "0", "metric": "smact"}))


def test_a_slow_mps_start_does_not_hold_the_agent(tmp_path, clock):
    """An MPS start may take many seconds; the sampling loop and other Prologs must not wait for it."""
    import threading
    import time

    agent, sim, _, _ = make_agent(tmp_path, clock)
    started = threading.Event()

    class SlowMps:
        def running(self, device):
            return False

        def start(self, device):
            started.set()
            time.sleep(1.5)
            return ("/pipe", "/log")

    agent.mps = SlowMps()
    worker = threading.Thread(target=agent.register, args=(job("21"),))
    worker.start()
    assert started.wait(2)
    t0 = time.perf_counter()
    agent.snapshot()
    agent.register(job("22", uid=2000, gpus=(1,), shared=False))
    assert time.perf_counter() - t0 < 0.5
    worker.join(5)
    assert agent.store.get("21")["caps"]["mode"] == "mps"


# -- adoption of a job whose Prolog did not run (the real path: tests/agent/test_safe_sharing_slurm.py) --


def slurm_job(job_id: str = "9", state: str = "RUNNING", uid: int = 1000, nodes: str = "n1",
              tres: str = "gres:shard:40", comment: str = "") -> Any:
    return job_from_json({"job_id": int(job_id), "job_state": state, "user_id": uid, "user_name": f"u{uid}",
                          "nodes": nodes, "batch_host": nodes, "tres_per_node": tres, "restart_cnt": 1,
                          "admin_comment": comment})


class FakeSlurm:
    """Stands in for SlurmClient.job(): Slurm's record of each job, or an error."""

    def __init__(self, jobs: dict[str, Any], error: Exception | None = None) -> None:
        self.jobs, self.error, self.asked = jobs, error, []

    def job(self, job_id: str) -> Any:
        self.asked.append(job_id)
        if self.error is not None:
            raise self.error
        return self.jobs.get(job_id)


def test_a_stray_job_is_looked_up_when_new_processes_appear_or_once_per_retry_period_and_the_table_stays_bounded() -> None:
    adopter = Adopter(retry_s=30.0)
    strays = {"9": {0: [501]}}
    assert [job for job, _ in adopter.due(strays, 100.0)] == ["9"]
    assert adopter.due(strays, 120.0) == []
    assert [job for job, _ in adopter.due(strays, 130.0)] == ["9"]
    assert [job for job, _ in adopter.due({"9": {0: [501, 502]}}, 131.0)] == ["9"]  # a new process: at once
    assert adopter.due({"9": {0: [502]}}, 132.0) == []
    many = {str(n): {0: [n]} for n in range(MAX_REMEMBERED + 50)}
    assert len(adopter.due(many, 200.0)) == MAX_REMEMBERED + 50
    assert len(adopter._tried) == MAX_REMEMBERED


def test_slurm_must_confirm_a_running_job_of_this_node_and_of_the_processes_owner() -> None:
    adopter = Adopter(uid_of={501: 1000, 502: 1001}.get)
    where = {0: [501]}
    assert adopter.refusal(slurm_job(), "n1", where) is None
    assert "does not know" in adopter.refusal(None, "n1", where)
    assert "PENDING" in adopter.refusal(slurm_job(state="PENDING"), "n1", where)
    assert "not on n1" in adopter.refusal(slurm_job(nodes="n[2-3]"), "n1", where)
    assert adopter.refusal(slurm_job(nodes="n[1-3]"), "n1", where) is None
    # a process that set SLURM_JOB_ID itself (no cgroups on the node) cannot adopt another user's job
    assert "uid" in adopter.refusal(slurm_job(uid=1000), "n1", {0: [502]})
    assert "uid" in adopter.refusal(slurm_job(uid=1000), "n1", {0: [501], 1: [502]})


@pytest.mark.hostile
def test_a_cpu_only_jobs_gpu_process_is_not_adopted_uncapped() -> None:
    """Issue 22: a job granted no GPU that opens one anyway (no device cgroups) was adopted with no cap. It is
    refused; its process then belongs to no job on the GPU (tests/agent/test_guard.py stops such a one)."""
    adopter = Adopter(uid_of={501: 1000}.get)
    assert "granted no GPU" in adopter.refusal(slurm_job(tres=""), "n1", {0: [501]})
    assert adopter.refusal(slurm_job(tres="gres:gpu:1"), "n1", {0: [501]}) is None
    assert adopter.refusal(slurm_job(tres="gres/gpu:a100:2"), "n1", {0: [501]}) is None


def test_the_agent_adopts_a_job_running_without_its_prolog_with_its_grant_as_cap(tmp_path, clock) -> None:
    comment = 'gpushare:{"v":1,"decision":"shared","est_gib":4.0,"margin_gib":1.0,"new":"gres:shard:5"}'
    fake = FakeSlurm({"9": slurm_job(comment=comment)})
    agent, sim, _, _ = make_agent(tmp_path, clock, pids={501: "9"}, uids={501: 1000}, node_name="n1", collocation="mps")
    agent.slurm = fake
    sim.start_process(1, 501, 3 * GiB)
    run(agent, clock, 2)
    assert agent.followup_pending() >= 1 and fake.asked == ["9"]
    entry = agent.store.get("9")
    assert entry["registered_by"] == "agent-adopted" and entry["gpus"] == [1] and entry["uid"] == 1000
    assert entry["caps"]["mode"] != "mps" and entry["env"].get("CUDA_MPS_PIPE_DIRECTORY") is None
    assert entry["caps"]["mem_limit_mib"] == 40 * 1024  # the whole-GPU grant of the rerun, not the old estimate
    run(agent, clock, 3)
    assert agent.sampler.jobs["9"].peak_bytes["1"] == 3 * GiB and agent.counters["adopted"] == 1
    assert final_record(agent.close("9"), sim)["ttfk_s"] is None  # its start was never seen
    assert "9" not in agent.sampler.strays


def test_the_agent_leaves_a_job_slurm_does_not_confirm_and_asks_again_later(tmp_path, clock) -> None:
    fake = FakeSlurm({"9": slurm_job(state="COMPLETING")})
    agent, sim, _, _ = make_agent(tmp_path, clock, pids={501: "9"}, uids={501: 1000}, node_name="n1")
    agent.slurm = fake
    sim.start_process(0, 501, 1 * GiB)
    run(agent, clock, 5)
    agent.followup_pending()
    assert agent.store.get("9") is None and fake.asked == ["9"]
    fake.error = OSError("slurmctld not responding")
    run(agent, clock, 30)
    agent.followup_pending()
    assert agent.store.get("9") is None and fake.asked == ["9", "9"]


def test_registered_jobs_and_processes_of_no_job_are_never_strays(tmp_path, clock) -> None:
    agent, sim, _, _ = make_agent(tmp_path, clock, pids={501: "7"}, collocation="fraction")
    agent.slurm = FakeSlurm({})
    agent.register({"job": "7", "uid": 1000, "user": "u1000", "gpus": [0], "shared": True, "est_gib": 4.0,
                    "margin_gib": 1.0, "shards": 5})
    sim.start_process(0, 501, 1 * GiB)
    sim.start_process(1, 777, 1 * GiB)  # a process outside any Slurm job
    run(agent, clock, 2)
    assert agent.sampler.strays == {} and agent.followup_pending() == 0


def test_gimbal_picks_the_thread_share_of_a_job_starting_beside_an_mps_job(tmp_path, clock) -> None:
    agent, _, _, _ = make_agent(tmp_path, clock, collocation="mps", thread_policy="gimbal-makespan")
    first = agent.register({**job("1", uid=1000), "time_limit_s": 6000.0})
    assert first["caps"]["thread_percentage"] == 100  # alone: the whole GPU
    clock.advance(60)
    second = agent.register({**job("2", uid=1000), "time_limit_s": 600.0})
    # makespan: the shorter job is squeezed so the longer one finishes sooner (docs/agent.md)
    share = second["caps"]["thread_percentage"]
    assert share < 100 and share % 10 == 0 and second["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(share)
    assert agent.store.get("1")["caps"]["thread_percentage"] == 100  # a running job keeps its share
    fixed, _, _, _ = make_agent(tmp_path / "fixed", clock, collocation="mps", mps_thread_percentage=70)
    fixed.register(job("1"))
    assert fixed.register(job("2"))["caps"]["thread_percentage"] == 70


def test_the_time_limit_reaches_the_registration_from_slurms_record() -> None:
    from gpushare.node.jobs import registration_facts

    for raw in ({"time_limit": 90}, {"time_limit": {"set": True, "infinite": False, "number": 90}}):
        job_ = job_from_json({"job_id": 3, "job_state": "RUNNING", **raw})
        assert registration_facts("3", 1000, "u", [0], job_)["time_limit_s"] == 5400.0
    unlimited = job_from_json({"job_id": 3, "job_state": "RUNNING",
                               "time_limit": {"set": True, "infinite": True, "number": 0}})
    assert registration_facts("3", 1000, "u", [0], unlimited)["time_limit_s"] is None
    assert clean_facts({**job("3"), "time_limit_s": "9e99"})["time_limit_s"] is None


@pytest.mark.parametrize("model", sorted(CATALOGUE))
def test_a_job_at_its_framework_cap_stays_inside_its_backstop_cap(model):
    """PyTorch's fraction bounds the allocator only; the backstop sees the whole process (allocator + context +
    kernels, gpushare/cuda_context.py). A job that fills its framework cap must hold at most its need, so the
    backstop (need + tolerance) never stops a job for using exactly what its framework allowed. Measured on an
    H200 before this rule: a 4 GiB need got 4.0 GiB of allocator and held 4.7 GiB."""
    gpu = CATALOGUE[model]
    outside = context_bytes_for(sm_arch_of(gpu.name, gpu.marketing_name))
    for need in (1024, 2048, 5120, 12 * 1024, 30 * 1024):
        if need * MiB >= gpu.total_bytes:
            continue
        caps = decide_caps("fraction", shared=True, gpus=1, uid=1, need=need, gpu_total_bytes=gpu.total_bytes,
                           tenants=[], outside_allocator_bytes=outside)
        assert caps.fraction is not None and caps.mem_limit_mib == need
        held = caps.fraction * gpu.total_bytes + outside
        assert need * MiB - gpu.total_bytes * 1e-6 <= held <= need * MiB
        assert float(fraction_text(caps.fraction)) == caps.fraction  # exported exactly, not rounded up


def test_fraction_text_keeps_six_decimals_and_no_trailing_zeros():
    assert fraction_text(0.125) == "0.125" and fraction_text(0.1) == "0.1" and fraction_text(1.0) == "1.0"
    assert fraction_text(0.0284897) == "0.02849"  # .6f rounds to nearest; callers pass floored values
    assert allocator_fraction(0.0284897 * 2**40, 2**40) == 0.028489
    assert allocator_fraction(-5, 2**40) == allocator_fraction(64 * MiB, 2**40) > 0  # a need below the context


class RecordingSlurm(FakeSlurm):
    """FakeSlurm that also takes AdminComment updates, as scontrol would while the job runs."""

    def __init__(self, jobs: dict[str, Any]) -> None:
        super().__init__(jobs)
        self.updates: list[tuple[str, dict[str, str]]] = []

    def update_job(self, job_id: str, **fields: str) -> None:
        self.updates.append((job_id, fields))
        old = self.jobs[job_id]
        self.jobs[job_id] = slurm_job(job_id, comment=fields["admincomment"], tres=old.tres_per_node or "")


def test_a_peak_that_is_oom_evidence_reaches_the_job_record_while_it_runs(tmp_path, clock) -> None:
    """OOM recovery on the controller reads run.peak_gib from the job's record: it may decide before the
    node's Epilog writes anything and cannot read the node's records on a real cluster (epilog/corroborate.py).
    So the agent writes the peak once it reaches [oom] corroborate_fraction of the share, and on growth."""
    from gpushare.slurm import record as record_format

    decision = 'gpushare:{"v":1,"decision":"shared","est_gib":4.0,"margin_gib":1.0,"new":"gres:shard:5"}'
    slurm = RecordingSlurm({"7": slurm_job("7", comment=decision, tres="gres:shard:5")})
    agent, sim, _, _ = make_agent(tmp_path, clock, pids={501: "7"}, collocation="fraction")
    agent.slurm = slurm
    agent.register(job("7"))  # shard:5: evidence from 0.8 x 5 GiB = 4 GiB
    sim.start_process(0, 501, 3 * GiB)
    run(agent, clock, 3)
    agent.annotate_pending()
    assert all("peak_gib" not in (record_format.parse(f["admincomment"]) or {}).get("run", {})
               for _, f in slurm.updates)  # 3 GiB is no evidence yet
    sim.update_process(501, memory_mib=4300)
    run(agent, clock, 1)
    agent.annotate_pending()
    run_part = record_format.parse(slurm.jobs["7"].admin_comment)["run"]
    assert run_part["peak_gib"] == pytest.approx(4300 / 1024, abs=0.01)
    assert record_format.parse(slurm.jobs["7"].admin_comment)["decision"] == "shared"  # the decision is kept
    writes = len(slurm.updates)
    sim.update_process(501, memory_mib=4400)  # less than 5 % of the share more: nothing new to say
    run(agent, clock, 2)
    agent.annotate_pending()
    assert len(slurm.updates) == writes
    sim.update_process(501, memory_mib=4700)
    run(agent, clock, 1)
    agent.annotate_pending()
    assert record_format.parse(slurm.jobs["7"].admin_comment)["run"]["peak_gib"] == pytest.approx(4700 / 1024, abs=0.01)
