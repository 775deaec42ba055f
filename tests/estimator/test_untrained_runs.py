"""Never an estimate from a run that did not train (docs/estimator.md, "Runs that did not train"): the GPUs a
launcher line gives are the GPUs the script sees, a run that reaches no optimizer step is a failure with its
reason, and a script that reads a launcher's variables without its launcher is told to use one."""

from __future__ import annotations

import json
import textwrap

import pytest

from gpushare.estimator_cli.cli import EXIT_OK, EXIT_SCRIPT, main

pytestmark = pytest.mark.torch  # starts gpu-estimate captures: torch in a child process or the warm worker

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GPUSHARE_ESTIMATE_WORLD_SIZE", "GPUSHARE_ESTIMATE_DEVICES")

# Its own check wants one GPU per process, as pytorch/examples' torchrun scripts have it.
CHECKED_DDP = """
    import os, sys, torch, torch.distributed as dist
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}")
        sys.exit(0)
    dist.init_process_group("nccl")
    torch.cuda.set_device(local)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(512, 512).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(32, 512, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.fixture
def run(capsys, monkeypatch, tmp_path):
    for name in LAUNCHER_VARS:  # what gpu-estimate sets for a launcher line is undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def estimate(source: str, *line: str) -> tuple[int, dict | None, str]:
        script = tmp_path / "train.py"
        script.write_text(textwrap.dedent(source))
        capsys.readouterr()
        code = main(["--json", "--no-cache", "--gpu", "a100-40gb", *[str(script) if w == "SCRIPT" else w for w in line]])
        out, err = capsys.readouterr()
        return code, (json.loads(out) if code == EXIT_OK else None), err

    return estimate


def test_a_launcher_line_presents_one_gpu_per_process(run):
    code, doc, err = run(CHECKED_DDP, "torchrun", "--nproc_per_node=2", "SCRIPT")
    assert code == EXIT_OK, err
    assert doc["iterations"] == 3 and doc["targets"][0]["peak_allocated_bytes"] > 512 * 512 * 4


def test_a_run_that_ends_before_training_is_a_failure_with_its_reason(run):
    code, doc, err = run(CHECKED_DDP, "--devices", "1", "torchrun", "--nproc_per_node=2", "SCRIPT")
    assert code == EXIT_SCRIPT and doc is None
    assert err.strip().count("\n") == 0, err
    assert "nothing to estimate" in err and "needs 2 GPUs, found 1" in err


def test_an_optimizer_without_a_step_is_no_estimate(run):
    code, doc, err = run("""
        import sys, torch
        model = torch.nn.Linear(256, 256).cuda()
        opt = torch.optim.AdamW(model.parameters())
        if "--dry-run" in sys.argv:
            print("dry run: model built")
            sys.exit(0)
    """, "SCRIPT", "--dry-run")
    assert code == EXIT_SCRIPT and doc is None
    assert "made an optimizer but ended before its first optimizer step" in err and "dry run" in err


def test_a_script_reading_local_rank_without_a_launcher_gets_one_line(run):
    code, doc, err = run("""
        import os, torch
        local_rank = int(os.environ["LOCAL_RANK"])
        model = torch.nn.Linear(8, 8).to(local_rank)
    """, "SCRIPT")
    assert code == EXIT_SCRIPT and doc is None
    first = err.strip().splitlines()[0]
    assert "reads LOCAL_RANK" in first and "gpu-estimate torchrun" in first
    assert "fake mode had stopped first" not in err  # told at once, not after a profile-mode attempt
