"""``gpushare mig layouts`` and ``gpushare mig plan``: output, JSON, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpushare.cli import group, main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(group, ["mig", *args])
    return result.exit_code, result.stdout, result.stderr


def test_layouts_text_lists_19_for_a100() -> None:
    code, out, _ = run("layouts", "--gpu", "a100-40gb")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("a100-40gb: 19 maximal layouts, 297 non-empty placement sets")
    assert len(lines) == 20
    assert lines[1].split() == ["1", "77777777", "7g.40gb@0"]
    assert lines[-1].split()[-1] == ",".join(f"1g.5gb@{s}" for s in range(7))


@pytest.mark.parametrize("args,count,sets", [
    (("--gpu", "h100-80gb"), 19, 297),
    (("--gpu", "a30-24gb"), 5, 25),
    (("--gpu", "a100-80gb", "--profiles", "1g.10gb,1g.20gb,2g.20gb,3g.40gb,4g.40gb,7g.80gb"), 78, 722),
])
def test_layouts_json_counts(args: tuple, count: int, sets: int) -> None:
    code, out, _ = run("layouts", *args, "--json")
    data = json.loads(out)
    assert code == 0 and len(data["maximal_layouts"]) == count and data["placement_sets"] == sets
    first = data["maximal_layouts"][0]
    assert set(first) == {"layout", "instances", "compute_slices", "free_memory_slices"}


def test_layouts_all_profiles() -> None:
    code, out, _ = run("layouts", "--gpu", "a100-40gb", "--all-profiles", "--json")
    data = json.loads(out)
    assert "1g.5gb+me" in data["profiles"] and len(data["maximal_layouts"]) > 78


def test_plan_text_shows_actions_and_reasons() -> None:
    code, out, _ = run("plan", "--gpu", "a100-40gb", "--current", "7g.40gb@0",
                       "--want", "3g.20gb,2g.10gb", "--want", "1g.5gb", "--want", "1g.5gb")
    assert code == 0
    assert "1. destroy 7g.40gb@0" in out and "fission" in out
    assert out.count("create") >= 4
    assert "maximal layouts reachable" in out


def test_plan_json_and_busy_flag() -> None:
    code, out, _ = run("plan", "--gpu", "a100-40gb", "--current", "3g.20gb@0,1g.5gb@4,1g.5gb@5",
                       "--busy", "3g.20gb@0", "--want", "2g.10gb", "--json")
    data = json.loads(out)
    assert code == 0
    assert [(a["action"], a["profile"], a["start"]) for a in data["actions"]] == [
        ("destroy", "1g.5gb", 4), ("destroy", "1g.5gb", 5), ("create", "2g.10gb", 4)]
    assert data["current"] == "3g.20gb@0*,1g.5gb@4,1g.5gb@5"
    assert data["unmet"] == [] and data["assignments"] == [{"profile": "2g.10gb", "start": 4}]


def test_plan_unmet_exits_1_with_a_reason() -> None:
    code, out, err = run("plan", "--gpu", "a100-40gb", "--current", "7g.40gb@0*", "--want", "1g.5gb")
    assert code == 1
    assert "blocked by busy 7g.40gb@0" in out
    assert "cannot serve 1g.5gb without touching a busy instance" in err


@pytest.mark.parametrize("args,message", [
    (("--gpu", "a100-40gb", "--current", "3g.20gb@1", "--want", "1g.5gb"),
     "3g.20gb cannot start at slice 1 (legal starts: 0, 4)"),
    (("--gpu", "a100-40gb", "--current", "4g.20gb@0,3g.20gb@0", "--want", "1g.5gb"),
     "both use memory slice 0"),
    (("--gpu", "a100-40gb", "--want", "1g.6gb"), "has no MIG profile '1g.6gb'"),
    (("--gpu", "v100-32gb", "--want", "1g.5gb"), "v100-32gb does not support MIG"),
    (("--gpu", "b300", "--want", "1g.5gb"), "unknown GPU 'b300'"),
    (("--gpu", "a100-40gb", "--current", "7g.40gb@0", "--busy", "1g.5gb@0", "--want", "1g.5gb"),
     "'1g.5gb@0' is not an instance of --current (7g.40gb@0)"),
])
def test_plan_errors_are_one_line_usage_errors(args: tuple, message: str) -> None:
    code, _, err = run("plan", *args)
    assert code == 2
    error_lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and message in error_lines[0]


def test_layouts_rejects_conflicting_profile_options() -> None:
    code, _, err = run("layouts", "--gpu", "a100-40gb", "--all-profiles", "--profiles", "1g.5gb")
    assert code == 2 and "not both" in err


def test_entry_point_main_returns_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mig", "layouts", "--gpu", "a30-24gb"]) == 0
    assert "5 maximal layouts" in capsys.readouterr().out
    assert main(["mig", "plan", "--gpu", "a100-40gb", "--current", "7g.40gb@0*", "--want", "2g.10gb"]) == 1


def test_slurm_config_warns_of_mig_with_shards_on_22_05() -> None:
    """Slurm 22.05 starts MIG jobs without their device while GresTypes names shard (docs/mig.md)."""
    from gpushare.config import parse_config
    from gpushare.slurm.version import SlurmVersion
    from gpushare.slurm_plugins.slurm_config import render_slurm_conf

    cfg = parse_config({"nodes": [{"names": "g1", "gpu": "a100-40gb"}, {"names": "m1", "gpu": "a100-40gb", "mig": True,
                                                                        "partition": "mig"}]})
    old = render_slurm_conf(cfg, "/opt/gpushare/bin", SlurmVersion(22, 5))
    assert "# WARNING: on Slurm 22.05" in old and "empty CUDA_VISIBLE_DEVICES" in old
    assert "WARNING" not in render_slurm_conf(cfg, "/opt/gpushare/bin", SlurmVersion(24, 11))
    plain = parse_config({"nodes": [{"names": "g1", "gpu": "a100-40gb"}]})
    assert "WARNING" not in render_slurm_conf(plain, "/opt/gpushare/bin", SlurmVersion(22, 5))
