"""The `andrea` command: parses arguments and calls the package. No logic lives here."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from andrea.errors import UserError

app = typer.Typer(
    help="andrea: train, evaluate and sample ANDREA GPT-style language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

ConfigOpt = Annotated[
    str, typer.Option("--config", "-c", help="YAML config: a path, or a bundled preset name.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key, e.g. --set train.lr=3e-4 (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


def _load(config: str, overrides: list[str] | None):
    from andrea.config import load_config

    return load_config(config, overrides or [])


@config_app.command("show")
def config_show(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Print the resolved config (file + overrides + derived values) as YAML."""
    typer.echo(_load(config, set_).to_yaml(), nl=False)


@app.command("count-params")
def count_params_cmd(config: ConfigOpt, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Count parameters by group (built on the meta device; checked against the formula)."""
    from andrea.params import count_params, format_counts

    counts = count_params(_load(config, set_).model)
    typer.echo(json.dumps(counts.as_dict(), indent=2) if as_json else format_counts(counts))


def main() -> None:
    """Entry point: bad input becomes one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


