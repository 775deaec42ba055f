"""Other papers' published gains (``simulator/data/published_gains.json``): the shipped file and its format.

Why: docs/simulator.md and docs/benchmarks.md quote these numbers beside the simulator's; each must keep its
source, and a bad record must stop the read with one line naming the file, the line and the column.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpushare.simulator import published
from gpushare.simulator.cli import data_dir

HEAD = '{\n "source": "test",\n "targets": [\n'
GOOD = ('  {"paper": "P", "venue": "V 2025", "where": "section 7.2", "system": "S", "baseline": "B", '
        '"setting": "32 GPUs", "metric": "mean JCT", "value": 1.28, "unit": "ratio"}')


def _write(tmp_path: Path, *records: str) -> Path:
    path = tmp_path / "gains.json"
    path.write_text(HEAD + ",\n".join(records) + "\n ]\n}\n")
    return path


def test_shipped_gains_carry_their_source():
    records = published.load(data_dir(None) / published.NAME)
    assert all(r.paper and r.venue and r.where for r in records)
    by = {(r.system, r.baseline, r.metric, r.setting.split(",")[0]): r.value for r in records}
    assert by[("Lucid + Gimbal", "Lucid", "mean JCT", "150 jobs of the Philly trace")] == 1.28
    assert by[("Gavel + Gimbal", "Gavel", "makespan", "150 jobs of the Philly trace")] == 1.12
    assert by[("FGD", "existing packing-based schedulers", "unallocated GPUs",
               "Alibaba production traces on an emulated cluster of more than 6")] == -49
    assert {r.venue.split(",")[0] for r in records} == {"ACM TACO 2025", "USENIX ATC 2023"}


def test_a_good_file_reads_record_by_record(tmp_path):
    records = published.load(_write(tmp_path, GOOD, GOOD.replace("1.28", "-12").replace('"ratio"', '"pct"')))
    assert [(r.value, r.unit) for r in records] == [(1.28, "ratio"), (-12.0, "pct")]


@pytest.mark.parametrize("record, where, what", [
    (GOOD.replace("1.28", '"fast"'), (5, GOOD.index('"value"') + 1), "field 'value' must be a number, got 'fast'"),
    (GOOD.replace('"ratio"', '"x"'), (5, GOOD.index('"unit"') + 1), "field 'unit' must be one of ratio, pct, GPUs"),
    (GOOD.replace('"where": "section 7.2", ', ""), (5, 3), "field 'where' is missing"),
    (GOOD.replace('"venue": "V 2025"', '"venue": ""'), (5, GOOD.index('"venue"') + 1), "field 'venue' must be non-empty"),
    (GOOD.replace("1.28", "0"), (5, GOOD.index('"value"') + 1), "a ratio must be above 0"),
    (GOOD.replace('"unit"', '"units"'), (5, GOOD.index('"unit"') + 1), "unknown field 'units'"),
])
def test_a_bad_record_is_one_line_naming_file_line_and_column(tmp_path, record, where, what):
    path = _write(tmp_path, GOOD, record)
    with pytest.raises(published.PublishedError) as err:
        published.load(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{where[0]}:{where[1]}: ") and what in message, message


def test_not_json_and_records_sharing_a_line_are_named_too(tmp_path):
    path = tmp_path / "gains.json"
    path.write_text(HEAD + GOOD + ",\n" + GOOD[:40] + "\n ]\n}\n")
    with pytest.raises(published.PublishedError, match=rf"^{path}:5:\d+: not JSON: "):
        published.load(path)
    path.write_text(json.dumps({"targets": [json.loads(GOOD), json.loads(GOOD)]}))
    with pytest.raises(published.PublishedError, match=rf"^{path}:1:1: each record must sit on a line of its own"):
        published.load(path)
    with pytest.raises(published.PublishedError, match="cannot read"):
        published.load(tmp_path / "missing.json")
