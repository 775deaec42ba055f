"""``gpu-estimate --annotate`` (estimate attached to a copy of the batch script) and ``gpushare estimates``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from gpushare.estimator_cli.annotate import AnnotateError, annotate_script, split_args, submit
from gpushare.estimate.schema import inline_value
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.slurm_plugins.decision import SubmitRequest, decide
from gpushare.estimate.directives import parse_directives
from gpushare.estimate.source import find_estimate
from gpushare.slurm_plugins.estimates_cli import collect, render
from gpushare.slurm.jobs import job_from_json

DOC = {"schema_version": 1, "cached": False,
       "targets": [{"gpu": "a100-40gb", "peak_total_bytes": int(2.5 * GiB)}]}
BATCH = "#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH -t 10\npython train.py --bs 8\n"


def test_split_args_after_the_last_double_dash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sbatch").write_text(BATCH)
    sub = split_args(("--bs", "8", "--", "-p", "gpu", "train.sbatch", "extra"), None)
    assert sub.script_args == ["--bs", "8"] and sub.sbatch_argv == ["-p", "gpu", "train.sbatch", "extra"]
    assert sub.batch_index == 2
    assert split_args(("--bs", "8"), "train.sbatch").sbatch_argv == ["train.sbatch"]
    with pytest.raises(AnnotateError, match="needs the batch script"):
        split_args(("--bs", "8"), None)
    with pytest.raises(AnnotateError, match="no batch script"):
        split_args(("--", "missing.sbatch"), None)


def test_directive_goes_after_the_shebang_and_existing_estimates_are_refused(tmp_path):
    text = annotate_script(BATCH, DOC, tmp_path / "e.json")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash" and lines[1].startswith("#GPUSHARE est=a100-40gb/2560M  # gpu-estimate")
    assert lines[2:] == BATCH.splitlines()[1:]
    for existing in ("#GPUSHARE mem=4G", "#GPUSHARE est=a100-40gb/4G", "#GPUSHARE estimate=e.json"):
        with pytest.raises(AnnotateError, match="line 2"):
            annotate_script(f"#!/bin/sh\n{existing}\npython t.py\n", DOC, tmp_path / "e.json")


def test_inline_estimate_round_trips_with_its_split_and_rounds_up():
    rows = [{"gpu": "a100-40gb", "peak_total_bytes": int(2.5 * GiB) + 1, "persistent_bytes": GiB,
             "ephemeral_bytes": int(1.5 * GiB) + 1}, {"gpu": "a100-40gb:3g.20gb", "peak_total_bytes": 3 * GiB}]
    value = inline_value(rows)
    assert value == "a100-40gb/2561M/1024M/1537M,a100-40gb:3g.20gb/3072M"
    parsed = parse_directives(f"#GPUSHARE est={value}\n").inline
    assert parsed is not None and [r["gpu"] for r in parsed] == ["a100-40gb", "a100-40gb:3g.20gb"]
    assert parsed[0]["peak_total_bytes"] >= rows[0]["peak_total_bytes"] and parsed[0]["persistent_bytes"] == GiB


@pytest.mark.parametrize("value,problem", [
    ("a100-40gb", "expected GPU/TOTAL"), ("a100-40gb/1G/2G", "expected GPU/TOTAL"), ("A B/1G", "expected"),
    ("a100-40gb/0", "not a plausible estimate"), ("a100-40gb/99999T", "plausible"), ("a100-40gb/x", "size"),
    (",".join(["a100-40gb/1G"] * 40), "more than 32"),
])
def test_a_malformed_inline_estimate_is_a_problem_on_its_line(value, problem):
    found = parse_directives(f"#!/bin/sh\n#GPUSHARE est={value}\n")
    assert found.inline is None and found.first_problem is not None
    assert found.first_problem.startswith("#GPUSHARE on line 2: est:") and problem in found.first_problem


def test_submit_writes_estimate_and_copy_that_the_hook_accepts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sbatch").write_text(BATCH)
    seen = []

    def fake_run(argv, **kwargs):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "Submitted batch job 7\n", "sbatch: gpushare: shard:4\n")

    code = submit(DOC, split_args(("--", "--hold", "train.sbatch"), None), run=fake_run)
    assert code == 0 and "Submitted batch job 7" in capsys.readouterr().out
    copy = tmp_path / ".gpushare" / "train.sbatch"
    assert seen == [["sbatch", "--hold", str(copy)]]
    script = copy.read_text()
    cfg = parse_config({"nodes": [{"names": "n1", "gpu": "a100-40gb"}], "policy": {"max_jobs_per_gpu": 0}})
    directives = parse_directives(script)
    (tmp_path / ".gpushare" / "train.sbatch.estimate.json").unlink()  # a controller that cannot read it
    estimate = find_estimate(cfg, directives, script, "/nonexistent", os.getuid(), ["a100-40gb"])
    assert estimate.source == "directive:est" and estimate.total_bytes == int(2.5 * GiB)
    decision = decide(SubmitRequest(user_id=1000, tres_per_node="gres:gpu:1", script=script), directives,
                      estimate, cfg)
    assert decision.tres_per_node == "gres:shard:4"


def test_sbatch_failure_is_passed_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.sbatch").write_text(BATCH)
    fail = lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "sbatch: error: invalid partition\n")  # noqa: E731
    assert submit(DOC, split_args((), "t.sbatch"), run=fail) == 1


SQUEUE = [
    {"job_id": 5, "name": "train", "user_name": "ana", "job_state": "PENDING", "submit_time": 1000,
     "admin_comment": 'gpushare:{"v":1,"decision":"estimating","est_job":6,"script":"train.py (python, line 3)"}'},
    {"job_id": 6, "name": "gpushare-estimate-5", "user_name": "ana", "job_state": "RUNNING", "submit_time": 1001},
    {"job_id": 3, "name": "old", "user_name": "bo", "job_state": "COMPLETED", "submit_time": 900,
     "admin_comment": 'gpushare:{"v":1,"decision":"shared","est_job":4,"new":"gres:shard:4","held_s":9.5,'
                      '"why":"fits 4 of 40 GiB","src":"async"}'},
    {"job_id": 8, "name": "plain", "user_name": "ana", "job_state": "PENDING", "submit_time": 1000,
     "admin_comment": 'gpushare:{"v":1,"decision":"shared","src":"directive:mem"}'},
]


def test_estimates_listing_shows_waiting_then_released_jobs():
    rows = collect([job_from_json(j) for j in SQUEUE], 1030.0)
    assert [(r["job"], r["phase"], r["est_state"]) for r in rows] == [(5, "estimating", "RUNNING"),
                                                                      (3, "released", None)]
    assert rows[0]["held_s"] == 30.0 and rows[1]["result"] == "gres:shard:4"
    assert [r["job"] for r in collect([job_from_json(j) for j in SQUEUE], 1030.0, user="bo")] == [3]
    text = render(rows)
    assert "estimating" in text and "gres:shard:4 (shared: fits 4 of 40 GiB)" in text
    assert "no jobs" in render([])
    json.dumps(rows)
