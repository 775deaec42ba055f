"""``gpushare config``: check a gpushare.toml and list every setting with its variable and default."""

from __future__ import annotations

import click

from gpushare.config import ConfigError, load_config, settings_table


@click.group()
def command() -> None:
    """Validate the configuration file or list the settings."""


@command.command("check")
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml to check.")
def check(config_path: str | None) -> None:
    """Load the file the way every gpushare program does; one line either way."""
    try:
        cfg = load_config(config_path, warn=False)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if not cfg.from_file:  # nothing to check: this host's programs run on the defaults
        raise click.ClickException(cfg.missing_line())
    click.echo(f"{cfg.source}: ok ({len(cfg.nodes)} node groups, GPUs: {', '.join(sorted({g.gpu for g in cfg.nodes})) or 'none'})")


@command.command("settings")
def settings() -> None:
    """Every setting: config key, environment variable, default, meaning."""
    for key, env, default, doc in settings_table():
        click.echo(f"{key:40} {env:44} {default:32} {doc}")
