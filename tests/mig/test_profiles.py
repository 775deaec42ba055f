"""Tightest-fit sizing from a memory estimate, OOM retry sizes, and layout text."""

from __future__ import annotations

import pytest

from gpushare.gpus import BUILTIN_GPUS, GiB
from gpushare.policy.fsm import fsm_table
from gpushare.policy.layout import Instance, format_layout, parse_layout
from gpushare.policy.profiles import (needed_bytes, next_larger_profile, select_profiles,
                                  tightest_profile)

A100 = BUILTIN_GPUS["a100-40gb"]


@pytest.mark.parametrize("estimate_gib,expected", [
    (0.5, "1g.5gb"),      # 0.5 + 1 GiB floor margin
    (3.7, "1g.5gb"),      # 3.7 + 1.0 = 4.70 <= 4.75
    (3.8, "2g.10gb"),     # 4.80 > 4.75
    (8.6, "2g.10gb"),     # 8.6 + 0.86 = 9.46 <= 9.62
    (9.0, "3g.20gb"),     # 9.9 > 9.62; 3g before 4g (same memory, fewer SMs)
    (17.7, "3g.20gb"),
    (18.0, "7g.40gb"),
    (35.6, "7g.40gb"),
    (36.0, None),         # 39.6 > 39.25: needs a whole card without MIG
])
def test_tightest_profile_with_default_margin(estimate_gib: float, expected: str | None) -> None:
    got = tightest_profile(A100, int(estimate_gib * GiB))
    assert (got.name if got else None) == expected


def test_margin_parameters_and_extra_profiles() -> None:
    assert needed_bytes(10 * GiB) == 11 * GiB
    assert needed_bytes(2 * GiB) == 3 * GiB  # the floor wins for small jobs
    assert tightest_profile(A100, int(4.7 * GiB), margin_fraction=0, margin_min_bytes=0).name == "1g.5gb"
    # with the double-memory 1g in the set, a 9 GiB need takes it instead of a 2g (same memory, 1 slice)
    extra = select_profiles(A100, extra_memory=True)
    assert tightest_profile(A100, 8 * GiB, profiles=extra).name == "1g.10gb"
    assert tightest_profile(BUILTIN_GPUS["h200-141gb"], 30 * GiB).name == "3g.71gb"
    assert tightest_profile(BUILTIN_GPUS["a30-24gb"], 5 * GiB).name == "2g.12gb"
    with pytest.raises(ValueError):
        needed_bytes(-1)


def test_next_larger_profile_for_oom_retry() -> None:
    chain = ["1g.5gb"]
    while (bigger := next_larger_profile(A100, chain[-1])) is not None:
        chain.append(bigger.name)
    assert chain == ["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]  # 4g.20gb has no more memory than 3g
    assert next_larger_profile(A100, "4g.20gb").name == "7g.40gb"
    assert next_larger_profile(BUILTIN_GPUS["h100-80gb"], "1g.10gb").name == "2g.20gb"
    with pytest.raises(KeyError):
        next_larger_profile(A100, "5g.30gb")


def test_layout_round_trip_and_busy_marks() -> None:
    space = fsm_table(A100, select_profiles(A100)).space
    parsed = parse_layout(" 3g.20gb@0* , 2g.10gb@4,1G.5GB@6", space)
    assert parsed == (Instance("3g.20gb", 0, True), Instance("2g.10gb", 4), Instance("1g.5gb", 6))
    assert format_layout(parsed) == "3g.20gb@0*,2g.10gb@4,1g.5gb@6"
    assert parse_layout("empty", space) == () and format_layout(()) == "empty"


@pytest.mark.parametrize("text,message", [
    ("3g.20gb", "expected PROFILE@START"),
    ("3g.20gb@", "is not a slice number"),
    ("3g.20gb@x", "is not a slice number"),
    ("3g.20gb@2", "cannot start at slice 2 (legal starts: 0, 4)"),
    ("5g.25gb@0", "unknown profile '5g.25gb' for a100-40gb (known: 1g.5gb"),
    ("3g.20gb@0,2g.10gb@2", "3g.20gb@0 and 2g.10gb@2 both use memory slice 2"),
    ("7g.40gb@0,,", "expected PROFILE@START"),
])
def test_layout_errors_name_the_item(text: str, message: str) -> None:
    space = fsm_table(A100, select_profiles(A100)).space
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        parse_layout(text, space)
    assert "\n" not in str(info.value)
