"""Framework caps merged with the user's settings, checked by PyTorch's own allocator-settings parser.

On a CPU-only PyTorch build the CUDA allocator's config object is not reachable, but the accelerator
allocator parser (``torch._C._accelerator_setAllocatorSettings``, c10's ``AcceleratorAllocatorConfig``)
is: it tokenises the whole value and validates every generic key, so a broken merge (a split bracket, an
empty item) fails there. On CPU builds it skips device-specific keys without reading their values, so the
fraction's *value* is checked through the project's model of the CUDA parser
(``gpushare.estimator_cli.allocator_config``), which follows ``c10/cuda/CUDAAllocatorConfig``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpushare.node.caps import Caps, task_env
from gpushare.node.framework_caps import merge_alloc_conf, merged_exports, split_top
from gpushare.estimator_cli.allocator_config import AllocatorConfig
from gpushare.prolog.task_prolog import exports
from gpushare.prolog.slurmd_prolog import write_caps

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

torch = pytest.importorskip("torch")


def torch_parses(value: str) -> None:
    """PyTorch's own parser (raises RuntimeError or ValueError on a malformed value)."""
    torch._C._accelerator_setAllocatorSettings(value)


def test_torch_parser_can_fail():
    with pytest.raises((RuntimeError, ValueError)):
        torch_parses("max_split_size_mb:64,,")
    with pytest.raises((RuntimeError, ValueError)):
        torch_parses("max_split_size_mb:[")


@pytest.mark.parametrize("user,expect", [
    (None, 0.25),
    ("", 0.25),
    ("expandable_segments:True", 0.25),
    ("max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", 0.25),
    ("per_process_memory_fraction:0.1,expandable_segments:True", 0.1),  # the user's stricter one stays
    ("per_process_memory_fraction:0.9", 0.25),  # a looser one is replaced
    ("per_process_memory_fraction:abc,max_split_size_mb:64", 0.25),  # a malformed one is replaced
])
def test_merged_value_is_accepted_by_pytorch(user, expect):
    merged = merge_alloc_conf(user, 0.25)
    assert merged is not None
    torch_parses(merged)
    cfg = AllocatorConfig.from_env_string(merged)
    assert cfg.per_process_memory_fraction == pytest.approx(expect)
    for item in split_top(user or ""):
        if not item.startswith("per_process_memory_fraction"):
            assert item in split_top(merged)  # the user's own keys are kept as written


def test_hostile_user_value_is_left_alone():
    assert merge_alloc_conf("max_split_size_mb:64;rm -rf /", 0.25) is None
    assert merge_alloc_conf("roundup_power2_divisions:[256:1", 0.25) is None
    out = merged_exports({"PYTORCH_CUDA_ALLOC_CONF": "$(id)"}, 0.25)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in out and out["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"


def test_jax_fraction_keeps_the_stricter_and_turns_preallocation_off():
    out = merged_exports({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".1", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, 0.3)
    assert out["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.1" and out["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert merged_exports({}, 0.3)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3"


def test_pytorch_alloc_conf_is_merged_when_the_user_set_it():
    out = merged_exports({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, 0.5)
    assert out["PYTORCH_ALLOC_CONF"] == "expandable_segments:True,per_process_memory_fraction:0.5"
    assert out["PYTORCH_CUDA_ALLOC_CONF"] == "per_process_memory_fraction:0.5"


def test_only_time_sliced_jobs_are_marked_for_framework_caps():
    soft = Caps("fraction", 4096, None, 0.1, "")
    assert task_env(soft, None)["GPUSHARE_FRAMEWORK_CAPS"] == "1"
    assert "GPUSHARE_FRAMEWORK_CAPS" not in task_env(soft, None, framework=False)
    assert "GPUSHARE_FRAMEWORK_CAPS" not in task_env(Caps("mps", 4096, 100, 0.1, ""), "/run/p")


def test_task_prolog_exports_merged_caps_that_pytorch_parses_in_the_job(tmp_path):
    write_caps(str(tmp_path), "42", task_env(Caps("fraction", 4096, None, 0.1, ""), None))
    user = {"SLURM_JOB_ID": "42", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,per_process_memory_fraction:0.5"}
    lines = exports(user, str(tmp_path))
    env = dict(line[len("export "):].split("=", 1) for line in lines)
    assert env["GPUSHARE_MEMORY_FRACTION"] == "0.1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256,per_process_memory_fraction:0.1"
    # the job's own PyTorch reads the exported setting from its environment and parses it
    code = ("import os, torch; v = os.environ['PYTORCH_CUDA_ALLOC_CONF']; "
            "torch._C._accelerator_setAllocatorSettings(v); print(v)")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert AllocatorConfig.from_env_string(done.stdout.strip()).per_process_memory_fraction == pytest.approx(0.1)
