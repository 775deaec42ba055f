"""Each placement policy on small hand-checked GPU snapshots (gpushare.simulator.policies)."""

import pytest

from gpushare.gpus import GiB
from gpushare.simulator.policies import GpuState, JobRequest, make_policy

TOTAL = 40 * GiB


def gpus(free_gib, **overrides):
    """Three GPUs on one node with the given free GiB; overrides: name -> list per GPU."""
    out = []
    for i, free in enumerate(free_gib):
        fields = {"index": i, "total_bytes": TOTAL, "free_bytes": int(free * GiB), "jobs": 1,
                  "shards_total": 40, "shards_free": int(free)}
        fields.update({k: v[i] for k, v in overrides.items()})
        out.append(GpuState(**fields))
    return out


def job(need_gib=8, n=1, shards=None, exclusive=False):
    mem = None if need_gib is None else int(need_gib * GiB)
    return JobRequest("j", n, mem, shards if shards is not None else int(need_gib or 2), exclusive)


# GPUs free 10, 30, 20 GiB; SMACT scores .5, .7, .2
SNAP = gpus([10, 30, 20], smact=[0.5, 0.7, 0.2])


@pytest.mark.parametrize("policy, need, expected", [
    ("ff", 8, [0]),     # first index that fits
    ("bf", 8, [0]),     # least free that fits: 10
    ("magm", 8, [1]),   # most free: 30
    ("lug", 8, [2]),    # lowest SMACT: .2
    ("ff", 15, [1]),    # GPU0 (10) too small
    ("bf", 15, [2]),    # 20 is the tightest fit
    ("lug", 25, [1]),   # only GPU1 fits, whatever its SMACT
    ("magm", 35, None),  # nothing fits: wait
])
def test_telemetry_policies(policy, need, expected):
    assert make_policy(policy).choose(job(need), SNAP) == expected


def test_risky_and_warming_gpus_are_withheld():
    risky = gpus([10, 30, 20], risky=[False, True, False])
    assert make_policy("magm").choose(job(8), risky) == [2]          # 30 is risky -> 20
    assert make_policy("magm-nofilter").choose(job(8), risky) == [1]  # filter off -> 30
    warming = gpus([10, 30, 20], warming=[False, True, True])
    assert make_policy("magm").choose(job(8), warming) == [0]
    assert make_policy("lug").choose(job(8), gpus([10, 30, 20], warming=[True] * 3)) is None


def test_no_estimate_uses_the_2gb_precondition():
    # GPU0 has 1 GiB free: below CARMA's 2 GB precondition; GPU1 3 GiB is enough without an estimate
    assert make_policy("ff").choose(job(None), gpus([1, 3, 30])) == [1]


def test_exclusive_takes_idle_gpus_only():
    snap = gpus([40, 40, 40], jobs=[1, 0, 0])
    assert make_policy("exclusive").choose(job(8), snap) == [1]
    assert make_policy("exclusive").choose(job(8, n=2), snap) == [1, 2]
    assert make_policy("exclusive").choose(job(8), gpus([40] * 3, jobs=[1, 1, 1])) is None


def test_recovery_request_is_exclusive_under_any_policy():
    snap = gpus([39, 10, 40], jobs=[1, 1, 0])
    for name in ("magm", "lug", "rr", "slurm-shards"):
        assert make_policy(name).choose(job(8, exclusive=True), snap) == [2]


def test_gpu_holding_an_exclusive_job_is_never_shared():
    snap = gpus([30, 10, 20], exclusive=[True, False, False])
    assert make_policy("magm").choose(job(8), snap) == [2]
    assert make_policy("slurm-shards").choose(job(8), snap) == [1]


def test_round_robin_cycles_and_skips_warming():
    rr = make_policy("rr")
    snap = gpus([1, 1, 1])  # no memory precondition: 1 GiB free is fine for RR
    assert [rr.choose(job(8), snap) for _ in range(4)] == [[0], [1], [2], [0]]
    snap = gpus([40, 40, 40], warming=[False, True, False])
    # cursor is at GPU1 now, which is warming -> GPU2, then GPU0
    assert rr.choose(job(8), snap) == [2]
    assert rr.choose(job(8), snap) == [0]


def test_slurm_first_fit_on_shards_ignores_telemetry():
    snap = gpus([5, 30, 20], risky=[False, True, False], warming=[False, True, False])
    pick = make_policy("slurm-shards")
    assert pick.choose(job(10), snap) == [1]  # lowest index with 10 free shards, risky or not
    assert pick.choose(job(25), snap) == [1]
    assert pick.choose(job(35), snap) is None


def test_multi_gpu_jobs_stay_on_one_node():
    snap = [GpuState(i, TOTAL, int(f * GiB), node=i // 2, shards_total=40, shards_free=f)
            for i, f in enumerate([30, 5, 20, 25])]
    # MAGM ranks 30 (node 0), 25, 20 (node 1), 5: node 0 has only one fitting GPU -> node 1
    assert make_policy("magm").choose(job(8, n=2), snap) == [3, 2]
    assert make_policy("ff").choose(job(8, n=2), snap) == [2, 3]


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="known: exclusive, rr"):
        make_policy("fastest")
    with pytest.raises(ValueError):
        make_policy("rr-nofilter")


def test_slurm_first_fit_over_withheld_gpus():
    # the agent withholds GPU1 (risky) and GPU0 (warming); Slurm first-fits over what is left
    snap = gpus([30, 30, 20], risky=[False, True, False], warming=[True, False, False])
    assert make_policy("slurm-shards-withheld").choose(job(10), snap) == [2]
    assert make_policy("slurm-shards").choose(job(10), snap) == [0]


def test_least_loaded_shards_spread_where_first_fit_stacks() -> None:
    """Slurm 24.11's LL_SHARED_GRES: fewest allocated shards first; 22.05's first-fit: lowest index."""
    snap = [GpuState(0, 40 * GiB, 30 * GiB, jobs=1, shards_total=40, shards_free=30),
            GpuState(1, 40 * GiB, 40 * GiB, shards_total=40, shards_free=40),
            GpuState(2, 80 * GiB, 60 * GiB, jobs=1, shards_total=80, shards_free=70)]
    assert make_policy("slurm-shards").choose(job(8), snap) == [0]
    assert make_policy("slurm-shards-ll").choose(job(8), snap) == [1]
    assert make_policy("slurm-shards-ll").choose(job(50), snap) == [2]  # only GPU 2 has 50 free


def _random_cluster(rng, nodes=4, per_node=4):
    out = []
    for i in range(nodes * per_node):
        free = rng.choice([0, 1, 3, 8, 12, 20, 30, 40])
        out.append(GpuState(index=i, node=i // per_node, total_bytes=TOTAL, free_bytes=int(free * GiB),
                            jobs=rng.randrange(3), exclusive=rng.random() < 0.1, risky=rng.random() < 0.3,
                            warming=rng.random() < 0.3, smact=round(rng.random(), 2), shards_total=40,
                            shards_free=rng.choice([0, 2, 8, 20, 40])))
    return out


def test_prefiltered_and_ranked_choices_equal_the_plain_choice():
    """What the simulator's engine relies on to avoid a pass over every GPU: ``choose`` on the policy's
    ``prefilter`` of the GPUs, and ``choose_ranked`` over the GPUs in ``key`` order, answer as ``choose``
    on all of them, for every policy, job size and memory request (random clusters, fixed seed)."""
    import random

    from gpushare.simulator.policies import POLICIES

    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        cluster = _random_cluster(rng)
        for name in [*POLICIES, "magm-nofilter"]:
            request = job(rng.choice([None, 2, 8, 15, 30]), n=rng.choice([1, 1, 2, 3, 4]),
                          exclusive=rng.random() < 0.1)
            expected = make_policy(name).choose(request, cluster)
            policy = make_policy(name)
            assert policy.choose(request, policy.prefilter(request, cluster)) == expected, name
            if policy.static_key and policy.collocates and not request.exclusive:
                ranked = sorted(cluster, key=policy.key)
                nodes = {g.node: [h for h in cluster if h.node == g.node] for g in cluster}
                assert policy.choose_ranked(request, iter(ranked), nodes.__getitem__) == expected, name
                checked += expected is not None
    assert checked > 500  # most draws place something
