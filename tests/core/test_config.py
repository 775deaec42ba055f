"""The shared configuration model: strict keys, clear one-line errors, precedence env > file > default."""

from __future__ import annotations

import pytest

from gpushare.config import ConfigError, load_config, parse_config, parse_size
from gpushare.gpus import BUILTIN_GPUS, GiB, parse_target


def test_defaults_without_file(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUSHARE_CONFIG", raising=False)
    monkeypatch.setattr("gpushare.config.DEFAULT_PATH", tmp_path / "absent.toml")
    cfg = load_config()
    assert cfg.policy.margin_fraction == 0.10 and cfg.source == "<defaults>"


def test_example_config_is_valid():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "etc" / "gpushare.toml"
    cfg = load_config(path)
    assert cfg.nodes and cfg.policy.shared == "shard"
    assert '\n[policy]\nmode = "enforce"' in path.read_text()  # the off switch is in the file, not only in the docs


def test_commented_examples_in_the_example_config_are_real_settings():
    """Every commented-out table and key in etc/gpushare.toml, uncommented, is accepted: the example
    cannot drift from the settings it documents."""
    import re
    import tomllib
    from pathlib import Path

    from gpushare.config import parse_config

    text = (Path(__file__).resolve().parents[2] / "etc" / "gpushare.toml").read_text()
    uncommented = re.sub(r"^# (\[|[a-z_]+ = )", r"\1", text, flags=re.M)
    assert uncommented != text
    data = tomllib.loads(uncommented)
    assert {"estimation", "oom", "agent", "mig"} <= set(data)
    data["policy"]["without_estimate"] = "async"  # the example says to pair [estimation] with it
    parse_config(data)


@pytest.mark.parametrize("text, needle", [
    ("[policy]\nmargn_fraction = 0.2", "[policy]: unknown key 'margn_fraction'"),
    ("[policy]\nmargin_fraction = 2.0", "[policy].margin_fraction: must be between 0.0 and 1.0"),
    ("[policy]\nmargin_fraction = 'lots'", "[policy].margin_fraction: expected float"),
    ("[policy]\nshared = 'mps'", "must be one of shard, none"),
    ("[bogus]\nx = 1", "unknown section or key 'bogus'"),
    ("version = 2", "this gpushare reads version 1"),
    ("[[nodes]]\nnames = 'n1'\ngpu = 'b200'", "unknown GPU 'b200'"),
    ("[[nodes]]\ngpu = 'a100-40gb'", "names: required"),
    ("[estimator]\ngpus = ['a100-40gb:9g.99gb']", "has no MIG profile"),
    ("[policy\n", "not valid TOML"),
])
def test_bad_files_give_one_line_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "gpushare.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert needle in message and "\n" not in message and str(path) in message


def test_missing_named_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")


def test_environment_overrides_file(monkeypatch, tmp_path):
    path = tmp_path / "gpushare.toml"
    path.write_text("[policy]\nmargin_fraction = 0.2\n")
    monkeypatch.setenv("GPUSHARE_POLICY_MARGIN_FRACTION", "0.3")
    assert load_config(path).policy.margin_fraction == 0.3
    monkeypatch.setenv("GPUSHARE_POLICY_MARGIN_FRACTION", "many")
    with pytest.raises(ConfigError, match="environment GPUSHARE_POLICY_MARGIN_FRACTION"):
        load_config(path)


def test_site_gpu_model():
    cfg = parse_config({"gpus": {"mi250-64gb": {"total_gib": 64, "sms": 104}},
                        "nodes": [{"names": "m[1-2]", "gpu": "mi250-64gb", "count": 4}]})
    assert cfg.gpu("mi250-64gb").shards == 64


@pytest.mark.parametrize("text, value", [("1G", GiB), ("512M", GiB // 2), ("2gib", 2 * GiB), (3, 3)])
def test_sizes(text, value):
    assert parse_size(text) == value


def test_catalogue_targets():
    model, profile = parse_target("A100-40GB:3g.20gb")
    assert model is BUILTIN_GPUS["a100-40gb"] and profile.memory_slices == 4
    assert BUILTIN_GPUS["h100-80gb"].shards == 79
    with pytest.raises(ValueError, match="unknown GPU"):
        parse_target("k80")


def test_configuration_reference_lists_every_setting():
    from pathlib import Path

    from gpushare.config import settings_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    missing = [env for _, env, _, _ in settings_table() if f"`{env}`" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}; regenerate it from `gpushare config settings`"


def test_state_files_of_a_newer_format_are_refused_not_misread(tmp_path) -> None:
    from gpushare.atomic import FormatVersionError, read_json_object, write_json_atomic

    path = tmp_path / "entry.json"
    write_json_atomic(path, {"v": 1, "job": "1"})
    assert read_json_object(path, 4096, version=1) == {"v": 1, "job": "1"}
    write_json_atomic(path, {"job": "1"})  # an older shape without "v": accepted
    assert read_json_object(path, 4096, version=1) == {"job": "1"}
    write_json_atomic(path, {"v": 2, "job": "1"})
    with pytest.raises(FormatVersionError, match="entry.json: format v2"):
        read_json_object(path, 4096, version=1)
    assert read_json_object(path, 4096) == {"v": 2, "job": "1"}  # callers that do not check get it as is


def test_slurm_paths_live_in_one_section_and_the_older_names_still_read() -> None:
    from gpushare.config import ConfigError, parse_config

    cfg = parse_config({"oom": {"slurm_bin_dir": "/opt/slurm/bin", "slurm_conf": "/opt/slurm/etc/slurm.conf"},
                        "agent": {"slurm_conf": "/opt/slurm/etc/slurm.conf"}})
    assert (cfg.slurm.conf, cfg.slurm.bin_dir) == ("/opt/slurm/etc/slurm.conf", "/opt/slurm/bin")
    assert cfg.slurm_conf_path({}) == "/opt/slurm/etc/slurm.conf"
    with pytest.raises(ConfigError, match=r"\[mig\] slurm_conf = '/b' disagrees with \[slurm\] conf = '/a'"):
        parse_config({"slurm": {"conf": "/a"}, "mig": {"slurm_conf": "/b"}})
    with pytest.raises(ConfigError, match=r"\[slurm\]: unknown key 'slurm_conf'"):
        parse_config({"slurm": {"slurm_conf": "/a"}})


def test_a_hook_exits_0_and_logs_whatever_fails(tmp_path, monkeypatch, capsys) -> None:
    from gpushare.hooks import run_hook

    monkeypatch.setenv("GPUSHARE_CONFIG", str(tmp_path / "missing.toml"))
    assert run_hook("gpushare-test-hook", lambda cfg: None, lambda cfg: "", "job proceeds") == 0
    assert "configuration unusable" in capsys.readouterr().err
    (tmp_path / "g.toml").write_text(f'[agent]\nlog_file = "{tmp_path / "hook.log"}"\n')
    monkeypatch.setenv("GPUSHARE_CONFIG", str(tmp_path / "g.toml"))
    monkeypatch.setenv("SLURM_JOB_ID", "42")

    def body(cfg):
        raise RuntimeError("boom")

    assert run_hook("gpushare-test-hook", body, lambda cfg: cfg.agent.log_file, "job proceeds") == 0
    text = (tmp_path / "hook.log").read_text()
    assert "gpushare-test-hook failed (job 42); job proceeds" in text and "RuntimeError: boom" in text
