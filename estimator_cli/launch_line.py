"""Read a launcher line as a batch script has it: ``torchrun --nproc_per_node=8 train.py ...``.

Why: multi-GPU jobs start their script through a launcher (torchrun, ``python -m torch.distributed.run``,
``accelerate launch``, ``srun``, ``deepspeed``), which sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` and starts one process
per GPU. gpu-estimate runs one process: it takes the script and its arguments out of the line, the world
size from the launcher's options, and presents rank 0 of that world (estimator_cli/fake_distributed.py
makes ``init_process_group`` a fake process group of that size). Every rank of a data-parallel job holds
the same memory, so rank 0's peak is the per-GPU peak. Torch-free: the CLI parses before importing torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpushare.errors import GpushareError

LAUNCHERS = ("torchrun", "accelerate", "srun", "deepspeed", "lightning", "fabric", "python", "python3")

# Options of each launcher that take no value (everything else starting with "-" takes one, unless "=" joins it).
_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path",
                   "--use-env", "--use_env", "--virtual-local-rank", "--virtual_local_rank"}
_ACCELERATE_FLAGS = {"--multi_gpu", "--multi-gpu", "--cpu", "--use_fsdp", "--use-fsdp", "--use_deepspeed",
                     "--use-deepspeed", "--use_megatron_lm", "--use-megatron-lm", "-m", "--module", "--no_python",
                     "--no-python", "--debug", "-q", "--quiet", "--tpu", "--use_xpu", "--same_network",
                     "--enable_cpu_affinity", "--rdzv_conf"}
_SRUN_FLAGS = {"-l", "--label", "-u", "--unbuffered", "-v", "--verbose", "-Q", "--quiet", "-K", "--kill-on-bad-exit",
               "-E", "--preserve-env", "-O", "--overcommit", "-s", "--oversubscribe", "-X", "--disable-status",
               "-Z", "--no-allocate", "-H", "--hold", "--exclusive", "--pty", "--mpi=none", "--exact",
               "--overlap", "--wait-all-nodes"}
_DEEPSPEED_FLAGS = {"--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check", "--force_multi",
                    "--save_pid", "--autotuning", "--bind_cores_to_rank", "-q", "--quiet"}
_PYTHON_FLAGS = {"-u", "-O", "-OO", "-B", "-s", "-S", "-E", "-I", "-b", "-bb", "-q", "-d", "-v", "-P", "-R"}
_PYTHON_VALUED = {"-X", "-W"}


class LaunchLineError(GpushareError, ValueError):
    """The line names a launcher but cannot be read (a one-line message for the user)."""


@dataclass
class LaunchLine:
    script: str
    args: list[str]
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = ""
    env: dict[str, str] = field(default_factory=dict)
    module: bool = False  # ``script`` is a module, run as ``python -m`` runs it (torchrun -m, python -m)


def is_launcher(script: str) -> bool:
    """SCRIPT names a launcher rather than a file of Python (``torchrun``, ``/venv/bin/torchrun``, ...)."""
    name = os.path.basename(script)
    return (name in LAUNCHERS or name.startswith("python3.")) and not script.endswith(".py")


def _split(tokens: list[str], flags: set[str], what: str) -> tuple[dict[str, str], list[str]]:
    """Options before the first positional argument (name -> value, '' for flags) and the rest."""
    options: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return options, tokens[i + 1:]
        if not token.startswith("-") or token == "-":
            return options, tokens[i:]
        if "=" in token and token.startswith("--"):
            name, value = token.split("=", 1)
            options[name] = value
        elif token in flags:
            options[token] = ""
        elif not token.startswith("--") and len(token) > 2:  # -n4
            options[token[:2]] = token[2:]
        else:
            if i + 1 >= len(tokens):
                raise LaunchLineError(f"{what}: option {token} has no value")
            options[token] = tokens[i + 1]
            i += 1
        i += 1
    raise LaunchLineError(f"{what}: no training script on the line")


def _count(value: str, what: str, option: str) -> int:
    head = value.split(":")[0]  # torchrun --nnodes=1:4 (elastic): the minimum
    if head.isdigit() and int(head) > 0:
        return int(head)
    if value in ("gpu", "auto"):
        return int(os.environ.get("SLURM_GPUS_ON_NODE", "1").split("(")[0] or 1)
    raise LaunchLineError(f"{what}: {option} {value!r} is not a count of processes")


def _option(options: dict[str, str], *names: str) -> str | None:
    for name in names:
        if name in options:
            return options[name]
    return None


def _torchrun(tokens: list[str], launcher: str) -> LaunchLine:
    options, rest = _split(tokens, _TORCHRUN_FLAGS, launcher)
    per_node = _count(_option(options, "--nproc_per_node", "--nproc-per-node") or "1", launcher, "--nproc-per-node")
    nodes = _count(_option(options, "--nnodes") or "1", launcher, "--nnodes")
    return _program(rest, options, per_node * nodes, per_node, launcher)


def _program(rest: list[str], options: dict[str, str], world: int, local: int, launcher: str) -> LaunchLine:
    """What a launcher starts: a script file, a module (``-m``/``--module``) or, with ``--no-python``, a
    command, which must be a Python program (a console script) to be estimated."""
    line = LaunchLine(rest[0], rest[1:], world, local, launcher)
    if "-m" in options or "--module" in options:
        line.module = True
    elif "--no-python" in options or "--no_python" in options:
        line.script = command_script(rest[0], launcher)
    return line


def _accelerate(tokens: list[str]) -> LaunchLine:
    if not tokens or tokens[0] != "launch":
        raise LaunchLineError("accelerate: only 'accelerate launch SCRIPT ...' starts a training script")
    options, rest = _split(tokens[1:], _ACCELERATE_FLAGS, "accelerate launch")
    world = _count(_option(options, "--num_processes", "--num-processes") or "1", "accelerate launch",
                   "--num_processes")
    machines = _count(_option(options, "--num_machines", "--num-machines") or "1", "accelerate launch",
                      "--num_machines")
    line = _program(rest, options, world, max(1, world // machines), "accelerate launch")
    if "--mixed_precision" in options or "--mixed-precision" in options:  # accelerate passes it on this way
        line.env["ACCELERATE_MIXED_PRECISION"] = _option(options, "--mixed_precision", "--mixed-precision") or "no"
    return line


def _deepspeed(tokens: list[str]) -> LaunchLine:
    """DeepSpeed's launcher (``deepspeed --num_gpus=8 train.py --deepspeed ...``): one process per GPU, each
    given ``--local_rank=R`` ahead of the script's own arguments unless ``--no_local_rank``."""
    options, rest = _split(tokens, _DEEPSPEED_FLAGS, "deepspeed")
    if _option(options, "-i", "--include", "-e", "--exclude", "-H", "--hostfile") is not None:
        raise LaunchLineError("deepspeed: --include/--exclude/--hostfile pick hosts and GPUs gpu-estimate cannot "
                              "see; give the count with --num_gpus and --num_nodes")
    per_node = _count(_option(options, "--num_gpus", "--num-gpus") or "gpu", "deepspeed", "--num_gpus")  # all: the job's
    nodes = _count(_option(options, "--num_nodes", "--num-nodes") or "1", "deepspeed", "--num_nodes")
    line = _program(rest, options, per_node * nodes, per_node, "deepspeed")
    if "--no_local_rank" not in options:
        line.args = ["--local_rank=0", *line.args]
    return line


def _fabric(tokens: list[str], launcher: str) -> LaunchLine:
    """Lightning Fabric's launcher: ``lightning run model``, ``fabric run model`` or ``fabric run`` [options]
    SCRIPT: torchrun with ``--devices`` processes per node, Fabric's settings passed as ``LT_*`` variables."""
    words = list(tokens)
    usage = f"{launcher}: only '{launcher} run{' model' if launcher == 'lightning' else ''} [OPTIONS] SCRIPT ...' " \
        "starts a training script"
    if not words or words[0] != "run":
        raise LaunchLineError(usage)
    words.pop(0)
    if words[:1] == ["model"]:
        words.pop(0)
    elif launcher == "lightning":
        raise LaunchLineError(usage)
    name = f"{launcher} run"
    options, rest = _split(words, set(), name)  # every option of Fabric's launcher takes a value
    devices = _option(options, "--devices") or "1"
    if "," in devices:  # a list of GPU indices
        per_node = len([d for d in devices.split(",") if d.strip()])
    else:
        per_node = _count("gpu" if devices in ("-1", "auto") else devices, name, "--devices")
    nodes = _count(_option(options, "--num_nodes", "--num-nodes") or "1", name, "--num_nodes")
    line = LaunchLine(rest[0], rest[1:], per_node * nodes, per_node, name)
    line.env.update(LT_CLI_USED="1", LT_DEVICES=devices, LT_NUM_NODES=str(nodes),
                    LT_ACCELERATOR=_option(options, "--accelerator") or "cuda")
    for option, var in (("--strategy", "LT_STRATEGY"), ("--precision", "LT_PRECISION")):
        if option in options:
            line.env[var] = options[option]
    return line


def _python(tokens: list[str], launcher: str) -> LaunchLine:
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "-m":
            module = tokens[i + 1] if i + 1 < len(tokens) else ""
            if module in ("torch.distributed.run", "torch.distributed.launch"):
                return _torchrun(tokens[i + 2:], f"{launcher} -m {module}")
            if module == "accelerate.commands.launch":
                return _accelerate(["launch", *tokens[i + 2:]])
            if not module:
                raise LaunchLineError(f"{launcher} -m: no module named")
            return LaunchLine(module, tokens[i + 2:], 1, 1, launcher, module=True)
        if token in _PYTHON_VALUED:
            i += 2
            continue
        if token in _PYTHON_FLAGS or (token.startswith("-X") or token.startswith("-W")):
            i += 1
            continue
        if token.startswith("-"):
            raise LaunchLineError(f"{launcher}: option {token} is not understood")
        return LaunchLine(token, tokens[i + 1:], 1, 1, launcher)
    raise LaunchLineError(f"{launcher}: no training script on the line")


def _srun(tokens: list[str]) -> LaunchLine:
    options, rest = _split(tokens, _SRUN_FLAGS, "srun")
    tasks = _count(_option(options, "-n", "--ntasks") or os.environ.get("SLURM_NTASKS", "1"), "srun", "--ntasks")
    inner = parse(rest)
    if inner.launcher in ("python", "python3") or inner.launcher.startswith("python3.") or not inner.launcher:
        # one process per task: srun is the launcher, Slurm's variables say the rank
        nodes = _count(_option(options, "-N", "--nodes") or "1", "srun", "--nodes")
        per_node = max(1, tasks // nodes)
        inner.world_size, inner.local_world_size, inner.launcher = tasks, per_node, "srun"
        inner.env.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS=str(tasks),
                         SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NODEID="0")
    return inner


def parse(tokens: list[str]) -> LaunchLine:
    """The script, its arguments and the world size of a launcher line (``tokens[0]`` the launcher); a line
    that starts with a script file is that script in a world of one."""
    if not tokens:
        raise LaunchLineError("empty launcher line")
    head = os.path.basename(tokens[0])
    if not is_launcher(tokens[0]):
        return LaunchLine(tokens[0], tokens[1:])
    if head == "torchrun":
        return _torchrun(tokens[1:], "torchrun")
    if head == "accelerate":
        return _accelerate(tokens[1:])
    if head == "srun":
        return _srun(tokens[1:])
    if head == "deepspeed":
        return _deepspeed(tokens[1:])
    if head in ("lightning", "fabric"):
        return _fabric(tokens[1:], head)
    return _python(tokens[1:], head)


def command_script(name: str, what: str = "gpu-estimate", search_path: str | None = None) -> str:
    """The file of Python a command stands for (``litgpt``, ``tune``, ``yolo``: a console script that pip or
    uv wrote into an environment's ``bin``), found the way the shell would find it, then in the directory of
    the Python that runs gpu-estimate (a venv used without activating it). A console script is a Python file
    (its ``#!`` line names the environment's Python), so it runs as a script does; anything else (a shell
    script, a binary) cannot be estimated."""
    import shutil
    import sys

    here = os.path.dirname(os.path.abspath(sys.executable))
    path = os.environ.get("PATH", "") if search_path is None else search_path
    found = name if "/" in name else shutil.which(name, path=os.pathsep.join(p for p in (path, here) if p))
    if not found or not os.path.isfile(found):
        raise LaunchLineError(f"{what}: {name} is neither a file nor a command on PATH")
    if python_of(found) is None:
        raise LaunchLineError(f"{what}: {found} is not a Python program (its first line names no Python)")
    return found


_PIP_SH_EXEC = re.compile(r"^'''exec' (?:\"([^\"]+)\"|(\S+))")  # pip's #!/bin/sh form for long paths


def python_of(path: str) -> str | None:
    """The Python a console script's first line names (``#!/venv/bin/python``, ``#!/usr/bin/env python3``,
    pip's ``#!/bin/sh`` then ``'''exec' /venv/bin/python``), or None for anything else."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1024).decode("utf-8", "replace")
    except OSError:
        return None
    lines = head.splitlines()
    if not lines or not lines[0].startswith("#!"):
        return None
    words = lines[0][2:].split()
    if words and words[0].endswith("/sh") and len(lines) > 1:
        match = _PIP_SH_EXEC.match(lines[1])
        words = [match.group(1) or match.group(2)] if match else []
    elif words and words[0].endswith("/env"):
        words = [w for w in words[1:] if not w.startswith("-")]
    return words[0] if words and re.search(r"python[0-9.]*$", os.path.basename(words[0])) else None


def module_file(name: str, search: list[str]) -> str | None:
    """The file ``python -m name`` would run (a package's ``__main__.py``), found on ``search`` without
    importing anything (a package's ``__init__`` may import torch: the parent stays torch-free); None when
    it is not a plain source file there (the capture child still finds it on its own path)."""
    from importlib.machinery import PathFinder

    parts = name.split(".")
    locations: list[str] | None = search
    spec = None
    for depth in range(len(parts)):
        if not locations:
            return None
        spec = PathFinder.find_spec(".".join(parts[:depth + 1]), locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: its __main__
        spec = PathFinder.find_spec(f"{name}.__main__", list(spec.submodule_search_locations))
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def rank_zero_env(line: LaunchLine) -> dict[str, str]:
    """The variables a launcher gives rank 0 of the job (and gpu-estimate's own world-size marker)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "NODE_RANK": "0",
           "WORLD_SIZE": str(line.world_size), "LOCAL_WORLD_SIZE": str(line.local_world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", WORLD_SIZE_VAR: str(line.world_size),
           DEVICES_VAR: str(line.local_world_size)}
    env.update(line.env)
    return env


# read by the capture child (estimator_cli/fake_distributed.py): init_process_group becomes a fake group
WORLD_SIZE_VAR = "GPUSHARE_ESTIMATE_WORLD_SIZE"
# read by the capture child (estimator_cli/cuda_api.py): how many GPUs torch.cuda.device_count() presents, one
# per process of the node (the launcher's), so a script's own check ("needs 2 GPUs") sees what the job has
DEVICES_VAR = "GPUSHARE_ESTIMATE_DEVICES"


def presented_devices(env: dict[str, str] | None = None) -> int:
    """The GPU count the capture presents: DEVICES_VAR when set to a count, else 1."""
    value = (os.environ if env is None else env).get(DEVICES_VAR, "")
    return int(value) if value.isdigit() and int(value) > 0 else 1
