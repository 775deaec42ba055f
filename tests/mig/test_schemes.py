"""MIGM Scheme A (by size) and Scheme B (arrival order): every job runs, and A reconfigures less."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.gpus import BUILTIN_GPUS, GiB
from gpushare.policy.schemes import Job, SchemeResult, scheme_a, scheme_b

A100 = BUILTIN_GPUS["a100-40gb"]


def migm_mix(seed: int, n: int) -> list[Job]:
    """Jobs sized like MIGM's mixes: mostly small, some 10/20/40 GB-class, shuffled arrivals."""
    rng = random.Random(seed)
    sizes = rng.choices([3, 7, 15, 30], weights=[5, 3, 2, 1], k=n)
    return [Job(f"j{i}", int(s * GiB), float(i), rng.uniform(1, 10)) for i, s in enumerate(sizes)]


def check_complete(result: SchemeResult, jobs: list[Job]) -> None:
    started = [s.job_id for s in result.starts]
    assert sorted(started) + sorted(result.unschedulable) == sorted(j.job_id for j in jobs)
    assert result.creates >= result.reconfigurations >= 0


def test_fixed_mix_on_one_gpu() -> None:
    jobs = [Job("a", 3 * GiB, 0), Job("b", 15 * GiB, 1), Job("c", 3 * GiB, 2), Job("d", 15 * GiB, 3),
            Job("e", 7 * GiB, 4), Job("f", 3 * GiB, 5)]
    a, b = scheme_a(A100, jobs), scheme_b(A100, jobs)
    check_complete(a, jobs)
    check_complete(b, jobs)
    assert a.reconfigurations == 3  # one per profile: 1g, 2g, 3g
    assert b.reconfigurations >= a.reconfigurations
    assert [s.profile for s in a.starts] == ["1g.5gb"] * 3 + ["2g.10gb"] + ["3g.20gb"] * 2
    assert [s.job_id for s in b.starts] == ["a", "b", "c", "d", "e", "f"]  # strict arrival order


def test_scheme_b_is_fifo_and_a_batches_by_size() -> None:
    jobs = [Job(str(i), (3 if i % 2 else 15) * GiB, i) for i in range(8)]
    a, b = scheme_a(A100, jobs), scheme_b(A100, jobs)
    assert a.reconfigurations == 2 <= b.reconfigurations
    times = [s.time for s in sorted(b.starts, key=lambda s: int(s.job_id))]
    assert times == sorted(times)


@pytest.mark.parametrize("gpus", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_migm_like_mixes_scheme_a_reconfigures_no_more(seed: int, gpus: int) -> None:
    jobs = migm_mix(seed, 60)
    a, b = scheme_a(A100, jobs, gpus), scheme_b(A100, jobs, gpus)
    check_complete(a, jobs)
    check_complete(b, jobs)
    assert a.reconfigurations <= b.reconfigurations


def test_several_gpus_can_favour_b_on_tiny_queues() -> None:
    # Known limit, not a bug: with two GPUs, one long 1g job and short 7g jobs, B keeps reusing one 7g
    # while the 1g runs, but A's 7g phase reshapes both GPUs. The one-GPU bound is a theorem; this is not.
    jobs = [Job("small", 2 * GiB, 0, duration=10)] + [Job(f"big{i}", 30 * GiB, i + 1) for i in range(3)]
    a, b = scheme_a(A100, jobs, 2), scheme_b(A100, jobs, 2)
    assert (a.reconfigurations, b.reconfigurations) == (3, 2)


def test_too_big_jobs_are_reported_not_run() -> None:
    jobs = [Job("huge", 60 * GiB, 0), Job("ok", 2 * GiB, 1)]
    for result in (scheme_a(A100, jobs), scheme_b(A100, jobs)):
        assert result.unschedulable == ("huge",)
        assert [s.job_id for s in result.starts] == ["ok"]


MODELS = ["a100-40gb", "h100-80gb", "a30-24gb"]
queues = st.lists(st.tuples(st.floats(0.05, 1.0), st.sampled_from([1.0, 2.0, 5.0, 10.0])),
                  min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MODELS), queues)
def test_scheme_a_never_reconfigures_more_than_b_on_one_gpu(name: str, queue: list) -> None:
    # A: at most one reconfiguration per distinct profile; B: at least one creation per distinct
    # profile, one planner call per job. Fractions are of the largest profile's usable memory.
    model = BUILTIN_GPUS[name]
    top = max(p.usable_bytes for p in model.mig_profiles)
    jobs = [Job(f"j{i}", int(f * top), float(i), d) for i, (f, d) in enumerate(queue)]
    a, b = scheme_a(model, jobs), scheme_b(model, jobs)
    check_complete(a, jobs)
    check_complete(b, jobs)
    assert a.reconfigurations <= len({s.profile for s in a.starts}) <= b.reconfigurations
