"""Scenario files: strict validation with one-line errors naming the bad key."""

from __future__ import annotations

import json

import pytest

from gpushare.gres.sim_backend import SimBackend, main
from gpushare.gres.sim_scenario import ScenarioError, load_scenario, validate_scenario

TOML = """
version = 1
name = "n1"

[[gpus]]
model = "a100-40gb"
mig_mode = true
errors = { energy = "NVML_ERROR_GPU_IS_LOST" }

[[gpus]]
model = "L40S-48GB"
unsupported = ["power"]
utilization_source = "nvml"

[[processes]]
pid = 10
gpu = 1
memory_mib = 2048
smact = 0.5
steps = [{ after_s = 5, smact = 0.8 }]
"""


def test_toml_loads_and_normalises(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(TOML)
    sc = load_scenario(path)
    a100, l40s = sc["gpus"]
    assert a100["mig_current"] is True and a100["errors"] == {"energy": "GPU_IS_LOST"}
    assert l40s["model"] == "l40s-48gb" and l40s["errors"] == {"power": "NOT_SUPPORTED"} and l40s["minor"] == 1
    assert sc["processes"][0]["steps"] == [{"after_s": 5.0, "smact": 0.8}]
    assert sc["processes"][0]["end_s"] is None


def test_json_loads_too(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"version": 1, "gpus": [{"model": "a30-24gb"}]}))
    assert load_scenario(path)["gpus"][0]["total_bytes"] == 24576 << 20


@pytest.mark.parametrize("raw, message", [
    ({"gpus": [{"model": "a30-24gb"}]}, "scenario.version: required key missing"),
    ({"version": 2, "gpus": [{"model": "a30-24gb"}]}, "scenario.version: 2 is not supported"),
    ({"version": 1, "gpus": []}, "scenario.gpus: expected a non-empty list"),
    ({"version": 1, "gpu": []}, "scenario.gpu: unknown key"),
    ({"version": 1, "gpus": [{"modle": "a30-24gb"}]}, "gpus[0].modle: unknown key (known: index, model"),
    ({"version": 1, "gpus": [{"model": "b200"}]}, "gpus[0].model: unknown GPU 'b200'"),
    ({"version": 1, "gpus": [{"model": "l40s-48gb", "mig_capable": True}]}, "gpus[0].mig_capable: l40s-48gb has no MIG"),
    ({"version": 1, "gpus": [{"model": "l40s-48gb", "mig_mode": True}]}, "gpus[0].mig_mode: GPU is not MIG capable"),
    ({"version": 1, "gpus": [{"model": "a30-24gb", "mig_capable": False, "mig_mode": True}]},
     "gpus[0].mig_mode: GPU is not MIG capable"),
    ({"version": 1, "gpus": [{"model": "a30-24gb", "idle_power_w": "lots"}]}, "gpus[0].idle_power_w: expected a number"),
    ({"version": 1, "gpus": [{"model": "a30-24gb", "idle_power_w": 500}]}, "gpus[0].max_power_w: 400.0 is below"),
    ({"version": 1, "gpus": [{"model": "a30-24gb", "errors": {"power": "BROKEN"}}]}, "gpus[0].errors.power: unknown NVML error"),
    ({"version": 1, "gpus": [{"model": "a30-24gb", "unsupported": ["fan"]}]}, "unknown metric 'fan'"),
    ({"version": 1, "gpus": [{"model": "a30-24gb", "utilization_source": "x"}]}, "gpus[0].utilization_source"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}, {"model": "a30-24gb", "index": 0}]}, "duplicate index"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}], "processes": [{"pid": 1, "gpu": 3, "memory_mib": 1}]},
     "processes[0].gpu: no GPU with index 3"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}], "processes": [{"pid": 1, "gpu": 0}]},
     "processes[0].memory_mib: required key missing"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}], "processes": [{"pid": 1, "gpu": 0, "memory_mib": 1, "smact": 1.5}]},
     "processes[0].smact: 1.5 must be between 0.0 and 1.0"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}],
      "processes": [{"pid": 1, "gpu": 0, "memory_mib": 1, "start_s": 5, "end_s": 5}]}, "processes[0].end_s: 5"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}],
      "processes": [{"pid": 1, "gpu": 0, "memory_mib": 1, "steps": [{"after_s": 1, "mem": 3}]}]},
     "processes[0].steps[0].mem: unknown key"),
    ({"version": 1, "gpus": [{"model": "a30-24gb"}],
      "processes": [{"pid": 1, "gpu": 0, "memory_mib": 1}, {"pid": 1, "gpu": 0, "memory_mib": 1}]}, "duplicate pid"),
])
def test_bad_scenarios_name_the_key(raw, message):
    with pytest.raises(ScenarioError) as err:
        validate_scenario(raw)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("version = 1\n[[gpus]]\nmodel = 'a30-24gb'\ncolour = 'green'\n")
    with pytest.raises(ScenarioError, match=r"bad\.toml: gpus\[0\]\.colour: unknown key"):
        load_scenario(path)
    path.write_text("version = = 1")
    with pytest.raises(ScenarioError, match="bad.toml: cannot read scenario"):
        load_scenario(path)


def test_cli_init_writes_state_and_refuses_to_clobber(tmp_path, capsys):
    scenario = tmp_path / "s.toml"
    scenario.write_text(TOML)
    state = tmp_path / "state" / "gpus.json"
    assert main(["init", str(scenario), str(state)]) == 0
    assert SimBackend.open(state).gpu_count() == 2
    with pytest.raises(SystemExit) as exit_:
        main(["init", str(scenario), str(state)])
    assert exit_.value.code == 2 and "exists" in capsys.readouterr().err
    assert main(["init", str(scenario), str(state), "--force"]) == 0
