"""The `pipeline` command: a click group that each stage extends with its own commands."""

from __future__ import annotations

import click

from pipeline.launch_cli import launch
from pipeline.stages_cli import broker, consumer, produce, status
from pipeline.tools_cli import tools


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shape-broker")
def main() -> None:
    """Shape-aware batching broker for LLM inference pipelines."""


for command in (launch, broker, consumer, produce, status, tools):
    main.add_command(command)
