"""Property test: any sequence of MIG calls leaves the simulated GPU in a state the driver could be in."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gpushare.gpus import BUILTIN_GPUS
from gpushare.gres import GpuError, NvmlCode
from gpushare.gres.sim_backend import SimBackend

MODELS = ["a100-40gb", "a30-24gb", "h100-80gb"]
op = st.tuples(st.sampled_from(["gi", "ci", "dci", "dgi"]), st.integers(0, 25), st.integers(0, 8))


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(MODELS), ops=st.lists(op, max_size=30))
def test_random_mig_calls_keep_invariants(model, ops):
    b = SimBackend.from_scenario({"version": 1, "gpus": [{"model": model, "mig_mode": True}]}, clock=lambda: 0.0)
    spec = BUILTIN_GPUS[model]
    allowed = {NvmlCode.INSUFFICIENT_RESOURCES, NvmlCode.INVALID_ARGUMENT, NvmlCode.NOT_FOUND, NvmlCode.IN_USE}
    for kind, a, c in ops:
        gis = b.gpu_instances(0)
        try:
            if kind == "gi":
                b.create_gpu_instance(0, a, c)
            elif kind == "ci" and gis:
                b.create_compute_instance(0, gis[a % len(gis)].id)
            elif kind == "dci" and gis:
                b.destroy_compute_instance(0, gis[a % len(gis)].id, 0)
            elif kind == "dgi" and gis:
                b.destroy_gpu_instance(0, gis[a % len(gis)].id)
        except GpuError as exc:
            assert exc.code in allowed, exc
        gis = b.gpu_instances(0)
        slices = [s for gi in gis for s in range(gi.placement.start, gi.placement.start + gi.placement.size)]
        assert len(slices) == len(set(slices)) and all(0 <= s < spec.memory_slices for s in slices)
        compute = sum(spec.mig_profile(gi.profile_name).compute_slices for gi in gis)
        assert compute <= max(p.compute_slices for p in spec.mig_profiles)
        assert len({gi.id for gi in gis}) == len(gis)
        for gi in gis:
            assert gi.placement.start in spec.mig_profile(gi.profile_name).placements
        assert len(b.mig_devices(0)) == sum(len(b.compute_instances(0, gi.id)) for gi in gis)
