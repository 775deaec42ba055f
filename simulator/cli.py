"""``gpushare simulate``: replay a trace through a placement policy and report what it would do.

Reference data (the default Philly trace and Gavel's throughputs) is read from ``--data-dir``, else
``$GPUSHARE_DATA_DIR``, else the copies this package ships (``simulator/data/``, with their sources and
licences in its README).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from gpushare.config import ConfigError, load_config
from gpushare.gpus import BUILTIN_GPUS, parse_target
from gpushare.slurm.version import SUPPORTED
from gpushare.simulator.policies import POLICIES, make_policy
from gpushare.simulator import batch, estimators, report
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.runner import simulation
from gpushare.simulator.sweep import hyperparameter_sweep
from gpushare.simulator.interference import MODES
from gpushare.simulator.live import PLACEMENTS, LiveSetup, setup
from gpushare.simulator.trace import TraceError, read

TRACE_NAME = "philly_trace_60_tasks.csv"
THROUGHPUTS_NAME = "gavel_simulation_throughputs.json"
MIG_POLICIES = ("mig-a", "mig-b")


def data_dir(flag: str | None) -> Path:
    if flag:
        return Path(flag)
    if os.environ.get("GPUSHARE_DATA_DIR"):
        return Path(os.environ["GPUSHARE_DATA_DIR"])
    return Path(__file__).resolve().parent / "data"


def _check(policy: str, estimator: str, gpu: str) -> None:
    try:
        if policy not in MIG_POLICIES:
            make_policy(policy)
        estimators.parse(estimator)
        parse_target(gpu)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("simulate")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help=f"trace CSV (Philly arrivals or the rich format, docs/simulator.md); default: DATA_DIR/{TRACE_NAME}")
@click.option("--sacct", "sacct_path", type=click.Path(dir_okay=False), default=None,
              help="instead of a trace, your cluster's own history: sacct -X --json (or --parsable2) output")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(1), default=3, show_default=True)
@click.option("--gpu", default="a100-40gb", show_default=True, help=f"GPU model: {', '.join(BUILTIN_GPUS)}")
@click.option("--policy", default="magm", show_default=True,
              help=f"{', '.join(POLICIES)}, ff|bf|magm|lug-nofilter, or {', '.join(MIG_POLICIES)}")
@click.option("--estimator", default=None,
              help="oracle (default), none, gpu-estimate, measured (gpu-estimate's measured error; --policy live's "
                   "default) or noisy:SIGMA")
@click.option("--seed", type=int, default=0, show_default=True, help="drives workload mapping, TTFK and noise")
@click.option("--interference", type=click.Choice(MODES), default="gavel", show_default=True)
@click.option("--util", "util_profile", type=click.Choice(["carma-fit", "classes"]), default="carma-fit",
              show_default=True, help="solo utilisation per class: fitted to CARMA's measured runs (docs/simulator.md, "
                                      "Calibration), or the assumed classes")
@click.option("--throughputs", type=click.Path(dir_okay=False), default=None,
              help=f"Gavel throughputs JSON; default: DATA_DIR/{THROUGHPUTS_NAME}")
@click.option("--data-dir", "data_dir_flag", default=None, help="reference data folder (or $GPUSHARE_DATA_DIR)")
@click.option("--no-recovery", is_flag=True, help="an OOM fails the job instead of requeueing it exclusive")
@click.option("--json", "as_json", is_flag=True, help="print the versioned JSON document instead of text")
@click.option("--caps/--no-caps", default=None,
              help="jobs that outgrow their share grow mid-run, held to it (--caps: framework caps + the agent's "
                   "backstop) or not (--no-caps); unset: memory reaches its peak at the first kernel")
@click.option("--sweep", "sweep_jobs", type=click.IntRange(0), default=0, show_default=True,
              help="instead of a trace, a seeded hyper-parameter sweep of this many small-model jobs (docs/simulator.md)")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None, help="write PNG plots here")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="--policy live: the gpushare.toml to deploy (default: $GPUSHARE_CONFIG, else /etc/slurm/gpushare.toml, "
                   "else defaults)")
@click.option("--slurm", "release", type=click.Choice(SUPPORTED), default="22.05", show_default=True,
              help="--policy live: the Slurm release")
@click.option("--shard-placement", "placement", type=click.Choice(PLACEMENTS), default="advised", show_default=True,
              help="--policy live: the site's shard placement: what gpushare slurm-config advises for the release "
                   "and share_when, first-fit (no LL_SHARED_GRES) or least-loaded (LL_SHARED_GRES, 24.11+)")
@click.option("--seeds", default=None, help="several seeds, e.g. 0-4 or 0,2,7 (instead of --seed): a table of runs")
@click.option("--workers", type=click.IntRange(1), default=None,
              help="processes for several runs (default: one per core)")
@click.option("--progress/--no-progress", default=None,
              help="a progress bar on stderr for several runs (default: when stderr is a terminal)")
def command(trace_path: str | None, nodes: int, gpus_per_node: int, gpu: str, policy: str, estimator: str | None,
            seed: int, interference: str, throughputs: str | None, data_dir_flag: str | None, no_recovery: bool,
            as_json: bool, plot_dir: str | None, caps: bool | None, sweep_jobs: int = 0, seeds: str | None = None,
            workers: int | None = None, progress: bool | None = None, config_file: str | None = None,
            release: str = "22.05", sacct_path: str | None = None, util_profile: str = "carma-fit",
            placement: str = "advised") -> None:
    """Replay a job trace against simulated GPUs through placement policies (several: comma-separated)."""
    data = data_dir(data_dir_flag)
    policies = [p.strip() for p in policy.lower().split(",") if p.strip()]
    seed_list = _seeds(seeds) if seeds else [seed]
    for name in policies:
        _check(name, estimator or "oracle", gpu)
    deployed = _live(config_file, release, placement) if "live" in policies else None
    path = Path(trace_path) if trace_path else data / TRACE_NAME
    try:
        if sacct_path:
            path = Path(sacct_path)
            jobs = _from_sacct(path, seed_list[0])
        else:
            jobs = hyperparameter_sweep(sweep_jobs, seed_list[0]) if sweep_jobs else read(path, seed=seed_list[0])
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    if len(policies) == 1 and policies[0] in MIG_POLICIES:
        _mig(jobs, gpu, nodes * gpus_per_node, policies[0], as_json)
        return
    if any(name in MIG_POLICIES for name in policies):
        raise click.BadParameter("mig-a/mig-b run alone, not in a list of policies", param_hint="--policy")
    gavel = Path(throughputs) if throughputs else data / THROUGHPUTS_NAME
    if throughputs and not gavel.exists():
        raise click.BadParameter(f"{gavel} does not exist", param_hint="--throughputs")
    configs = [SimConfig(nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, policy=name, seed=s,
                         throughputs=gavel, interference=interference, util=util_profile,
                         **_settings(deployed if name == "live" else None, estimator, caps, no_recovery))
               for name in policies for s in seed_list]
    if len(configs) > 1:
        if sacct_path:  # the batch workers read trace files; convert the export once with gpushare.simulator.sacct
            raise click.BadParameter("one policy and one seed with --sacct (or convert it to a trace first)",
                                     param_hint="--sacct")
        if plot_dir:
            raise click.BadParameter("plots are drawn for one run (one policy, one seed)", param_hint="--plot")
        summaries = batch.run_all(batch.Source(str(path), sweep_jobs), configs, workers, progress)
        click.echo(json.dumps(report.clean({"version": 1, "runs": summaries}), indent=2, allow_nan=False) if as_json
                   else batch.table(summaries))
        return
    config = configs[0]
    sim = simulation(jobs, config).run()
    if as_json:
        report.write_json(sim, sys.stdout)
    else:
        click.echo(report.to_text(report.summarise(sim)))
    if plot_dir:
        from gpushare.simulator import plots  # matplotlib only when asked for

        for written in plots.write(sim, Path(plot_dir)):
            if not as_json:
                click.echo(f"wrote {written}")


def _from_sacct(path: Path, seed: int) -> list[Any]:
    """A sacct export (any release's ``--json`` shape, or ``--parsable2``) as a trace (gpushare.simulator.sacct)."""
    from gpushare.simulator.sacct import convert
    from gpushare.simulator.trace import parse

    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the sacct export: {exc.strerror}") from exc
    return parse(convert(text, str(path)), str(path), seed)


def _live(config_file: str | None, release: str, placement: str = "advised") -> LiveSetup:
    try:
        cfg = load_config(config_file)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from None
    try:
        return setup(cfg, release, placement)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard-placement") from None


def _settings(deployed: LiveSetup | None, estimator: str | None, caps: bool | None,
              no_recovery: bool) -> dict[str, Any]:
    """Estimator, caps and recovery of one run: the options given, else (live) what the stack deploys."""
    if deployed is None:
        return {"estimator": estimator or "oracle", "caps": caps, "recovery": not no_recovery}
    return {"estimator": estimator or "measured", "caps": deployed.caps if caps is None else caps,
            "recovery": deployed.recovery and not no_recovery, "live": deployed}


def _seeds(text: str) -> list[int]:
    """``0-4`` or ``0,2,7`` (or both: ``0-2,9``) as a list of seeds."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise click.BadParameter(f"expected seeds like 0-4 or 0,2,7, got {text!r}", param_hint="--seeds") from None
    if not out:
        raise click.BadParameter(f"no seeds in {text!r}", param_hint="--seeds")
    return out


def _mig(jobs, gpu: str, gpus: int, policy: str, as_json: bool) -> None:
    from gpushare.simulator.mig import run_mix

    model, profile = parse_target(gpu)
    if profile is not None or not model.mig_capable:
        raise click.BadParameter(f"{gpu} is not a MIG-capable whole GPU", param_hint="--gpu")
    result = run_mix(model, jobs, gpus)
    if as_json:
        click.echo(json.dumps({"version": 1, "mig": result}, indent=2))
        return
    scheme = result["scheme_A" if policy == "mig-a" else "scheme_B"]
    base = result["baseline"]
    click.echo(f"MIG {policy}: {result['jobs']} jobs as one batch on {gpus} x {gpu} (arrival times ignored)")
    click.echo(f"makespan {scheme['makespan_s'] / 3600:.2f} h vs {base['makespan_s'] / 3600:.2f} h whole-GPU sequential; "
               f"throughput x{scheme['throughput_jobs_per_h'] / base['throughput_jobs_per_h']:.2f}; "
               f"energy {scheme['energy_mj']:.2f} vs {base['energy_mj']:.2f} MJ; "
               f"{scheme['reconfigurations']} reconfigurations")
