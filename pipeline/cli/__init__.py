"""The `pipeline` command: a click group that each stage extends with its own commands.

Every command runs owner-only (umask 077: what it creates is 0700 / 0600 whatever the
caller's umask) and turns the outside world's failures (a PipelineError, a shared-memory
error, an OSError naming a path) into one line on stderr and exit status 1, never a
traceback: a traceback is for our own bugs. An error's message reaches the terminal with
what a terminal would act on escaped (`for_terminal`: a path holding ESC or CR).
"""

from __future__ import annotations

import errno

import click

from pipeline.cli.batch import run_batch
from pipeline.cli.lab import bench
from pipeline.cli.launch import launch
from pipeline.cli.serve import serve
from pipeline.cli.stages import broker, consumer, produce, status
from pipeline.cli.tools import tools
from pipeline.runtime.datadir import owner_only_umask
from pipeline.wire.errors import PipelineError, ShmError
from pipeline.wire.textfiles import for_terminal


class _Commands(click.Group):
    """The group, with the one-line error rule of the module docstring."""

    def invoke(self, ctx: click.Context):
        owner_only_umask()
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            exc.message = for_terminal(exc.message)
            raise
        except (PipelineError, ShmError) as exc:
            raise click.ClickException(for_terminal(str(exc))) from exc
        except OSError as exc:
            if exc.errno == errno.EBADF:  # a descriptor we closed: our bug, with its traceback
                raise
            where = f" ({exc.filename})" if exc.filename and str(exc.filename) not in str(exc) else ""
            raise click.ClickException(for_terminal(f"{exc}{where}")) from exc


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shape-broker")
def main() -> None:
    """Shape-aware batching broker for LLM inference pipelines."""


for command in (launch, run_batch, serve, broker, consumer, produce, status, tools, bench):
    main.add_command(command)
