"""The submit decision, pure: request + directives + estimate + config in, Decision out."""

from __future__ import annotations

import json

import pytest

from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.slurm_plugins.decision import Estimate, SubmitRequest, decide, parse_record
from gpushare.estimate.directives import parse_directives

# memory arithmetic: no bound on the jobs per GPU (test_share_gate.py tests the bound)
CFG = parse_config({"policy": {"max_jobs_per_gpu": 0}, "nodes": [{"names": "n1", "gpu": "a100-40gb", "count": 2}]})


def run(tres: str | None = "gres:gpu:1", script: str = "#!/bin/bash\n", est_gib: float | None = None,
        cfg=CFG, **fields):
    request = SubmitRequest(user_id=1000, tres_per_node=tres, script=script, **fields)
    estimate = Estimate(int(est_gib * GiB), "directive:mem") if est_gib is not None else None
    return decide(request, parse_directives(script), estimate, cfg)


def test_non_gpu_job_untouched_without_record():
    decision = run(tres=None)
    assert decision.action == "accept" and decision.admin_comment == "" and decision.user_message == ""


def test_estimate_becomes_shards_with_margin():
    # 12 GiB + max(10 %, 1 GiB) = 13.2 GiB -> 14 shards of 1 GiB
    decision = run(est_gib=12)
    assert decision.action == "modify"
    assert decision.tres_per_node == "gres:shard:14"
    record = parse_record(decision.admin_comment)
    assert record == {"v": 1, "decision": "shared", "est_gib": 12.0, "src": "directive:mem", "margin_gib": 1.2,
                      "old": "gres:gpu:1", "new": "gres:shard:14", "why": "fits 14 of 40 GiB"}
    assert "shard:14" in decision.user_message


def test_minimum_margin_applies_to_small_jobs():
    # 2 GiB * 10 % = 0.2 GiB < 1 GiB minimum -> 3 GiB -> 3 shards
    assert run(est_gib=2).tres_per_node == "gres:shard:3"


def test_large_estimate_keeps_whole_gpu():
    # 36 GiB + 3.6 = 39.6 -> 40 shards > 90 % of 40
    decision = run(est_gib=36)
    assert decision.action == "accept"
    assert parse_record(decision.admin_comment)["decision"] == "exclusive"
    assert "keeping gpu:1" in decision.user_message


def test_no_estimate_keeps_gpu_and_says_how_to_fix():
    decision = run()
    assert decision.action == "accept"
    assert parse_record(decision.admin_comment)["decision"] == "exclusive"
    assert "#GPUSHARE mem=" in decision.user_message


def test_recover_mode_uses_default_size():
    cfg = parse_config({"policy": {"without_estimate": "recover", "recover_default_gib": 8, "max_jobs_per_gpu": 0},
                        "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    decision = run(cfg=cfg)
    assert decision.tres_per_node == "gres:shard:9"
    assert parse_record(decision.admin_comment)["src"] == "default"


@pytest.mark.parametrize("fields, kind", [
    ({"tres": "gres:gpu:2"}, "multi-gpu"),
    ({"tres": "gres:gpu:a100-40gb:1"}, "typed"),
    ({"tres": "gres:shard:3"}, "explicit"),
    ({"tres": None, "tres_per_job": "gres:gpu:1"}, "per-job"),
    ({"tres": "gres:gpu:1", "min_nodes": 2}, "multi-node"),
    ({"tres": "gres:gpu:1", "het_offset": 1}, "heterogeneous"),
])
def test_requests_kept_deliberately(fields, kind):
    decision = run(est_gib=4, **fields)
    assert decision.action == "accept"
    assert parse_record(decision.admin_comment)["decision"] == kind


def test_array_job_is_shared_and_marked():
    decision = run(est_gib=4, array=True)
    assert decision.tres_per_node == "gres:shard:5"
    assert parse_record(decision.admin_comment)["array"] is True


def test_other_gres_kept_when_rewriting():
    decision = run(tres="gres:gpu:1,gres:license:2", est_gib=4)
    assert decision.tres_per_node == "gres:shard:5,gres:license:2"


def test_mode_exclusive_directive():
    decision = run(script="#GPUSHARE mem=4G mode=exclusive\n", est_gib=4)
    assert decision.action == "accept"
    assert parse_record(decision.admin_comment)["decision"] == "exclusive"


def test_bad_directive_accept_mode_changes_nothing():
    decision = run(script="#!/bin/sh\n#GPUSHARE mem=lots\n", est_gib=None)
    assert decision.action == "accept"
    record = parse_record(decision.admin_comment)
    assert record["decision"] == "bad-directive" and "line 2" in record["why"]
    assert "ignoring" in decision.user_message


def test_bad_directive_reject_mode():
    cfg = parse_config({"submit": {"on_bad_directive": "reject"}, "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    decision = run(script="#GPUSHARE mem=-3G\n", cfg=cfg)
    assert decision.action == "reject"
    assert decision.reject_message.startswith("gpushare: #GPUSHARE on line 1")


def test_sharing_off_annotates_only():
    cfg = parse_config({"policy": {"shared": "none"}, "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    decision = run(est_gib=4, cfg=cfg)
    assert decision.action == "accept" and parse_record(decision.admin_comment)["decision"] == "annotate"


def test_unparseable_gres_left_alone():
    decision = run(tres="gres:gpu:1:2:3:4")
    assert decision.action == "accept"
    assert parse_record(decision.admin_comment)["decision"] == "unparsed"


def test_smallest_gpu_in_cluster_bounds_shares():
    cfg = parse_config({"nodes": [{"names": "a", "gpu": "a100-80gb"}, {"names": "b", "gpu": "a30-24gb"}]})
    assert run(est_gib=20, cfg=cfg).action == "accept"  # 22 GiB > 90 % of 24
    assert run(est_gib=10, cfg=cfg).tres_per_node == "gres:shard:11"  # 10 + 1


def test_record_is_compact_json():
    decision = run(est_gib=4)
    assert decision.admin_comment.startswith("gpushare:{")
    assert len(decision.admin_comment) < 400
    json.loads(decision.admin_comment[len("gpushare:"):])


MIG_CFG = parse_config({"policy": {"max_jobs_per_gpu": 0}, "nodes": [{"names": "n1", "gpu": "a100-40gb", "count": 2},
                                  {"names": "m[1-2]", "gpu": "a100-40gb", "mig": True, "partition": "mig"},
                                  {"names": "m3", "gpu": "a100-80gb", "mig": True, "partition": "mig80"}]})


def test_a_job_sent_to_mig_partitions_gets_the_smallest_slice_that_holds_its_estimate():
    decision = run(est_gib=4, cfg=MIG_CFG, partition="mig")  # 4 + 1 GiB margin: 1g.5gb (4.75 GiB) is too small
    assert decision.action == "modify" and decision.tres_per_node == "gres:gpu:1g.10gb:1"
    record = parse_record(decision.admin_comment)
    assert record["decision"] == "mig" and record["new"] == "gres:gpu:1g.10gb:1" and "9.6 GiB usable" in record["why"]
    assert run(est_gib=3, cfg=MIG_CFG, partition="mig").tres_per_node == "gres:gpu:1g.5gb:1"
    assert run(est_gib=12, cfg=MIG_CFG, partition="mig").tres_per_node == "gres:gpu:3g.20gb:1"
    # the separator the request came with is kept (23.02+ hands the hook gres/)
    assert run(tres="gres/gpu:1", est_gib=12, cfg=MIG_CFG, partition="mig").tres_per_node == "gres/gpu:3g.20gb:1"


def test_a_slice_request_names_a_profile_every_gpu_of_the_partitions_has():
    # a100-40gb and a100-80gb share 2g/3g/... names only where their memory agrees: 1g.10gb exists on both
    decision = run(est_gib=4, cfg=MIG_CFG, partition="mig,mig80")
    assert decision.tres_per_node == "gres:gpu:1g.10gb:1"
    # bigger than any slice: the largest (an untyped gpu:1 could land on a 1g.5gb slice)
    big = run(est_gib=80, cfg=MIG_CFG, partition="mig80")
    assert big.tres_per_node == "gres:gpu:7g.80gb:1" and "needs more than any slice" in parse_record(big.admin_comment)["why"]


def test_partitions_with_shard_nodes_or_none_named_keep_the_shard_path():
    assert run(est_gib=4, cfg=MIG_CFG).tres_per_node == "gres:shard:5"
    assert run(est_gib=4, cfg=MIG_CFG, partition="gpu,mig").tres_per_node == "gres:shard:5"
    assert run(est_gib=4, cfg=MIG_CFG, partition="unknown").tres_per_node == "gres:shard:5"
