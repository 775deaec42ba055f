"""``gpu-estimate [OPTIONS] SCRIPT [SCRIPT ARGS...]``: peak GPU memory of a training script, on a CPU.

Everything after SCRIPT is passed to the script untouched (options of gpu-estimate go before it).
Exit codes (docs/estimator.md):
  0  estimate produced (whether or not it fits a target)
  1  internal error of gpu-estimate
  2  usage error (bad option, unknown GPU, unreadable script, bad config)
  3  the script failed by itself: its traceback tail is printed, never an estimate
  4  the time limit (--timeout) or the memory limit (--max-cpu-memory) was hit (in profile mode, after
     reduced-batch profiles could not stand in for the full batch: estimator_cli/reduced_batch.py)
  5  the requested mode cannot estimate this script (e.g. --mode fake on data-dependent control flow)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from importlib import metadata
from pathlib import Path

import click

from gpushare.estimator_cli import cache as cache_mod
from gpushare.estimator_cli.interpreter import Interpreter
from gpushare.estimator_cli.launcher import CaptureFailed, Limits
from gpushare.config import ConfigError, load_config, parse_size

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SCRIPT, EXIT_LIMIT, EXIT_UNSUPPORTED = 0, 1, 2, 3, 4, 5
_FAILURE_EXIT = {"script_error": EXIT_SCRIPT, "timeout": EXIT_LIMIT, "limit": EXIT_LIMIT,
                 "unsupported": EXIT_UNSUPPORTED, "internal": EXIT_INTERNAL}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--gpu", "gpus", multiple=True, metavar="NAME",
              help="Target GPU, e.g. a100-40gb or a100-40gb:3g.20gb (repeatable). Default: [estimator] gpus.")
@click.option("--iterations", type=click.IntRange(1, 1000), help="Optimizer steps to capture (default 3).")
@click.option("--mode", type=click.Choice(["auto", "fake", "profile"]), help="Capture mode (default auto).")
@click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document instead of text.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG timeline of the first target.")
@click.option("--snapshot", type=click.Path(dir_okay=False),
              help="Write a torch.cuda.memory._snapshot()-format pickle (pytorch.org/memory_viz).")
@click.option("--timeout", type=click.FloatRange(1, 86400), help="Wall-clock limit in seconds (default 300).")
@click.option("--max-cpu-memory", metavar="SIZE", help="Address-space limit of the script, e.g. 16G.")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the estimate cache.")
@click.option("--no-warm", is_flag=True,
              help="Start the script in a fresh interpreter; use no warm worker and leave none behind.")
@click.option("--python", "python", metavar="PATH",
              help="Run the script under this Python (a venv's bin/python, a command on PATH, torchrun) instead of "
                   "gpu-estimate's own; nothing is installed into it.")
@click.option("--own-python-if-unusable", is_flag=True, hidden=True,
              help="With --python: use gpu-estimate's own Python when that one cannot run the capture (the "
                   "cluster's estimation jobs, for batch scripts that set up no environment).")
@click.option("--devices", type=click.IntRange(1, 64), metavar="N",
              help="GPUs the script sees on its node (default: the launcher line's processes per node, else 1).")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Estimate cache (default ~/.cache/gpushare).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="gpushare.toml to read.")
@click.option("--progress/--no-progress", default=None, help="Progress on stderr (default: when a terminal).")
@click.option("-v", "--verbose", is_flag=True, help="Also show the script's own output.")
@click.option("--annotate", is_flag=True,
              help="Then submit with the estimate attached: SCRIPT ARGS -- [SBATCH OPTIONS] train.sbatch.")
@click.option("--sbatch", "sbatch_file", type=click.Path(dir_okay=False, exists=True),
              help="With --annotate: the batch script to submit (instead of '-- train.sbatch').")
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def command(ctx: click.Context, gpus: tuple[str, ...], iterations: int | None, mode: str | None, as_json: bool,
            plot: str | None, snapshot: str | None, timeout: float | None, max_cpu_memory: str | None,
            no_cache: bool, no_warm: bool, python: str | None, own_python_if_unusable: bool, devices: int | None,
            cache_dir: str | None,
            config_path: str | None, progress: bool | None, verbose: bool, annotate: bool, sbatch_file: str | None, script: str,
            script_args: tuple[str, ...]) -> int:
    """Estimate the peak GPU memory of SCRIPT on each target GPU, without a GPU."""
    from gpushare.estimator_cli.pipeline import Request, run  # torch-free until here: --help stays fast

    submission = None
    if annotate or sbatch_file:  # estimator_cli/annotate.py: the sbatch part is not the script's
        from gpushare.estimator_cli.annotate import AnnotateError, split_args

        try:
            submission = split_args(script_args, sbatch_file)
        except AnnotateError as exc:
            raise click.UsageError(str(exc)) from exc
        script_args = tuple(submission.script_args)

    try:
        # a missing gpushare.toml is the administrator's concern, not the researcher's: debug log only
        cfg = load_config(config_path, warn=False)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if cfg.missing_line():
        logging.getLogger("gpushare.config").debug("%s", cfg.missing_line())
    est = cfg.estimator
    targets = list(gpus) or [str(g) for g in est.gpus]
    try:
        from gpushare.estimator_cli.device_model import device_for

        for t in targets:
            device_for(t, cfg.gpus)
        limit_bytes = parse_size(max_cpu_memory or est.max_cpu_memory)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    launch = None
    from gpushare.estimator_cli.launch_line import (LaunchLineError, command_script, is_launcher, module_file, parse,
                                                    python_of, rank_zero_env)

    module = False
    command_python = None  # the Python a console script's first line names
    try:
        if is_launcher(script):  # torchrun/accelerate launch/srun/python ... as the batch script has it
            launch = parse([script, *script_args])
            script, script_args, module = launch.script, tuple(launch.args), launch.module
            if not launch.launcher.startswith("python"):
                # rank 0 of the launcher's world, in this process and the capture child (and the cache key)
                os.environ.update(rank_zero_env(launch))
        if not module and "/" not in script and not os.path.isfile(script):
            # a command (litgpt, tune, yolo): the console script it stands for runs as the script
            script = command_script(script)
            command_python = python_of(script)
    except LaunchLineError as exc:
        click.echo(f"gpu-estimate: {exc}", err=True)
        return EXIT_USAGE
    if devices is not None:  # read by the capture child (torch.cuda.device_count()), part of the cache key
        from gpushare.estimator_cli.launch_line import DEVICES_VAR

        os.environ[DEVICES_VAR] = str(devices)
    if module:  # python -m pkg: the file it runs, found without importing (else its name) keys the cache
        found = module_file(script, [os.getcwd(), *sys.path[1:]])
        script_bytes = Path(found).read_bytes() if found else script.encode()
    else:
        try:
            script_bytes = Path(script).read_bytes()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {script}: {exc.strerror}", param_hint="SCRIPT") from exc
    if python is None and command_python and not _own_python(command_python):
        python = command_python  # the console script's environment, as --python would name it
    from gpushare.estimator_cli.interpreter import InterpreterError

    try:
        interpreter, python_note = _interpreter(python, own_python_if_unusable)
    except InterpreterError as exc:  # one line (no usage text): the cluster's records quote it
        click.echo(f"gpu-estimate: {exc}", err=True)
        return EXIT_USAGE
    if python_note:
        click.echo(f"gpu-estimate: {python_note}", err=True)
    request = Request(
        script=script, args=list(script_args), targets=targets, mode=mode or est.mode,
        iterations=iterations or est.iterations,
        limits=Limits(timeout_s=timeout or est.timeout_s, max_address_space=limit_bytes,
                      warm_idle_s=0.0 if no_warm else est.warm_worker_idle_s, python=interpreter),
        plot=plot, snapshot=snapshot, cfg=cfg, module=module)
    show_progress = sys.stderr.isatty() if progress is None else progress
    # Settings that change the document: capture, the [policy] margins the recommendation uses, and this
    # tool's version (a new estimator may estimate differently).
    settings = {"mode": request.mode, "iterations": request.iterations, "policy": dataclasses.asdict(cfg.policy),
                "tool": _version("slurm-gpushare")}
    torch_version = _version("torch")
    if interpreter is not None:  # another environment: its own estimate, even with the same PyTorch
        settings["python"] = [interpreter.path, interpreter.prefix, interpreter.python_version]
        torch_version = interpreter.torch_version
    if module or command_python:  # code of an installed package: a new version of it is a new estimate
        from gpushare.estimator_cli.warm_worker import installed_distributions

        settings["program"] = [script, installed_distributions()]
    key = cache_mod.cache_key(script_bytes, request.args, dict(os.environ), torch_version, targets, settings)
    directory = Path(cache_dir) if cache_dir else cache_mod.default_cache_dir()
    doc = None
    if not no_cache and not plot and not snapshot:
        doc = cache_mod.load(directory, key)
        if doc is not None:
            doc["cached"] = True
    if doc is None:
        try:
            doc, output = run(request, key, show_progress, _version("slurm-gpushare"))
        except CaptureFailed as exc:
            if verbose and exc.output:
                click.echo(exc.output.rstrip(), err=True)
            click.echo(f"gpu-estimate: {exc}", err=True)
            if exc.traceback_tail:
                click.echo("script traceback (last lines):\n" + exc.traceback_tail, err=True)
            return _FAILURE_EXIT.get(exc.status, EXIT_INTERNAL)
        if verbose and output.strip():
            click.echo("--- script output ---\n" + output.rstrip() + "\n--- end of script output ---", err=True)
        if verbose and doc.get("capture_process_note"):
            click.echo(f"gpu-estimate: {doc['capture_process_note']}", err=True)
        if not no_cache:
            cache_mod.store(directory, key, doc)
    if python_note:
        doc["python_note"] = python_note
    if submission is not None:
        from gpushare.estimator_cli.annotate import submit

        return submit(doc, submission)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        from gpushare.estimator_cli.report import render_text

        click.echo(render_text(doc))
    return EXIT_OK


def _own_python(path: str) -> bool:
    """Whether the Python a console script names is gpu-estimate's own (same environment's ``bin``)."""
    import shutil

    found = path if "/" in path else shutil.which(path)
    return found is not None and os.path.dirname(os.path.abspath(found)) == os.path.dirname(
        os.path.abspath(sys.executable))


def _interpreter(python: str | None, own_if_unusable: bool) -> tuple[Interpreter | None, str | None]:
    """The --python interpreter, checked (a usage error in one line when it cannot run the capture), or
    None for gpu-estimate's own; with ``own_if_unusable``, None and why instead of the error."""
    if python is None:
        return None, None
    from gpushare.estimator_cli.interpreter import InterpreterError, probe, resolve

    try:
        return probe(resolve(python)), None
    except InterpreterError as exc:
        if own_if_unusable:
            return None, f"{exc}; estimated with gpu-estimate's own Python instead"
        raise


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the launcher kills the script's process group on its way out


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (docs/style.md #12)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)  # scancel / kill: never leave the script running
    try:
        code = command.main(args=argv, prog_name="gpu-estimate", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("gpu-estimate: interrupted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - a bug of ours: one line, details with --verbose
        click.echo(f"gpu-estimate: internal error: {type(exc).__name__}: {exc} (please report it)", err=True)
        if "-v" in (argv or sys.argv) or "--verbose" in (argv or sys.argv):
            import traceback

            traceback.print_exc()
        return EXIT_INTERNAL
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
