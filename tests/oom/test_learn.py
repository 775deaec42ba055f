"""The estimate cache learns from an OOM: raised, never lowered, capped at the GPU, read back by submit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpushare.epilog.learn import learn_from_oom
from gpushare.policy.oom_recovery import failed_size_bytes
from gpushare.estimate.cache import learned_document
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.slurm.gres_request import GresRequest
from gpushare.estimate.source import cache_lookup

SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\npython train.py --batch-size 64\n"


def test_failed_size_of_shards_and_mig_slices() -> None:
    cfg = parse_config({})
    assert failed_size_bytes(GresRequest.parse("gres:shard:12"), cfg) == 12 * GiB
    assert failed_size_bytes(GresRequest.parse("gres:gpu:3g.20gb:1"), cfg) == cfg.gpu("a100-40gb").mig_profile("3g.20gb").usable_bytes
    assert failed_size_bytes(GresRequest.parse("gres:gpu:1"), cfg) is None
    assert failed_size_bytes(GresRequest.parse("garbage:::"), cfg) is None


def test_document_is_raised_never_lowered_and_capped() -> None:
    old = {"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 3 * GiB},
                       {"gpu": "h100-80gb", "peak_total_bytes": 9 * GiB}], "peak_total_bytes": 2 * GiB}
    doc = learned_document(old, 4 * GiB, 40 * GiB, "17", now=1.0)
    assert [t["peak_total_bytes"] for t in doc["targets"]] == [6 * GiB, 9 * GiB]
    assert doc["peak_total_bytes"] == 6 * GiB and doc["learned"]["from_job"] == "17"
    assert learned_document(None, 40 * GiB, 40 * GiB, "1", 0.0)["peak_total_bytes"] == 40 * GiB
    assert learned_document({"targets": {"a100-40gb": {"peak_total_bytes": 1}}}, GiB, 0, "1", 0.0)[
        "targets"]["a100-40gb"]["peak_total_bytes"] == int(1.5 * GiB)


def test_the_submit_path_reads_the_lesson(tmp_path: Path) -> None:
    cfg = parse_config({"submit": {"cache_dir": str(tmp_path / "cache")}})
    assert cache_lookup(cfg, SCRIPT, ["a100-80gb"], 1000) is None
    path = learn_from_oom(cfg, SCRIPT, "5", GresRequest.parse("gres:shard:8"), 80 * GiB, 1000)
    assert path is not None and json.loads(path.read_text())["peak_total_bytes"] == 12 * GiB
    estimate = cache_lookup(cfg, SCRIPT, ["a100-80gb"], 1000)
    assert estimate is not None and estimate.total_bytes == 12 * GiB


def test_a_symlinked_cache_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "by-script").symlink_to(elsewhere)
    cfg = parse_config({"submit": {"cache_dir": str(tmp_path / "cache")}})
    with pytest.raises(PermissionError, match="not a directory owned by root"):
        learn_from_oom(cfg, SCRIPT, "5", GresRequest.parse("gres:shard:8"), 80 * GiB, 1000)
    assert list(elsewhere.iterdir()) == []


def test_one_users_oom_never_resizes_another_users_identical_script(tmp_path: Path) -> None:
    cfg = parse_config({"submit": {"cache_dir": str(tmp_path / "cache")}})
    learn_from_oom(cfg, SCRIPT, "5", GresRequest.parse("gres:shard:8"), 80 * GiB, 1000)
    assert cache_lookup(cfg, SCRIPT, ["a100-80gb"], 1000) is not None
    assert cache_lookup(cfg, SCRIPT, ["a100-80gb"], 1001) is None
    assert learn_from_oom(cfg, SCRIPT, "6", GresRequest.parse("gres:shard:8"), 80 * GiB, None) is None  # owner unknown: no lesson


def test_the_lesson_is_a_floor_under_the_scripts_own_directives(tmp_path: Path) -> None:
    from gpushare.estimate.directives import parse_directives
    from gpushare.estimate.source import find_estimate

    cfg = parse_config({"submit": {"cache_dir": str(tmp_path / "cache")}})
    small = SCRIPT.replace("#SBATCH --gres=gpu:1\n", "#SBATCH --gres=gpu:1\n#GPUSHARE mem=4G\n")
    before = find_estimate(cfg, parse_directives(small), small, None, 1000, ["a100-80gb"])
    assert before is not None and (before.source, before.total_bytes) == ("directive:mem", 4 * GiB)
    learn_from_oom(cfg, small, "5", GresRequest.parse("gres:shard:5"), 80 * GiB, 1000)  # 4 GiB + margin was not enough
    after = find_estimate(cfg, parse_directives(small), small, None, 1000, ["a100-80gb"])
    assert after is not None and after.source == "learned" and after.total_bytes == int(7.5 * GiB)
    assert "job 5" in after.detail and "directive:mem said 4.0 GiB" in after.detail
    big = small.replace("mem=4G", "mem=20G")  # a directive above the lesson (another script: no lesson) wins
    learn_from_oom(cfg, big, "6", GresRequest.parse("gres:shard:5"), 80 * GiB, 1000)
    assert find_estimate(cfg, parse_directives(big), big, None, 1000, ["a100-80gb"]).source == "directive:mem"
    assert find_estimate(cfg, parse_directives(small), small, None, 1001, ["a100-80gb"]).source == "directive:mem"


@pytest.mark.hostile
def test_the_lesson_survives_a_cosmetic_edit_of_the_batch_script(tmp_path: Path) -> None:
    """Issue 22: one added comment line dropped the learned floor. The lesson is also keyed on the training
    command as found (its working directory, script and arguments), so an edit elsewhere keeps it; other
    arguments, another directory or another user do not inherit it."""
    from gpushare.estimate.directives import parse_directives
    from gpushare.estimate.source import find_estimate

    cfg = parse_config({"submit": {"cache_dir": str(tmp_path / "cache")}})
    learn_from_oom(cfg, SCRIPT, "5", GresRequest.parse("gres:shard:8"), 80 * GiB, 1000, work_dir="/home/u/proj")

    def found(script: str, work_dir: str = "/home/u/proj", uid: int = 1000):  # type: ignore[no-untyped-def]
        return find_estimate(cfg, parse_directives(script), script, work_dir, uid, ["a100-80gb"])

    edited = SCRIPT.replace("#!/bin/bash\n", "#!/bin/bash\n# run 2: same model, new comment\nmodule load cuda\n")
    lesson = found(edited)
    assert lesson is not None and lesson.source == "learned" and lesson.total_bytes == 12 * GiB
    assert found(edited.replace("--batch-size 64", "--batch-size 8")) is None
    assert found(edited, "/home/u/other") is None and found(edited, uid=1001) is None
