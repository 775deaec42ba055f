"""Share only while a job would wait: the pure gate (gpushare.policy.share_gate), the queue view's parsing and
freshness (slurm_plugins/queue_view.py) and the submit decision that uses both."""

from __future__ import annotations

import pytest

from gpushare.config import parse_config
from gpushare.policy.share_gate import Pressure, compute_shards, gate, share_shards
from gpushare.estimate.directives import parse_directives
from gpushare.gpus import GiB
from gpushare.slurm_plugins.decision import Estimate, Queue, SubmitRequest, decide, smallest_cluster_gpu_gib
from gpushare.slurm_plugins.queue_view import QueueView, idle_gpus, parse_sinfo, parse_squeue

# as Slurm 22.05 prints them (sinfo -N -O NodeList:|,Partition:|,StateLong:|,Gres:|,GresUsed:)
SINFO = """n1|gpu*|mixed|gpu:a100-40gb:2,shard:a100-40gb:80|gpu:a100-40gb:1(IDX:1),shard:a100-40gb:1(IDX:0)
n2|gpu*|mixed|gpu:a100-40gb:2,shard:a100-40gb:80|gpu:a100-40gb:0(IDX:N/A),shard:a100-40gb:1(IDX:0)
n3|gpu*|idle|gpu:a100-40gb:2,shard:a100-40gb:80|gpu:a100-40gb:0(IDX:N/A),shard:a100-40gb:0(IDX:N/A)
n4|gpu*|drained|gpu:a100-40gb:2,shard:a100-40gb:80|gpu:a100-40gb:0(IDX:N/A),shard:a100-40gb:0(IDX:N/A)
n3|big|idle|gpu:a100-40gb:2,shard:a100-40gb:80|gpu:a100-40gb:0(IDX:N/A),shard:a100-40gb:0(IDX:N/A)
"""
SQUEUE = """gpu|gres:gpu:2|N/A|1|Resources
gpu|gres/gpu:1|N/A|2|Priority
gpu,big|gres:shard:10|N/A|1|Priority
gpu|gres:gpu:1|N/A|1|JobHeldUser
gpu|N/A|gres/gpu:3|1|Resources
cpu|N/A|N/A|1|Priority
"""

@pytest.mark.parametrize("pressure, claimed, share", [
    (Pressure(4, 2), 0, False), (Pressure(4, 4), 0, True), (Pressure(4, 3), 1, True), (Pressure(0, 0), 0, True),
    (None, 0, True),
])
def test_gate_keeps_a_whole_gpu_only_beyond_the_pending_demand(pressure, claimed, share):
    verdict = gate("queued", pressure, claimed)
    assert verdict.share is share and verdict.why
    assert gate("always", Pressure(10, 0)).share


def test_heavy_jobs_ask_for_more_than_half():
    assert compute_shards("heavy", 40) == 21 and compute_shards("heavy", 80) == 41
    assert compute_shards("light", 40) == compute_shards(None, 40) == compute_shards("heavy", 0) == 0


def test_idle_gpus_are_those_without_gpu_or_shard_allocations():
    assert idle_gpus("gpu:a100:2,shard:a100:80", "gpu:a100:1(IDX:1),shard:a100:3(IDX:0)") == 0
    assert idle_gpus("gpu:4(S:0-1),shard:160", "gpu:0(IDX:N/A),shard:2(IDX:0-1,3)") == 1
    assert idle_gpus("gpu:2", "") == 2
    assert idle_gpus("gpu:a100:3,shard:a100:120", "gpu:a100:1(IDX:2),shard:a100:5(5/40,0/40,0/40)") == 1  # 24.11
    idle, default = parse_sinfo(SINFO)
    assert default == "gpu" and idle["gpu"] == {"n1": 0, "n2": 1, "n3": 2, "n4": 0} and idle["big"] == {"n3": 2}


def test_pending_demand_counts_gpus_not_held_jobs():
    # 2 + 1x2 nodes + 1 (a share counts one GPU) + 3 (--gpus); the held job and the CPU job count nothing
    assert parse_squeue(SQUEUE) == {"gpu": 8, "big": 1}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_view_claims_reset_on_refresh_and_a_stale_or_failed_view_is_not_used(caplog):
    answers = {"sinfo": SINFO, "squeue": "gpu|gres:gpu:1|N/A|1|Resources\n"}
    clock = Clock()
    view = QueueView(lambda tool, *args: answers[tool], period_s=10.0, clock=clock)
    assert view.pressure("gpu") == (None, 0)  # no view yet
    assert view.refresh()
    assert view.pressure(None, None) == (Pressure(3, 1), 0)  # the default partition, sinfo's '*'
    view.claim("gpu")
    assert view.pressure("gpu,big") == (Pressure(3, 1), 1)  # n3 counted once
    assert view.pressure("nowhere") == (None, 0)
    answers["sinfo"] = ""
    del answers["squeue"]  # Slurm stops answering: the old view stays until it is stale
    assert not view.refresh() and not view.refresh()
    assert sum("not refreshed" in r.message for r in caplog.records) == 1  # logged once
    clock.t = 31.0
    assert view.pressure("gpu") == (None, 0)


def test_decision_keeps_gpu_1_while_idle_gpus_are_left():
    cfg = parse_config({"policy": {"share_when": "queued"}})
    request = SubmitRequest(tres_per_node="gres:gpu:1", script="#GPUSHARE mem=4G\n")
    directives = parse_directives(request.script)
    est = Estimate(4 * GiB, "directive:mem")
    kept = decide(request, directives, est, cfg, Queue(Pressure(3, 1), 0))
    assert kept.action == "accept" and kept.record["decision"] == "idle-gpus" and "3 idle" in kept.record["why"]
    shared = decide(request, directives, est, cfg, Queue(Pressure(3, 1), 2))
    assert shared.record["decision"] == "shared" and "pending" in shared.record["queue"]
    assert decide(request, directives, est, cfg, Queue(None)).record["decision"] == "shared"  # no view: share
    always = parse_config({"policy": {"share_when": "always"}})
    assert decide(request, directives, est, always, Queue(Pressure(3, 0))).record["decision"] == "shared"
    asked = parse_directives("#GPUSHARE mem=4G mode=shared\n")
    assert decide(request, asked, est, cfg, Queue(Pressure(3, 0))).record["decision"] == "shared"


def test_heavy_job_asks_for_more_than_half_the_gpu():
    cfg = parse_config({"policy": {"compute_sizing": True}})
    request = SubmitRequest(tres_per_node="gres:gpu:1", script="#GPUSHARE mem=4G compute=heavy\n")
    est = Estimate(4 * GiB, "directive:mem")
    decision = decide(request, parse_directives(request.script), est, cfg)
    half = smallest_cluster_gpu_gib(cfg) // 2 + 1  # 41 of the default's 80 GiB GPUs
    assert decision.tres_per_node is not None and decision.tres_per_node.endswith(f"shard:{half}")
    assert "compute heavy" in decision.record["why"]
    light = parse_directives("#GPUSHARE mem=4G compute=light\n")
    unbounded = parse_config({"policy": {"compute_sizing": True, "max_jobs_per_gpu": 0}})
    assert decide(request, light, est, unbounded).tres_per_node.endswith("shard:5")
    assert parse_directives("#GPUSHARE compute=extreme\n").problems


def test_a_shared_job_asks_for_at_least_its_share_of_the_gpu_so_few_jobs_stack_on_one():
    """The default bound: a small job asks for a quarter of the GPU's shards (at most four jobs per GPU);
    a job whose memory needs more keeps its memory's count; 0 turns the bound off."""
    request = SubmitRequest(tres_per_node="gres:gpu:1", script="#GPUSHARE mem=4G\n")
    est = Estimate(4 * GiB, "directive:mem")
    cfg = parse_config({"policy": {"share_when": "always"}})
    gpu_gib = smallest_cluster_gpu_gib(cfg)  # the default's 80 GiB GPUs
    decision = decide(request, parse_directives(request.script), est, cfg)
    assert decision.tres_per_node is not None and decision.tres_per_node.endswith(f"shard:{gpu_gib // 4}")
    assert "at most 4 jobs share the GPU" in decision.record["why"]
    big = Estimate(30 * GiB, "directive:mem")  # 30 + 3 GiB margin: 33 shards, above a quarter
    assert decide(request, parse_directives(request.script), big, cfg).tres_per_node.endswith("shard:33")
    off = parse_config({"policy": {"share_when": "always", "max_jobs_per_gpu": 0}})
    assert decide(request, parse_directives(request.script), est, off).tres_per_node.endswith("shard:5")
    assert share_shards(5, 80, 4) == 20 and share_shards(33, 80, 4) == 33 and share_shards(5, 80, 0) == 5
    assert share_shards(5, 7, 4) == 5 and share_shards(1, 3, 4) == 1  # a small GPU: memory already decides


def test_slurm_config_advises_first_fit_shards_with_the_queue_gate():
    from gpushare.slurm.version import SlurmVersion
    from gpushare.slurm_plugins.slurm_config import render_slurm_conf

    queued = render_slurm_conf(parse_config({}), "/etc/slurm", SlurmVersion(24, 11))
    assert "share_when = \"queued\" leave it out" in queued
    always = render_slurm_conf(parse_config({"policy": {"share_when": "always"}}), "/etc/slurm", SlurmVersion(24, 11))
    assert "LL_SHARED_GRES" in always and "leave it out" not in always
