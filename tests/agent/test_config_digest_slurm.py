"""The controller's configuration digest travels in the job's record; a node whose gpushare.toml differs says
so in its Prolog log, on every job, with no other host asked (docs/configuration.md, "Identity")."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import pytest

from gpushare.prolog.slurmd_prolog import compare_config
from gpushare.slurm.record import parse, render

SIMJOB = Path(__file__).with_name("simjob.py")


def test_compare_config_reads_the_record(caplog) -> None:
    comment = render({"decision": "shared", "cfg": "0123456789ab"})
    with caplog.at_level(logging.ERROR, logger="gpushare.prolog"):
        assert compare_config("7", comment, "/etc/slurm/gpushare.toml", "0123456789ab" + "f" * 52)
        assert compare_config("7", render({"decision": "shared"}), "/x", "none")  # older record: nothing to say
        assert compare_config("7", "not ours", "/x", "none")
        assert not compare_config("7", comment, "/etc/slurm/gpushare.toml", "fedcba987654" + "0" * 52)
    [line] = [r.getMessage() for r in caplog.records]
    assert "job 7: this node's gpushare.toml (/etc/slurm/gpushare.toml, sha256 fedcba987654)" in line
    assert "controller's (sha256 0123456789ab" in line and "gpushare doctor" in line


@pytest.mark.slurm
def test_a_node_with_another_file_is_named_in_its_prolog_log(agent_cluster, tmp_path) -> None:
    cluster = agent_cluster(withhold="none")
    os.chmod(tmp_path, 0o755)
    script = f"#!/bin/sh\n#GPUSHARE mem=2G\n'{sys.executable}' '{SIMJOB}' --seconds 0.2\n"
    export = f"--export=ALL,GPUSHARE_CONFIG={cluster.gpushare_conf}"
    controller = hashlib.sha256(cluster.gpushare_conf.read_bytes()).hexdigest()[:12]

    first, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "%j.out"), export, "--gres=gpu:1",
                                     script=script)
    assert cluster.wait_job(first, 60).state == "COMPLETED"
    assert (parse(cluster.client.job(first).admin_comment) or {}).get("cfg") == controller
    log = cluster.base / "log" / "agent.log"
    assert "is not the controller's" not in log.read_text()

    # the node's copy changes (a comment is enough); gpushare-submitd keeps the file it started with
    with open(cluster.gpushare_conf, "a") as handle:
        handle.write("# edited on the node only\n")
    node = hashlib.sha256(cluster.gpushare_conf.read_bytes()).hexdigest()[:12]
    second, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "%j.out"), export, "--gres=gpu:1",
                                      script=script)
    assert cluster.wait_job(second, 60).state == "COMPLETED"  # the job proceeds
    cluster.wait_for(lambda: f"job {second}: this node's gpushare.toml" in log.read_text(), 10, "no Prolog line")
    line = next(x for x in log.read_text().splitlines() if f"job {second}: this node's gpushare.toml" in x)
    assert "ERROR" in line and f"sha256 {node}" in line and f"controller's (sha256 {controller}" in line
