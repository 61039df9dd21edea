"""`pipeline bench`: the laboratory's command in the product's. Its code is the lab's
(`lab/cli.py`), imported when the command runs and never with the product, so `pipeline`
runs without the lab's packages (ARCHITECTURE.md's `lazy` block allows this one import)."""

from __future__ import annotations

import click

# The one line that says how to get what the lab needs, where it cannot be imported.
LAB_INSTALL = "pip install 'shape-broker[lab]'"


def _lab_bench() -> click.Group:
    try:
        from lab.cli import bench
    except ImportError as exc:
        raise click.ClickException(f"`pipeline bench` needs the lab and its packages: {LAB_INSTALL} ({exc})") from exc
    return bench


class _LabGroup(click.Group):
    """A group whose subcommands are the lab's, loaded the first time one is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return _lab_bench().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return _lab_bench().get_command(ctx, cmd_name)


bench = _LabGroup("bench", help="Measure the product against what users would pick instead, side by side in one run.")
