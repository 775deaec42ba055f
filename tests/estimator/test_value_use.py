"""Where a value read goes, from the script's source (estimator_cli/value_use.py): bounded uses get a value,
anything that may decide memory does not. A probe object stands for a GPU tensor: its ``__int__`` /
``__index__`` / ``__bool__`` ask ``value_use`` about the frame that converts it, as the presenter does."""

from __future__ import annotations

import sys
from typing import Any

from gpushare.estimator_cli.value_use import Use, condition_of_read, use_of_read

seen: list[Use] = []


class Probe:
    def __int__(self) -> int:
        use = use_of_read(sys._getframe(1))
        seen.append(use)
        return use.value if use.bounded else -1

    __index__ = __int__

    def __bool__(self) -> bool:
        seen.append(condition_of_read(sys._getframe(1)))
        return False


def last() -> Use:
    return seen[-1]


def test_an_index_into_a_list_that_is_only_printed_is_bounded(capsys):
    names = ["cat", "dog"]
    first = int(Probe())
    print(f"first: {names[first]}")
    assert last().bounded and last().uses == {"index", "output"} and last().value == 0
    assert last().where == f"test_value_use.py:{sys._getframe().f_lineno - 3}"


def test_a_for_loop_bound_gets_one_pass():
    total = 0
    for rank in range(int(Probe())):
        print("rank", rank)
    assert last().bounded and last().uses == {"loop bound"} and last().value == 1
    assert total == 0


def test_a_tensor_used_directly_as_an_index_is_followed():
    names = ["cat", "dog"]
    print(names[Probe()])  # type: ignore[index]
    assert last().bounded and "index" in last().uses


def test_uses_that_may_decide_memory_are_not_bounded():
    sizes = [8, 4096]
    width = int(Probe()) + 1
    make(width)  # a function of the script's: might allocate `width` of anything
    assert not last().bounded
    make(sizes[int(Probe())])  # the element picked is a size
    assert not last().bounded
    kept = range(int(Probe()))  # a range kept, not looped over
    assert not last().bounded and kept is not None
    for k in range(int(Probe())):  # the loop variable becomes a size
        make(k)
    assert not last().bounded


def test_a_condition_between_host_only_branches_is_bounded():
    best = 0.0
    if Probe():
        best = 1.0
        print("new best", best)
    assert last().bounded and last().uses == {"condition"}
    if Probe() or best > 5:
        torch_save_like = {"best": best}
        print(torch_save_like)
    assert last().bounded
    if Probe():
        make(3)  # a branch into other code
    assert not last().bounded
    if Probe():
        best = best * 2  # arithmetic: on a tensor, a GPU operation
    assert not last().bounded
    flag = bool(Probe())  # kept, not branched on
    assert not last().bounded and flag is False


def make(n: Any) -> None:
    """Stands for any call the analysis cannot see into."""
