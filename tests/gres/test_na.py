"""NA: the value an unsupported metric reads as (docs/style.md #1)."""

from __future__ import annotations

import json
import math
import pickle

from gpushare.gres.na import NA, is_na, or_default


def test_behaves_like_nan_in_arithmetic():
    for value in (NA + 1, 1 + NA, NA - 2, 2 - NA, NA * 3, 3 * NA, NA / 1024, 1024 / NA, NA // 2, -NA, abs(NA)):
        assert value is NA
    assert math.isnan(NA) and math.isnan(float(NA))
    assert sum([1.0, NA]) is NA


def test_prints_as_na():
    assert str(NA) == "N/A" and repr(NA) == "NA"
    assert f"{NA}" == "N/A" and f"{NA:>6}" == "   N/A" and f"{NA:.2f}" == "N/A" and f"{NA:<5}|" == "N/A  |"


def test_comparisons_and_truth():
    assert not NA and NA == NA and NA != 0.0
    assert not (NA > 0) and not (NA < 0)
    assert len({NA, NA}) == 1


def test_singleton_survives_pickle_and_is_a_float():
    assert pickle.loads(pickle.dumps(NA)) is NA
    assert isinstance(NA, float)
    assert json.dumps(or_default(NA, None)) == "null"


def test_is_na_and_or_default():
    assert is_na(NA) and is_na(None) and is_na(float("nan")) and not is_na(0)
    assert or_default(NA, 0) == 0 and or_default(5, 0) == 5
