"""Estimates named by users are read safely by a privileged service, and cached ones are found."""

from __future__ import annotations

import json
import os

import pytest

from gpushare.atomic import write_json_atomic
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.estimate.directives import parse_directives
from gpushare.estimate.source import (EstimateUnavailable, find_estimate, peak_total_from_json,
                                           read_user_file, script_cache_key)

UID = os.geteuid()


def cfg_for(tmp_path):
    return parse_config({"submit": {"cache_dir": str(tmp_path / "cache")},
                         "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})


def test_estimator_json_picks_cluster_gpu(tmp_path):
    doc = {"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 5 * GiB},
                       {"gpu": "h100-80gb", "peak_total_bytes": 7 * GiB}]}
    assert peak_total_from_json(doc, ["a100-40gb"]) == (5 * GiB, "a100-40gb")
    assert peak_total_from_json(doc, ["v100-32gb"]) == (7 * GiB, "h100-80gb")  # unknown: the largest


@pytest.mark.parametrize("doc", [[], {}, {"targets": [{"gpu": "x"}]}, {"peak_total_bytes": -1},
                                 {"peak_total_bytes": True}, {"peak_total_bytes": 1 << 60}])
def test_bad_estimate_documents(doc):
    with pytest.raises(EstimateUnavailable):
        peak_total_from_json(doc, ["a100-40gb"])


def test_relative_estimate_path_uses_work_dir(tmp_path):
    (tmp_path / "est.json").write_text(json.dumps({"peak_total_bytes": 3 * GiB}))
    found = find_estimate(cfg_for(tmp_path), parse_directives("#GPUSHARE estimate=est.json"), "", str(tmp_path), UID,
                          ["a100-40gb"])
    assert found.total_bytes == 3 * GiB and found.source == "directive:estimate"


def test_file_of_another_user_refused(tmp_path):
    target = tmp_path / "est.json"
    target.write_text(json.dumps({"peak_total_bytes": 3 * GiB}))
    with pytest.raises(EstimateUnavailable, match="not usable"):
        read_user_file(str(target), None, UID + 1, 1 << 20)


def test_file_read_for_an_unknown_user_is_refused(tmp_path):
    """A request that names no user (uid -1) must not skip the owner check: the service reads as root."""
    target = tmp_path / "est.json"
    target.write_text(json.dumps({"peak_total_bytes": 3 * GiB}))
    with pytest.raises(EstimateUnavailable, match="not usable"):
        read_user_file(str(target), None, -1, 1 << 20)


def test_symlink_refused(tmp_path):
    os.symlink("/etc/passwd", tmp_path / "est.json")
    with pytest.raises(EstimateUnavailable, match="not usable"):
        read_user_file(str(tmp_path / "est.json"), None, UID, 1 << 20)


def test_fifo_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "est.json")
    with pytest.raises(EstimateUnavailable, match="not usable"):
        read_user_file(str(tmp_path / "est.json"), None, UID, 1 << 20)


def test_large_file_refused(tmp_path):
    (tmp_path / "est.json").write_bytes(b" " * 5000)
    with pytest.raises(EstimateUnavailable, match="not usable"):
        read_user_file(str(tmp_path / "est.json"), None, UID, 1024)


def test_cache_hit_by_script(tmp_path):
    cfg = cfg_for(tmp_path)
    script = "#!/bin/sh\npython train.py\n"
    write_json_atomic(tmp_path / "cache" / "by-script" / f"{script_cache_key(script, UID)}.json",
                      {"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 6 * GiB}]})
    found = find_estimate(cfg, parse_directives(script), script, None, UID, ["a100-40gb"])
    assert found.total_bytes == 6 * GiB and found.source == "cache"
    assert find_estimate(cfg, parse_directives(script + " "), script + " ", None, UID, ["a100-40gb"]) is None
