"""Where gpushare.toml is found, what happens when it is not, and the file's identity (its sha256).

The rule under test (docs/configuration.md): ``--config``/``GPUSHARE_CONFIG``, else beside ``$SLURM_CONF``,
else /etc/slurm; a missing file is one loud line naming the paths tried, hooks then do nothing, the agent
and gpushare-submitd refuse to start unless told ``--defaults``.
"""

from __future__ import annotations

import hashlib
import io
import logging

import pytest

from gpushare.config import NO_DIGEST, ConfigError, config_candidates, load_config


@pytest.fixture
def no_site_file(monkeypatch, tmp_path):
    """No GPUSHARE_CONFIG, SLURM_CONF in an empty directory, the standard place absent."""
    monkeypatch.delenv("GPUSHARE_CONFIG", raising=False)
    monkeypatch.setattr("gpushare.config.DEFAULT_PATH", tmp_path / "etc-slurm" / "gpushare.toml")
    (tmp_path / "slurm").mkdir()
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm" / "slurm.conf"))
    return tmp_path


def test_lookup_order_named_then_beside_slurm_conf_then_etc_slurm(no_site_file, monkeypatch):
    beside = no_site_file / "slurm" / "gpushare.toml"
    standard = no_site_file / "etc-slurm" / "gpushare.toml"
    assert config_candidates() == [beside, standard]
    standard.parent.mkdir()
    standard.write_text("[policy]\nmargin_fraction = 0.2\n")
    assert load_config().source == str(standard)
    beside.write_text("[policy]\nmargin_fraction = 0.3\n")
    assert load_config().policy.margin_fraction == 0.3  # beside $SLURM_CONF wins over /etc/slurm
    named = no_site_file / "named.toml"
    named.write_text("")
    monkeypatch.setenv("GPUSHARE_CONFIG", str(named))
    assert load_config().source == str(named)
    assert load_config(str(standard)).source == str(standard)  # --config beats the variable


def test_a_missing_file_is_one_line_naming_the_paths_tried(no_site_file, caplog):
    with caplog.at_level(logging.WARNING, logger="gpushare.config"):
        cfg = load_config()
    assert cfg.source == "<defaults>" and cfg.sha256 == NO_DIGEST
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("no gpushare.toml (tried ")
    assert str(no_site_file / "slurm" / "gpushare.toml") in line and str(no_site_file / "etc-slurm") in line
    assert "\n" not in line


def test_services_need_a_file_unless_told_defaults(no_site_file, capsys):
    with pytest.raises(ConfigError, match="--defaults"):
        load_config(require=True)
    from gpushare.slurm_plugins.submitd import main as submitd_main

    assert submitd_main(["--socket", str(no_site_file / "s.sock")]) == 2
    err = capsys.readouterr().err
    assert "gpushare-submitd: no gpushare.toml (tried" in err and "--defaults" in err
    from gpushare.agent.daemon import main as agent_main

    assert agent_main(["--node", "n1", "--backend", "sim:/nonexistent.json"]) == 2
    out = capsys.readouterr().out
    assert "gpushare-agent: no gpushare.toml (tried" in out and "--defaults" in out


def test_a_hook_without_a_file_logs_one_error_and_does_nothing(no_site_file, capsys, monkeypatch):
    """Not the built-in defaults: a hook on them would act on settings nobody checked (an admin's mode = "off"
    ignored). One ERROR line naming every path tried, exit 0, the job untouched; every hook of ours alike."""
    from gpushare.hooks import run_hook
    from gpushare.prolog import task_prolog
    from gpushare.epilog import task_epilog

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    ran = []
    assert run_hook("gpushare-test-hook", lambda cfg: ran.append(cfg.source), lambda cfg: "", "job proceeds") == 0
    assert ran == []
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if "no gpushare.toml" in line]
    assert "ERROR" in line and "gpushare-test-hook: no gpushare.toml (tried " in line, line
    assert str(no_site_file / "slurm" / "gpushare.toml") in line and str(no_site_file / "etc-slurm") in line
    assert "doing nothing for job 42" in line and "GPUSHARE_CONFIG" in line

    out = io.StringIO()
    monkeypatch.setenv("SLURM_SHARDS_ON_NODE", "4")
    assert task_prolog.main(out=out) == 0 and out.getvalue() == ""
    assert "gpushare-task-prolog: no gpushare.toml (tried " in capsys.readouterr().err
    assert task_epilog.report({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "", "SLURM_SHARDS_ON_NODE": "4"}) == "no gpushare.toml"
    assert "gpushare-task-epilog: no gpushare.toml (tried " in capsys.readouterr().err


def test_digest_is_the_sha256_of_the_file_bytes(tmp_path):
    path = tmp_path / "gpushare.toml"
    text = "version = 1\n[policy]\nmargin_fraction = 0.2\n"
    path.write_text(text)
    first = load_config(path).sha256
    assert first == hashlib.sha256(text.encode()).hexdigest()
    path.write_text(text + "# a comment\n")
    assert load_config(path).sha256 != first  # hosts should hold the same file, not just an equivalent one


class _Nodes:
    """Stands in for Slurm's answer to ``scontrol -o show node`` (the lookup is pure apart from it)."""

    def __init__(self, nodes):
        self._nodes = nodes

    def nodes(self):
        return self._nodes


def test_agent_finds_its_slurm_node_by_host_name():
    from gpushare.agent.cli import own_slurm_node

    nodes = [{"NodeName": "gpu01", "NodeHostName": "rack3-07"}, {"NodeName": "gpu02", "NodeHostName": "rack3-08"}]
    assert own_slurm_node(_Nodes(nodes), "rack3-07.example.org") == "gpu01"
    assert own_slurm_node(_Nodes([{"NodeName": "gpu03"}]), "gpu03") == "gpu03"
    with pytest.raises(ConfigError, match=r"no Slurm node .*\[agent\] node_name"):
        own_slurm_node(_Nodes(nodes), "elsewhere")
    shared = [{"NodeName": "n1", "NodeHostName": "localhost"}, {"NodeName": "n2", "NodeHostName": "localhost"}]
    with pytest.raises(ConfigError, match=r"several Slurm nodes .*n1, n2.*\[agent\] node_name"):
        own_slurm_node(_Nodes(shared), "localhost")


def test_config_check_without_a_file_fails_naming_the_paths(no_site_file, capsys):
    from gpushare.cli import main as gpushare_main

    assert gpushare_main(["config", "check"]) == 1
    assert "no gpushare.toml (tried" in capsys.readouterr().err
    (no_site_file / "slurm" / "gpushare.toml").write_text("version = 1\n")
    assert gpushare_main(["config", "check"]) == 0
