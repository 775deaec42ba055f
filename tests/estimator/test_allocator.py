"""Hand-worked allocation sequences for the caching-allocator model.

Every expected number is derived in the comments from the rules of CUDACachingAllocator.cpp:
requests round up to 512 B; <= 1 MiB goes to the small pool (2 MiB segments); 1-10 MiB to a 20 MiB segment;
>= 10 MiB to a segment rounded up to 2 MiB; a large block is split only when more than 1 MiB would remain.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.estimator_cli.allocator import (
    AllocatorConfig,
    CachingAllocatorSim,
    SimulatedOOM,
    allocation_size,
    format_size,
    replay,
    replay_many,
    round_size,
    roundup_power2_next_division,
)
from gpushare.gpus import KiB, MiB, GiB

BIG = 80 * GiB  # a device large enough that nothing here runs out


def sim(config: str = "", capacity: int = BIG, **kw) -> CachingAllocatorSim:
    return CachingAllocatorSim(capacity, AllocatorConfig.from_env_string(config), **kw)


# --- rounding and pools ---------------------------------------------------------------------------------


def test_rounding_to_512_bytes_and_small_segment():
    s = sim()
    s.malloc(1)  # 1 B -> 512 B block, new 2 MiB small segment
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (512, 2 * MiB, 1)
    s.malloc(513)  # 513 B -> 1024 B, carved from the same segment
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (512 + 1024, 2 * MiB, 1)
    assert s.malloc(0) == 0  # PyTorch hands out a null pointer, no block
    assert s.allocated_bytes == 1536


def test_small_pool_packs_four_half_mib_requests_into_one_segment():
    s = sim()
    for _ in range(4):  # 512 KiB each: 2 MiB -> 1.5 -> 1 -> 0.5 -> 0 MiB left, last one takes the rest whole
        s.malloc(512 * KiB)
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (2 * MiB, 2 * MiB, 1)
    s.malloc(512 * KiB)  # fifth needs a second 2 MiB segment
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (2 * MiB + 512 * KiB, 4 * MiB, 2)


def test_large_pool_twenty_mib_segment_and_split_limit():
    s = sim()
    s.malloc(MiB + 1)  # 1 MiB + 512 B, large pool, 1-10 MiB -> 20 MiB segment
    assert (s.allocated_bytes, s.reserved_bytes) == (MiB + 512, 20 * MiB)
    s.malloc(5 * MiB)  # from the 19 MiB - 512 B remainder; 14 MiB - 512 B remain (> 1 MiB): split
    assert (s.allocated_bytes, s.reserved_bytes) == (6 * MiB + 512, 20 * MiB)
    # 13 MiB + 1 B -> 13 MiB + 512 B fits the 14 MiB - 512 B block; 1 MiB - 1 KiB would remain,
    # which is not > 1 MiB, so the whole block is handed out: allocated = 20 MiB exactly.
    s.malloc(13 * MiB + 1)
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (20 * MiB, 20 * MiB, 1)


def test_segments_of_ten_mib_and_more_are_rounded_to_two_mib():
    s = sim()
    s.malloc(10 * MiB)  # exactly kMinLargeAlloc: own 10 MiB segment
    s.malloc(11 * MiB + 1)  # 11 MiB + 512 B -> 12 MiB segment; 1 MiB - 512 B would remain: not split
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (22 * MiB, 22 * MiB, 2)


def test_allocation_and_round_size_helpers():
    cfg = AllocatorConfig()
    assert allocation_size(round_size(700 * KiB, cfg), cfg) == 2 * MiB
    assert allocation_size(round_size(3 * MiB, cfg), cfg) == 20 * MiB
    assert allocation_size(round_size(21 * MiB - 5, cfg), cfg) == 22 * MiB
    assert roundup_power2_next_division(1200, 4) == 1280  # the example in the C++ comment
    assert roundup_power2_next_division(1024, 4) == 1024  # powers of two stay
    assert format_size(1024) == "1024 bytes"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(20 * MiB) == "20.00 MiB"
    assert format_size(3 * GiB // 2) == "1.50 GiB"


def test_streams_do_not_share_cached_blocks():
    s = sim()
    s.free(s.malloc(1000, stream=0))
    s.malloc(1000, stream=1)  # the cached 2 MiB segment belongs to stream 0: a second segment
    assert (s.reserved_bytes, s.num_segments) == (4 * MiB, 2)


# --- best fit, coalescing, fragmentation ----------------------------------------------------------------


def test_coalescing_neighbours_and_empty_cache():
    s = sim()
    a = s.malloc(2 * MiB)  # one 20 MiB segment: a [0,2) b [2,4) c [4,6) free [6,20)
    b = s.malloc(2 * MiB)
    c = s.malloc(2 * MiB)
    assert (b - a, c - a) == (2 * MiB, 4 * MiB)
    s.free(b)  # free [2,4) between two live blocks
    s.free(a)  # merges with b: free [0,4)
    again = s.malloc(4 * MiB)  # best fit is the merged 4 MiB block at the segment start, not [6,20)
    assert again == a
    s.free(again)
    s.free(c)  # everything merges back into one unsplit 20 MiB block
    assert (s.allocated_bytes, s.reserved_bytes) == (0, 20 * MiB)
    s.empty_cache()
    assert (s.reserved_bytes, s.num_segments) == (0, 0)


def test_best_fit_picks_the_smallest_block_that_fits():
    s = sim()
    x1 = s.malloc(3 * MiB)  # [0,3)
    s.malloc(2 * MiB)  # [3,5) stays live
    x2 = s.malloc(6 * MiB)  # [5,11)
    s.malloc(2 * MiB)  # [11,13) stays live; free tail [13,20) = 7 MiB
    s.free(x1)
    s.free(x2)  # free blocks: 3 MiB @0, 6 MiB @5, 7 MiB @13
    assert s.malloc(3 * MiB) == x1  # exact fit
    y = s.malloc(5 * MiB)  # 6 MiB block fits best; 1 MiB would remain (not > 1 MiB): whole block
    assert y == x2
    assert s.allocated_bytes == 3 * MiB + 2 * MiB + 6 * MiB + 2 * MiB


def test_fragmentation_makes_peak_reserved_exceed_peak_live_bytes():
    # Batch grows from 12 MiB to 14 MiB tensors: the cached 12 MiB segments cannot serve 14 MiB requests.
    s = sim()
    first = [s.malloc(12 * MiB) for _ in range(4)]  # 4 segments of 12 MiB = 48 MiB
    for h in first:
        s.free(h)
    for _ in range(4):
        s.malloc(14 * MiB)  # 4 new 14 MiB segments: 48 + 56 = 104 MiB reserved
    assert s.peak_allocated_bytes == 56 * MiB  # the most ever live
    assert s.peak_reserved_bytes == 104 * MiB
    assert s.num_segments == 8


def test_expandable_segments_remove_that_fragmentation():
    # Same sequence with expandable_segments:True: one segment grows in 20 MiB pages (large pool).
    # 12 -> map [0,20); 12 -> free 8 MiB + map [20,40); 12 -> from the 16 MiB left; 12 -> 4 MiB + map [40,60).
    # The four frees merge into one free 60 MiB block, in which the four 14 MiB requests fit.
    s = sim("expandable_segments:True")
    first = [s.malloc(12 * MiB) for _ in range(4)]
    assert (s.reserved_bytes, s.allocated_bytes) == (60 * MiB, 48 * MiB)
    for h in first:
        s.free(h)
    second = [s.malloc(14 * MiB) for _ in range(4)]
    assert second[0] == first[0]  # the segment start is reused
    assert (s.peak_reserved_bytes, s.peak_allocated_bytes, s.num_segments) == (60 * MiB, 56 * MiB, 1)
    for h in second:
        s.free(h)
    s.empty_cache()  # unmaps every page and drops the segment
    assert (s.reserved_bytes, s.num_segments) == (0, 0)


def test_expandable_small_pool_maps_two_mib_pages():
    s = sim("expandable_segments:True")
    s.malloc(1000)  # 1024 B in the small pool: one 2 MiB page
    assert s.reserved_bytes == 2 * MiB
    s.malloc(1536 * KiB)  # large pool (> 1 MiB): its own segment, one 20 MiB page
    assert (s.reserved_bytes, s.num_segments) == (22 * MiB, 2)


# --- OOM ------------------------------------------------------------------------------------------------


def test_oom_retry_after_freeing_cached_segments_succeeds():
    s = sim(capacity=64 * MiB)
    a, b = s.malloc(30 * MiB), s.malloc(30 * MiB)  # two 30 MiB segments, 4 MiB of the device left
    s.free(a)
    s.free(b)  # both cached: reserved stays 60 MiB
    s.malloc(40 * MiB)  # cudaMalloc(40) fails, release_cached_blocks frees 60 MiB, the retry succeeds
    assert (s.reserved_bytes, s.allocated_bytes, s.num_segments) == (40 * MiB, 40 * MiB, 1)
    assert s.num_alloc_retries == 1 and not s.oom


def test_oom_when_live_memory_leaves_no_room():
    s = sim(capacity=64 * MiB)
    s.malloc(30 * MiB)
    s.malloc(30 * MiB)
    with pytest.raises(SimulatedOOM) as info:
        s.malloc(10 * MiB)  # needs a 10 MiB segment, 4 MiB free, nothing cached to release
    assert str(info.value).startswith(
        "CUDA out of memory. Tried to allocate 10.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which "
        "4.00 MiB is free. Of the allocated memory 60.00 MiB is allocated by PyTorch, and 0 bytes is reserved "
        "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    assert isinstance(info.value, RuntimeError)
    assert s.oom and s.oom_message == str(info.value) and s.num_ooms == 1
    assert (s.reserved_bytes, s.allocated_bytes) == (60 * MiB, 60 * MiB)  # state intact after the OOM


def test_oom_reports_the_segment_size_not_the_request():
    # 2 MiB is a large-pool request: it needs a 20 MiB segment, which a 16 MiB device cannot give.
    s = sim(capacity=16 * MiB)
    with pytest.raises(SimulatedOOM, match=r"Tried to allocate 20\.00 MiB"):
        s.malloc(2 * MiB)


def test_reserved_elsewhere_reduces_what_the_allocator_gets():
    s = CachingAllocatorSim(64 * MiB, reserved_elsewhere=10 * MiB, process_overhead_bytes=10 * MiB)
    s.malloc(30 * MiB)
    with pytest.raises(SimulatedOOM, match="this process has 40.00 MiB memory in use") as info:
        s.malloc(30 * MiB)  # 64 - 10 - 30 = 24 MiB free
    assert "of which 24.00 MiB is free" in str(info.value)


# --- max_split_size_mb ----------------------------------------------------------------------------------


def test_max_split_size_keeps_oversize_blocks_whole():
    plain, limited = sim(), sim("max_split_size_mb:40")
    for s in (plain, limited):
        s.free(s.malloc(60 * MiB))  # one cached 60 MiB block
        s.malloc(30 * MiB)
    # Unlimited: 30 MiB is carved from the 60 MiB block (30 MiB would remain > 1 MiB).
    assert plain.reserved_bytes == 60 * MiB
    # max_split_size 40 MiB: a 60 MiB block is oversize and is not given to a smaller request.
    assert limited.reserved_bytes == 90 * MiB


def test_oversize_block_reuse_is_limited_by_max_non_split_rounding():
    s = sim("max_split_size_mb:40")
    s.free(s.malloc(60 * MiB))
    h = s.malloc(41 * MiB)  # 60 < 41 + 20: reused whole, not split (requests >= max_split_size never split)
    assert (s.allocated_bytes, s.reserved_bytes) == (60 * MiB, 60 * MiB)
    s.free(h)
    s.malloc(40 * MiB)  # 60 >= 40 + 20: too wasteful, a new 40 MiB segment
    assert (s.allocated_bytes, s.reserved_bytes) == (40 * MiB, 100 * MiB)
    t = sim("max_split_size_mb:40,max_non_split_rounding_mb:30")
    t.free(t.malloc(60 * MiB))
    t.malloc(40 * MiB)  # 60 < 40 + 30 now: reused
    assert t.reserved_bytes == 60 * MiB


def test_oom_releases_only_enough_oversize_blocks():
    s = sim("max_split_size_mb:40", capacity=128 * MiB)
    small = s.malloc(1000)  # a cached small segment (2 MiB) that must survive
    a, b = s.malloc(60 * MiB), s.malloc(50 * MiB)
    for h in (small, a, b):
        s.free(h)  # reserved 112 MiB, 16 MiB free on the device
    # 70 MiB fails; release_available_cached_blocks frees the largest oversize blocks (60 then 50 MiB)
    # until 70 MiB are released, then the first retry succeeds. The small segment stays cached.
    s.malloc(70 * MiB)
    assert (s.reserved_bytes, s.num_segments, s.num_alloc_retries) == (72 * MiB, 2, 0)


# --- roundup_power2_divisions ---------------------------------------------------------------------------


def test_roundup_power2_divisions_rounding():
    s = sim("roundup_power2_divisions:4")
    s.malloc(1200)  # 1200 <= 512 * 4: plain rounding to 1536 B
    assert s.allocated_bytes == 1536
    s.malloc(3 * MiB + 1)  # between 2 and 4 MiB, steps of 512 KiB: 3.5 MiB
    assert s.allocated_bytes == 1536 + 3 * MiB + 512 * KiB
    s.malloc(MiB + 1)  # between 1 and 2 MiB, steps of 256 KiB: 1.25 MiB
    assert s.allocated_bytes == 1536 + 3 * MiB + 512 * KiB + MiB + 256 * KiB


def test_roundup_power2_divisions_list_form():
    cfg = AllocatorConfig.from_env_string("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    # The example of PyTorch's own config test (c10/test/core/AllocatorConfig_test.cpp).
    cfg = AllocatorConfig.from_env_string("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    assert [cfg.divisions_for(n * MiB) for n in (32, 64, 128, 256, 512, 1024, 2048)] == [8, 8, 2, 4, 2, 4, 1]
    assert round_size(65 * MiB, cfg) == 72 * MiB  # 64-128 MiB in 8 steps of 8 MiB


# --- garbage_collection_threshold -----------------------------------------------------------------------


def test_garbage_collection_under_a_memory_fraction():
    # 100 MiB device, fraction 0.5: 50 MiB allowed, GC threshold 0.5 * 50 = 25 MiB.
    def run(config: str, fraction: float | None) -> CachingAllocatorSim:
        s = sim(config, capacity=100 * MiB, memory_fraction=fraction)
        a, b = s.malloc(12 * MiB), s.malloc(12 * MiB)  # get_free_block calls 1, 2
        s.free(a)
        s.free(b)  # cached at clock 2
        s.free(s.malloc(14 * MiB))  # 24 <= 25: no GC; new 14 MiB segment, cached at clock 3; reserved 38
        s.malloc(16 * MiB)  # clock 4: ages 2, 2, 1 (mean 1.67): the two 12 MiB blocks go first
        return s

    assert run("garbage_collection_threshold:0.5", 0.5).reserved_bytes == 14 * MiB + 16 * MiB
    # Without a fraction PyTorch never collects: 38 + 16 MiB.
    assert run("garbage_collection_threshold:0.5", None).reserved_bytes == 54 * MiB
    # Fraction without GC: 38 + 16 > 50 fails, everything cached is released, then 16 MiB.
    assert run("", 0.5).reserved_bytes == 16 * MiB
    # The fraction can also come from the configuration string (recent PyTorch).
    both = "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5"
    assert run(both, None).reserved_bytes == 30 * MiB


# --- configuration parsing ------------------------------------------------------------------------------


def test_config_parsing_accepts_pytorch_syntax():
    cfg = AllocatorConfig.from_env_string(
        " max_split_size_mb:128, expandable_segments:True ,garbage_collection_threshold:0.6,"
        "release_lock_on_cudamalloc:True,backend:native"
    )
    assert cfg.max_split_size == 128 * MiB
    assert cfg.expandable_segments is True
    assert cfg.garbage_collection_threshold == 0.6
    assert AllocatorConfig.from_env_string("") == AllocatorConfig()
    assert AllocatorConfig.from_env_string(cfg.to_env_string()) == cfg


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("max_split_size_mb:10", "too small"),
        ("max_split_size_mb:abc", "integer"),
        ("max_split_size_mb", "expected"),
        ("expandable_segments:true", "True/False"),
        ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
        ("garbage_collection_threshold:x", "number"),
        ("per_process_memory_fraction:1.5", "[0.0, 1.0]"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[100:2]", "power of 2"),
        ("roundup_power2_divisions:[64:3]", "power of 2"),
        ("roundup_power2_divisions:[64:2", "']'"),
        ("large_segment_size_mb:8", "must be > 10"),
        ("backend:cudaMallocAsync", "not modelled"),
        ("expandable_segments:True,", "trailing"),
        ("expandable_segments:True;max_split_size_mb:64", "True/False"),
        ("frobnicate:1", "Unrecognized key 'frobnicate'"),
    ],
)
def test_config_parsing_errors(text: str, needle: str):
    with pytest.raises(ValueError) as info:
        AllocatorConfig.from_env_string(text)
    assert needle in str(info.value)


# --- replay and snapshot --------------------------------------------------------------------------------


def test_replay_timeline_peaks_and_unmatched_frees():
    events = [
        ("alloc", 1, 12 * MiB, 0),  # reserved 12
        ("alloc", 2, 12 * MiB, 0),  # reserved 24
        ("free", 1, 0, 0),
        ("free", 2, 0, 0),
        ("alloc", 3, 14 * MiB, 0),  # reserved 38: the peak, first reached at event 4
        ("free", 99, 0, 0),  # a storage the capture never saw allocated
        ("free", 3, 0, 0),
        ("empty_cache", 0, 0, 0),
    ]
    r = replay(events, BIG)
    assert list(r.timeline_reserved) == [12 * MiB, 24 * MiB, 24 * MiB, 24 * MiB, 38 * MiB, 38 * MiB, 38 * MiB, 0]
    assert list(r.timeline_allocated)[:5] == [12 * MiB, 24 * MiB, 12 * MiB, 0, 14 * MiB]
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (38 * MiB, 24 * MiB)
    assert (r.peak_event_index, r.peak_allocated_event_index) == (4, 1)
    assert r.unmatched_frees == 1 and not r.oom and r.oom_message is None
    assert r.num_segments_at_end == 0
    allocated, reserved = r.timeline
    assert len(allocated) == len(reserved) == len(events) and r.snapshot is None


def test_replay_stops_at_the_oom():
    events = [("alloc", 1, 30 * MiB, 0), ("alloc", 2, 30 * MiB, 0), ("alloc", 3, 30 * MiB, 0), ("free", 1, 0, 0)]
    r = replay(events, 64 * MiB)
    assert r.oom and r.oom_event_index == 2 and len(r.timeline_reserved) == 2
    assert r.oom_message is not None and "Tried to allocate 30.00 MiB" in r.oom_message


def test_replay_many_reuses_the_roomiest_replay_where_it_fits():
    events = [("alloc", 1, 30 * MiB, 0), ("alloc", 2, 30 * MiB, 0), ("free", 1, 0, 0), ("free", 2, 0, 0),
              ("alloc", 3, 40 * MiB, 0)]
    # Peak reserved with room to spare: 30 + 30 + 40 = 100 MiB (the cached 30 MiB blocks cannot serve 40).
    targets = [(GiB, 0), (200 * MiB, 50 * MiB), (64 * MiB, 0), (32 * MiB, 0)]
    results = replay_many(events, targets)
    assert results[0] is results[1]  # 150 MiB of room >= 100 MiB peak: the same decisions
    assert results[0].peak_reserved_bytes == 100 * MiB
    assert results[2].peak_reserved_bytes == 60 * MiB and not results[2].oom  # free-and-retry at 64 MiB
    assert results[3].oom and results[3].oom_event_index == 1
    for (capacity, elsewhere), r in zip(targets, results):
        single = replay(events, capacity, reserved_elsewhere=elsewhere)
        assert (single.peak_reserved_bytes, single.oom) == (r.peak_reserved_bytes, r.oom)
        assert list(single.timeline_reserved) == list(r.timeline_reserved)


def test_snapshot_renders_with_torch_memory_viz():
    _memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    events = []
    for i in range(30):
        events.append(("alloc", i, (i % 7 + 1) * 700 * KiB + i, i % 2))
        if i % 3 == 0:
            events.append(("free", i - 1, 0, (i - 1) % 2))
    for config in ("", "expandable_segments:True", "max_split_size_mb:20"):
        r = replay(events, BIG, AllocatorConfig.from_env_string(config), keep_trace=True)
        snap = pickle.loads(pickle.dumps(r.snapshot))
        assert snap is not None
        summary = _memory_viz.segsum(snap)  # checks block sizes add up to every segment
        assert "total_reserved" in summary
        assert sum(seg["total_size"] for seg in snap["segments"]) == r.timeline_reserved[-1]
        actions = {e["action"] for e in snap["device_traces"][0]}
        assert {"alloc", "free_requested", "free_completed"} <= actions
        assert actions & {"segment_alloc", "segment_map"}
        assert _memory_viz.trace(snap)
        assert "<html>" in _memory_viz.segment_plot(snap)
        assert "<html>" in _memory_viz.trace_plot(snap)


# --- invariants -----------------------------------------------------------------------------------------

_sizes = st.one_of(
    st.integers(0, 4 * KiB),
    st.integers(4 * KiB, 2 * MiB),
    st.integers(2 * MiB, 12 * MiB),
    st.integers(12 * MiB, 80 * MiB),
)
_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free", "empty"]), _sizes, st.integers(0, 1), st.integers(0, 10**6)),
    max_size=60,
)
_configs = st.sampled_from(
    ["", "expandable_segments:True", "max_split_size_mb:24", "roundup_power2_divisions:4",
     "max_split_size_mb:32,roundup_power2_divisions:[2:2,>:8]"]
)


def _check(s: CachingAllocatorSim) -> None:
    assert 0 <= s.allocated_bytes <= s.reserved_bytes
    assert s.peak_allocated_bytes <= s.peak_reserved_bytes
    assert s.reserved_bytes + s.reserved_elsewhere <= s.capacity_bytes
    snap = s.snapshot()
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        addr = seg["address"]
        for b in seg["blocks"]:  # blocks tile the segment
            assert b["address"] == addr
            addr += b["size"]
    assert sum(seg["total_size"] for seg in snap["segments"]) == s.reserved_bytes
    assert sum(seg["allocated_size"] for seg in snap["segments"]) == s.allocated_bytes


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, config=_configs, capacity_mib=st.sampled_from([96, 256, 4096]))
def test_invariants_hold_for_any_sequence(ops, config, capacity_mib):
    s = sim(config, capacity=capacity_mib * MiB)
    live: list[int] = []
    for kind, size, stream, pick in ops:
        if kind == "alloc":
            try:
                h = s.malloc(size, stream)
            except SimulatedOOM:
                pass
            else:
                if h:
                    live.append(h)
        elif kind == "free" and live:
            s.free(live.pop(pick % len(live)))
        elif kind == "empty":
            s.empty_cache()
        _check(s)
    for h in live:
        s.free(h)
    assert s.allocated_bytes == 0
    s.empty_cache()
    assert (s.reserved_bytes, s.num_segments) == (0, 0)
