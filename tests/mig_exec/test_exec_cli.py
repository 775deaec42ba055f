"""``gpushare mig apply|reconcile``: argument errors through click (exit 2), run errors exit 3."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from gpushare.gres.sim_backend import SimBackend
from gpushare.mig_manager.mig_cli import command


def config(tmp_path: Path) -> Path:
    state = tmp_path / "gpus.json"
    SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "mig_mode": True}]}, state)
    (tmp_path / "slurm.conf").write_text("ClusterName=none\n")
    toml = tmp_path / "gpushare.toml"
    toml.write_text(f'version = 1\n[agent]\ndevice_backend = "sim:{state}"\n[mig]\n'
                    f'journal_dir = "{tmp_path / "journal"}"\nslurm_conf = "{tmp_path / "slurm.conf"}"\n')
    return toml


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(command, list(args), catch_exceptions=False)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    toml = str(config(tmp_path))
    assert run("apply", "--node", "n1", "--config", toml).exit_code == 2
    both = run("apply", "--node", "n1", "--config", toml, "--from-demand", "--target", "0=7g.40gb@0")
    assert both.exit_code == 2
    bad = run("apply", "--node", "n1", "--config", toml, "--target", "zero=7g.40gb@0")
    assert bad.exit_code == 2 and "GPU=LAYOUT" in bad.output
    illegal = run("apply", "--node", "n1", "--config", toml, "--target", "0=1g.5gb@7")
    assert illegal.exit_code == 2 and "legal starts" in illegal.output
    busy = run("apply", "--node", "n1", "--config", toml, "--target", "0=7g.40gb@0*")
    assert busy.exit_code == 2
    typo = tmp_path / "typo.toml"
    typo.write_text("version = 1\n[mig]\ndrian = 'node'\n")
    assert run("reconcile", "--node", "n1", "--config", str(typo)).exit_code == 2


def test_a_slurm_that_cannot_answer_is_exit_3_with_the_next_step(tmp_path: Path) -> None:
    toml = str(config(tmp_path))
    result = run("reconcile", "--node", "n1", "--config", toml)
    assert result.exit_code == 3 and "reconcile" in result.output
    result = run("apply", "--node", "n1", "--config", toml, "--target", "0=3g.20gb@4,2g.10gb@0")
    assert result.exit_code == 3 and "gpushare mig reconcile" in result.output


def test_controller_command_needs_controller_coordination(tmp_path: Path) -> None:
    toml = str(config(tmp_path))
    result = run("controller", "--config", toml)
    assert result.exit_code == 2 and 'coordination = "controller"' in result.output
