"""#GPUSHARE directive parsing: sizes, keys, and line-numbered problems."""

from __future__ import annotations

import pytest

from gpushare.gpus import GiB, MiB
from gpushare.estimate.directives import parse_directives
from gpushare.slurm.gres_request import GresItem, format_gres, parse_gres


@pytest.mark.parametrize("text, size", [
    ("12G", 12 * GiB), ("12GiB", 12 * GiB), ("12gb", 12 * GiB), ("12", 12 * GiB),
    ("800M", 800 * MiB), ("1.5G", int(1.5 * GiB)), ("0.5T", 512 * GiB),
])
def test_sizes(text, size):
    assert parse_directives(f"#!/bin/sh\n#GPUSHARE mem={text}\n").mem_bytes == size


def test_keys_and_trailing_comment():
    found = parse_directives("# gpushare estimate=est.json script=train.py # why not\n#GPUSHARE mode=shared")
    assert (found.estimate_path, found.script, found.mode, found.problems) == ("est.json", "train.py", "shared", [])


@pytest.mark.parametrize("line, needle", [
    ("#GPUSHARE", "empty directive"),
    ("#GPUSHARE mem", "expected key=value"),
    ("#GPUSHARE colour=blue", "unknown key"),
    ("#GPUSHARE mem=0", "not a plausible"),
    ("#GPUSHARE mem=99999T", "not a plausible"),
    ("#GPUSHARE mem=12Q", "not a size"),
    ("#GPUSHARE mode=sometimes", "expected exclusive or shared"),
])
def test_problems_name_the_line(line, needle):
    found = parse_directives(f"#!/bin/sh\n\n{line}\n")
    assert found.problems and found.problems[0][0] == 3 and needle in found.problems[0][1]
    assert found.first_problem.startswith("#GPUSHARE on line 3")


def test_scan_limited_to_max_bytes():
    script = "#!/bin/sh\n" + "x" * 100 + "\n#GPUSHARE mem=4G\n"
    assert parse_directives(script, max_bytes=50).mem_bytes is None


@pytest.mark.parametrize("text, items", [
    ("gres:gpu:1", [GresItem("gpu", None, 1)]),
    ("gres:gpu:a100:2", [GresItem("gpu", "a100", 2)]),
    ("gres/gpu:1", [GresItem("gpu", None, 1, "gres/")]),
    ("gres:shard:14,gres:license:2", [GresItem("shard", None, 14), GresItem("license", None, 2)]),
    ("gres:gpu", [GresItem("gpu", None, 1)]),
    ("gres:gpu:3g.20gb:1", [GresItem("gpu", "3g.20gb", 1)]),
])
def test_gres_round_trip(text, items):
    assert parse_gres(text) == items
    assert parse_gres(format_gres(items)) == items


@pytest.mark.parametrize("bad", ["gres:gpu:1:2:3", "gres:gpu;rm -rf /", "gres: gpu : 1 x"])
def test_gres_garbage_rejected(bad):
    with pytest.raises(ValueError):
        parse_gres(bad)
