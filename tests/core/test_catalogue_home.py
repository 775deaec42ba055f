"""Every per-model GPU figure lives on the model in the catalogue (gpushare/gpus.py), so a site's ``[gpus.*]``
model is complete everywhere: the estimator's CUDA context, the simulated power range, the reduction grid,
jobstats' whole-GPU share and MIG advice."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from gpushare.config import parse_config
from gpushare.cuda_context import context_bytes_for
from gpushare.epilog import jobstats_cli
from gpushare.estimator_cli.device_model import device_for
from gpushare.gpus import BUILTIN_GPUS, DEFAULT_POWER_W, GiB, find_mig_profile
from gpushare.simulator.device import SimCluster

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "gpushare" / "gpus.py"


def _package_files() -> list[Path]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted(p for folder in data["tool"]["setuptools"]["package-dir"].values()
                  for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_catalogue_is_the_only_table_keyed_by_model_name():
    names = set(BUILTIN_GPUS)
    found = []
    for path in _package_files():
        if path == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if len(keys & names) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"tables keyed by GPU model name outside gpushare/gpus.py: {found}"


def test_a_site_model_gets_sm_arch_power_and_context_figures():
    cfg = parse_config({"gpus": {
        "h800-80gb": {"total_gib": 79.6, "sms": 132, "marketing_name": "NVIDIA H800"},
        "b200-180gb": {"total_gib": 179.0, "sms": 148, "marketing_name": "NVIDIA B200",
                       "compute_capability": "10.0", "idle_watts": 140.0, "max_watts": 1000.0}}})
    h800, b200 = cfg.gpus["h800-80gb"], cfg.gpus["b200-180gb"]
    assert (h800.sm_arch, h800.power_w) == ((9, 0), DEFAULT_POWER_W)  # from its marketing name; default power
    assert (b200.sm_arch, b200.power_w) == ((10, 0), (140.0, 1000.0))  # as the file gives them
    device = device_for("b200-180gb", cfg.gpus)
    assert device.sm_arch == (10, 0) and device.context_bytes == context_bytes_for((10, 0))
    assert device_for("h800-80gb", cfg.gpus).context_bytes == BUILTIN_GPUS["h100-80gb"].context_bytes()
    cluster = SimCluster(b200, 179 * GiB, 1, 1, clock=lambda: 0.0)
    assert cluster.power_w == (140.0, 1000.0)


def test_jobstats_reads_the_sites_catalogue():
    cfg = parse_config({"gpus": {"h800-80gb": {"total_gib": 80.0, "sms": 132, "marketing_name": "NVIDIA H800"}}})
    row = {"JobIDRaw": "7", "User": "alice", "State": "COMPLETED", "ExitCode": "0:0", "Elapsed": "00:01:05",
           "NodeList": "n1", "AllocTRES": "gres/gpu=1,gres/gpu:h800-80gb=1", "AdminComment": ""}
    assert jobstats_cli.summarise([row])["share_gib"] is None  # the built-in table does not know it
    assert jobstats_cli.summarise([row], catalogue=cfg.gpus)["share_gib"] == 80.0


def test_mig_profile_names_resolve_in_the_order_given():
    a100_40, a100_80 = BUILTIN_GPUS["a100-40gb"], BUILTIN_GPUS["a100-80gb"]
    first, other = find_mig_profile([a100_40, a100_80], "1g.10gb"), find_mig_profile([a100_80, a100_40], "1g.10gb")
    assert first is not None and first.memory_slices == 2  # the 40 GB card's 1g.2x
    assert other is not None and other.memory_slices == 1  # the 80 GB card's 1g
    assert find_mig_profile(BUILTIN_GPUS.values(), None) is None
    assert find_mig_profile(BUILTIN_GPUS.values(), "9g.999gb") is None
    assert a100_40.find_mig_profile("3g.20gb") is a100_40.mig_profile("3g.20gb")
