"""The `pipeline` command: a click group that each stage extends with its own commands."""

from __future__ import annotations

import click

from pipeline.tools_cli import tools


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shape-broker")
def main() -> None:
    """Shape-aware batching broker for LLM inference pipelines."""


@main.command()
def launch() -> None:
    """Run the whole pipeline on a workload (not available yet: see README)."""
    raise click.ClickException(
        "`pipeline launch` is not available yet: the launcher is built in the issue about "
        "operating the product. The shared-memory rings and the producer API work today "
        "(see README)."
    )


main.add_command(tools)
