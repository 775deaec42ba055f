"""``gpushare``: the admin command. One module per subcommand, loaded only when that subcommand runs.

Why lazy: ``gpushare status`` on a node must not import PyTorch or matplotlib, and a broken optional
dependency of one subcommand must not break the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

# subcommand name -> "module:attribute" of a click command. Other parts register here.
SUBCOMMANDS: dict[str, str] = {
    "slurm-config": "gpushare.slurm_plugins.slurm_config:command",
    "config": "gpushare.config_cli:command",
    "doctor": "gpushare.slurm_plugins.controller_doctor:command",
    "mig": "gpushare.mig_manager.mig_cli:command",
    "simulate": "gpushare.simulator.cli:command",
    "report": "gpushare.epilog.report_cli:command",
    "jobstats": "gpushare.epilog.jobstats_cli:command",
    "status": "gpushare.agent.status_cli:command",
    "estimates": "gpushare.slurm_plugins.estimates_cli:command",
    "pilot": "gpushare.simulator.pilot_cli:command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in SUBCOMMANDS if _available(name))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, _, attribute = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                return None  # subcommand not built in this version
            raise
        return getattr(module, attribute)


def _available(name: str) -> bool:
    module_name = SUBCOMMANDS[name].partition(":")[0]
    return importlib.util.find_spec(module_name) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slurm-gpushare")
def group() -> None:
    """slurm-gpushare administration: Slurm configuration, checks across hosts, MIG, reports, simulation."""


def main(argv: list[str] | None = None) -> int:
    try:
        result = group.main(args=argv, prog_name="gpushare", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
