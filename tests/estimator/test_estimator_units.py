"""Unit tests of the estimator's pure parts: placeholders, recommendation, cache keys, schema, orchestration."""

from __future__ import annotations

from typing import get_args

import pytest

from gpushare.estimator_cli import cache
from gpushare.estimator_cli.events import Alloc, Capture, Kind
from gpushare.estimator_cli.orchestrate import WORKSPACE_KEY_BASE, check_lifetimes, orchestrate
from gpushare.estimator_cli.placeholders import DataDependent, placeholder
from gpushare.estimator_cli.recommend import recommend, tightest_mig
from gpushare.estimate.schema import TargetBytes, TargetJson, byte_field, target_rows, validate
from gpushare.config import PolicySection
from gpushare.gpus import BUILTIN_GPUS, GiB, parse_target


# -- placeholders -------------------------------------------------------------------------------------
def test_placeholder_survives_logging_arithmetic_and_formatting():
    loss = placeholder(True)
    running = 0.0
    running += loss
    running = running / 4 * 2 - 1 + abs(-loss) ** 2
    assert f"{running:.3f}" and str(loss) == "1.0"
    with pytest.raises(DataDependent):
        bool(running)


@pytest.mark.parametrize("use", [lambda v: v > 0.5, lambda v: v == 1, lambda v: range(v),
                                 lambda v: [0, 1][v], lambda v: {v: 1}, lambda v: bool(v)])
def test_placeholder_refuses_control_flow_and_shapes(use):
    with pytest.raises((DataDependent, TypeError)):  # TypeError: a float is no size or index
        use(placeholder(False) + 1)
    with pytest.raises(DataDependent):
        int(placeholder(False))


# -- recommendation -----------------------------------------------------------------------------------
def test_shared_request_rounds_up_to_whole_gib_shards_with_margin():
    model, _ = parse_target("a100-80gb")
    rec = recommend(int(10.2 * GiB), model, None, PolicySection(), oom=False)
    assert rec.kind == "shared"
    assert rec.margin_bytes == int(10.2 * GiB * 0.10)  # 10 % beats the 1 GiB minimum
    assert rec.shard_gib == 12 and rec.request == "shard:12"
    assert rec.mig_profile == "1g.20gb"  # tightest slice that holds 11.22 GiB (2 memory slices, 1 compute)


def test_minimum_margin_and_exclusive_threshold():
    model, _ = parse_target("rtx4060-8gb")
    small = recommend(GiB // 2, model, None, PolicySection(), oom=False)
    assert small.margin_bytes == GiB and small.kind == "shared"
    big = recommend(7 * GiB, model, None, PolicySection(), oom=False)
    assert big.kind == "exclusive" and big.request == "gpu:1"


def test_mig_target_fits_or_not_and_oom_never_fits():
    model, profile = parse_target("a100-40gb:1g.5gb")
    assert recommend(2 * GiB, model, profile, PolicySection(), oom=False).kind == "mig"
    assert recommend(4 * GiB, model, profile, PolicySection(), oom=False).kind == "does_not_fit"
    whole, _ = parse_target("a100-40gb")
    assert recommend(GiB, whole, None, PolicySection(), oom=True).kind == "does_not_fit"


def test_tightest_mig_prefers_fewest_memory_slices():
    assert tightest_mig(BUILTIN_GPUS["h100-80gb"], 15 * GiB).name == "1g.20gb"
    assert tightest_mig(BUILTIN_GPUS["v100-32gb"], GiB) is None


# -- cache --------------------------------------------------------------------------------------------
def test_cache_key_depends_on_every_input(tmp_path):
    base = dict(script_bytes=b"print(1)", args=["--bs", "8"], env={}, torch_version="2.13.0",
                targets=["a100-80gb"], settings={"mode": "auto"})
    key = cache.cache_key(**base)
    variants = [dict(base, script_bytes=b"print(2)"), dict(base, args=["--bs", "16"]),
                dict(base, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
                dict(base, torch_version="2.12.0"), dict(base, targets=["h100-80gb"])]
    assert len({key, *(cache.cache_key(**v) for v in variants)}) == 6
    assert cache.cache_key(**dict(base, env={"HOME": "/x"})) == key  # irrelevant variables do not count
    cache.store(tmp_path, key, {"cache_key": key, "x": 1})
    assert cache.load(tmp_path, key) == {"cache_key": key, "x": 1}
    assert cache.load(tmp_path, "0" * 64) is None
    (tmp_path / f"{'1' * 64}.json").write_text('{"cache_key": "other"}')
    assert cache.load(tmp_path, "1" * 64) is None  # a file under the wrong name is not trusted


# -- schema -------------------------------------------------------------------------------------------
def _target(**over):
    row = {"gpu": "a100-80gb", "capacity_bytes": 80 * GiB, "peak_allocated_bytes": 1, "peak_reserved_bytes": 2,
           "context_bytes": 3, "other_driver_bytes": 0, "peak_total_bytes": 5, "fits": True, "oom": False,
           "share_of_gpu": 0.0, "recommendation": {}, "top_modules": [], "by_phase": [], "by_kind": []}
    row.update(over)
    return row


def test_schema_invariants():
    assert any("peak_total" in p for p in validate({"targets": [_target(peak_total_bytes=6)]}))
    assert any("allocated peak" in p for p in validate({"targets": [_target(peak_allocated_bytes=9)]}))
    assert any("missing field 'cache_key'" in p for p in validate({"targets": [_target()]}))


def test_target_bytes_names_every_byte_count_of_a_target():
    assert set(get_args(TargetBytes)) == {k for k in TargetJson.__annotations__ if k.endswith("_bytes")}


def test_lenient_readers_take_both_target_shapes_and_only_integers():
    listed = {"targets": [_target(), "junk", {"gpu": "h100-80gb", "peak_total_bytes": True}]}
    assert [row["gpu"] for row in target_rows(listed)] == ["a100-80gb", "h100-80gb"]
    keyed = {"targets": {"a100-40gb": {"peak_total_bytes": 7}, "x": 3}}
    assert target_rows(keyed) == [{"peak_total_bytes": 7, "gpu": "a100-40gb"}]
    assert target_rows([]) == target_rows({"targets": "x"}) == target_rows({}) == []
    assert byte_field({"peak_total_bytes": 5}, "peak_total_bytes") == 5
    assert byte_field({"peak_total_bytes": True}, "peak_total_bytes") is None
    assert byte_field({"peak_total_bytes": 5.0}, "peak_total_bytes") is None


# -- orchestration ------------------------------------------------------------------------------------
def _capture(rows, events, zero_grads=()):
    allocs = {r[0]: Alloc(*r) for r in rows}
    return Capture(mode="fake", steps=1, stopped=True, events=events, allocs=allocs, zero_grads=list(zero_grads))


def test_cublas_workspace_once_per_thread_and_cudnn_workspace_is_temporary():
    cap = _capture([(0, 1000, "m", "forward", 0, "addmm.default", "activation"),
                    (1, 1000, "m", "forward", 0, "mm.default", "activation"),
                    (2, 4000, "c", "forward", 0, "convolution.default", "activation"),
                    (3, 1000, "m", "backward", 0, "mm.default", "gradient")],
                   [("alloc", 0), ("alloc", 1), ("alloc", 2), ("alloc", 3), ("free", 1)])
    orch = orchestrate(cap, cublas_workspace_bytes=8 << 20)
    workspaces = [e for e in orch.events if e[0] == "alloc" and e[1] <= WORKSPACE_KEY_BASE]
    # fwd cuBLAS, cuDNN (no geometry captured: ½ output), bwd cuBLAS
    assert [e[2] for e in workspaces] == [8 << 20, 2000, 8 << 20]
    cudnn_key = workspaces[1][1]
    ops = [(e[0], e[1]) for e in orch.events]
    # Conv_v8.cpp's run_conv_plan: the output exists first, then the workspace, released when the call returns
    assert ops.index(("alloc", cudnn_key)) == ops.index(("alloc", 2)) + 1
    assert ops.index(("free", cudnn_key)) == ops.index(("alloc", cudnn_key)) + 1
    assert orch.uses_cudnn and orch.uses_cublas


def test_check_lifetimes_flags_gradient_freed_before_zero_grad():
    rows = [(0, 64, "m", "backward", 0, "mm.default", Kind.GRADIENT.value)]
    good = _capture(rows, [("alloc", 0), ("free", 0)], [{"event": 1, "set_to_none": True}])
    bad = _capture(rows, [("alloc", 0), ("free", 0)], [{"event": 2, "set_to_none": True}])
    assert check_lifetimes(good) == []
    assert check_lifetimes(bad)


# -- meta-kernel cache --------------------------------------------------------------------------------
def test_meta_cache_reuses_fresh_outputs_keeps_inplace_aliasing_and_never_caches_views_or_cpu():
    import torch

    from gpushare.estimator_cli.meta_cache import MetaCache

    ops = torch.ops.aten
    cache = MetaCache()
    calls = []

    def runner(fn):
        return lambda: (calls.append(1), fn())[1]

    a, b = torch.empty(4, 8, device="meta"), torch.empty(8, 3, device="meta")
    first = cache.call(ops.mm.default, (a, b), {}, runner(lambda: ops.mm.default(a, b)))
    second = cache.call(ops.mm.default, (a, b), {}, runner(lambda: ops.mm.default(a, b)))
    assert len(calls) == 1 and cache.hits == 1
    assert (second.shape, second.stride(), second.dtype) == (first.shape, first.stride(), first.dtype)
    assert second.untyped_storage().nbytes() == first.untyped_storage().nbytes() == 4 * 3 * 4
    assert second.untyped_storage() is not first.untyped_storage()  # a fresh allocation, as on the GPU
    cache.call(ops.add_.Tensor, (a, a), {}, runner(lambda: ops.add_.Tensor(a, a)))
    assert cache.call(ops.add_.Tensor, (a, a), {}, runner(lambda: ops.add_.Tensor(a, a))) is a
    calls.clear()
    for _ in range(2):
        cache.call(ops.t.default, (b,), {}, runner(lambda: ops.t.default(b)))  # a view: always runs
        c = torch.ones(2)
        cache.call(ops.mul.Tensor, (c, c), {}, runner(lambda: ops.mul.Tensor(c, c)))  # real CPU work
    assert len(calls) == 4


def test_meta_cache_ignores_float_operands_of_inplace_ops_only():
    """Adam's step sizes change every step; an in-place op's outputs are its inputs whatever they are.
    A fresh op's shape can depend on a float (arange), so there the value stays in the key."""
    import torch

    from gpushare.estimator_cli.meta_cache import MetaCache

    ops = torch.ops.aten
    cache = MetaCache()
    a = torch.empty(4, 8, device="meta")
    for alpha in (0.1, 0.2, 0.3):
        assert cache.call(ops.add_.Scalar, (a, alpha), {}, lambda: ops.add_.Scalar(a, alpha)) is a
    assert cache.hits == 2
    short = cache.call(ops.arange.start_step, (0.0, 1.5, 0.5), {"device": torch.device("meta")},
                       lambda: ops.arange.start_step(0.0, 1.5, 0.5, device="meta"))
    long = cache.call(ops.arange.start_step, (0.0, 2.5, 0.5), {"device": torch.device("meta")},
                      lambda: ops.arange.start_step(0.0, 2.5, 0.5, device="meta"))
    assert (short.shape[0], long.shape[0]) == (3, 5)


def test_fake_mode_skips_random_initial_values_of_parameters_only():
    """Drawing parameters' initial values is most of a big model's construction time on a CPU and the
    values never reach the (meta) GPU side; any other tensor is still filled for real."""
    import torch

    from gpushare.estimator_cli.device_mode import CudaPresenter

    presenter = CudaPresenter("meta", 8)
    with presenter:
        torch.manual_seed(0)
        linear = torch.nn.Linear(64, 64)  # reset_parameters: kaiming_uniform_ and uniform_ by keyword
        emb = torch.nn.Embedding(10, 4)
        emb.weight.data.normal_(0.0, 0.02)  # Hugging Face's _init_weights style, through .data
        torch.nn.init.trunc_normal_(linear.weight, std=0.02)  # uniform_ then erfinv_ on the tensor
        data = torch.empty(1000).uniform_(1.0, 2.0)  # not a parameter: real values
        moved = linear.cuda()
    assert presenter.skipped_init_fills >= 5
    assert float(data.min()) >= 1.0 and float(data.max()) <= 2.0 and float(data.std()) > 0.1
    assert moved.weight.is_meta and moved.weight.shape == (64, 64)
    plain = CudaPresenter("cpu", 8)  # profile mode runs everything for real
    with plain:
        real = torch.nn.Linear(64, 64)
    assert plain.skipped_init_fills == 0 and float(real.weight.detach().abs().sum()) > 0
