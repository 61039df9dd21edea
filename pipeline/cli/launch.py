"""`pipeline launch`: the whole pipeline on one node, from a workload to a report."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import click

from pipeline.broker.config import DISPATCH_POLICIES
from pipeline.broker.selection import SHAPE_ORDERS
from pipeline.cli.engine_flags import (
    CONTEXT_SETTINGS,
    VLLM_FLAGS_HELP,
    EngineFlags,
    engine_flag_options,
    own_option_names,
)
from pipeline.cli.common import (
    DISPATCH_HELP,
    ENGINE_OPTIONS_HELP,
    MAX_BATCH_TOKENS_HELP,
    METRICS_TOKEN_HELP,
    SHAPE_ORDER_HELP,
    STORAGE_HELP,
    check_ray,
    setup_logging,
)
from pipeline.cli.numbers import FiniteFloat
from pipeline.consumer.engines import ENGINES
from pipeline.runtime.processes import DURABILITY_LEVELS, STORAGE_KINDS
from pipeline.runtime.preflight import check_before_start
from pipeline.runtime.settings import DEMO_ITEMS, LaunchSettings, workload_vocab_size
from pipeline.runtime.tables import merged, parse_assignments, parse_engine_options
from pipeline.wire.errors import BadInputError, PipelineError
from pipeline.wire.status import BrokerStatus

# What `--vocab-size` says in `pipeline launch --help`.
VOCAB_SIZE_HELP = ("Made-up token ids (demo, Mooncake trace) are drawn below this (default: a vllm model's "
                   "config.json vocab_size, else 32000).")


def load_launch_workload(settings: LaunchSettings, vocab_size: int):
    """The workload the settings name: "demo", "demo-chat" or "demo-template" (DEMO_ITEMS unless
    `items`), or a JSON-lines file validated whole before anything starts (WorkloadError names every bad line); made-up
    token ids below `vocab_size`."""
    from pipeline.producer.demos import named_workload

    return named_workload(settings.workload, settings.items, seed=settings.workload_seed, vocab_size=vocab_size,
                          default_items=DEMO_ITEMS)


@click.command(context_settings=CONTEXT_SETTINGS, epilog=VLLM_FLAGS_HELP)
@click.option("--data-dir", type=click.Path(file_okay=False), help="Data directory (default: a temporary one, removed after).")
@click.option("--workload", help="'demo' (default), 'demo-chat' (multi-turn conversations), 'demo-template' (64 long "
                                 "templates) or a JSON-lines file "
                                 "(own format or a Mooncake trace).")
@click.option("--items", type=int, help="Run only the first N items (demo, demo-chat, demo-template: how many to generate).")
@click.option("--producers", type=int, help="Producer processes (default 2).")
@click.option("--consumers", type=int, help="Consumer processes (default: one per engine's GPUs, else 2 CPU consumers).")
@click.option("--engine", type=click.Choice(sorted(ENGINES)), help="Engine runtime of the consumers (default sim).")
@click.option("--engine-options", "engine_options", multiple=True, metavar="KEY=VALUE,...", help=ENGINE_OPTIONS_HELP)
@click.option("--vocab-size", type=int, help=VOCAB_SIZE_HELP)
@click.option("--shape-order", type=click.Choice(SHAPE_ORDERS), help=SHAPE_ORDER_HELP)
@click.option("--dispatch", type=click.Choice(DISPATCH_POLICIES), help=DISPATCH_HELP)
@click.option("--storage", type=click.Choice(STORAGE_KINDS), help=STORAGE_HELP)
@click.option("--durability", type=click.Choice(DURABILITY_LEVELS), help="Disk durability (default process).")
@click.option("--max-batch", type=int, help="Consumer contract: items per batch (default 64).")
@click.option("--max-batch-tokens", type=int, help=MAX_BATCH_TOKENS_HELP)
@click.option("--max-input-len", type=int, help="Consumer contract: longest prompt (default 8192).")
@click.option("--replay-speed", type=FiniteFloat(min=0, min_open=True),
              help="Honour the workload's timestamps, X times faster.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), help="TOML file of these options.")
@click.option("--report", type=click.Path(dir_okay=False), help="Write the run report as JSON here.")
@click.option("--plots", type=click.Path(file_okay=False), help="Write PNG charts here (needs matplotlib).")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0: any free port), on the "
                                               "loopback, to your own processes only (or see --metrics-token-file).")
@click.option("--metrics-token-file", type=click.Path(dir_okay=False), help=METRICS_TOKEN_HELP)
@click.option("--workload-seed", type=int, help="Seed of the generated workloads (default 0).")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="A setting of the config file's form, e.g. broker.max_age_s=30, broker.lanes.max_lanes=512, "
                   "consumer.credit_max_batches=8 (repeatable; over the file's value).")
@click.option("-v", "--verbose", is_flag=True, help="Log every process's info messages to stderr.")
@click.option("--ray", "ray_address", metavar="ADDRESS|auto",
              help="Run on a Ray cluster (pip install 'shape-broker[ray]'): one broker and its consumers per node, "
                   "each shape's items on one node.")
@click.option("--ray-node-dir", type=click.Path(file_okay=False),
              help="With --ray: the directory on each node's own disk under which its data directory is made.")
@engine_flag_options(jobs=False)
@click.pass_context
def launch(ctx: click.Context, config_path: str | None, verbose: bool, assignments: tuple[str, ...],
           engine_options: tuple[str, ...], shape_order: str | None, dispatch: str | None, ray_address: str | None,
           ray_node_dir: str | None, **options) -> None:
    """Run a workload through a broker, producers and one consumer per GPU, with live
    progress, then print the run report. With no arguments: the demo, on the embedded
    defaults (disk tier, sim engine), in a temporary data directory."""
    setup_logging(verbose)
    if ray_address is not None:
        check_ray(ray_address)
    if shape_order is not None:
        assignments = (*assignments, f"broker.shape_order={shape_order}")
    if dispatch is not None:
        assignments = (*assignments, f"broker.dispatch={dispatch}")
    flags = None
    try:
        try:
            given = parse_engine_options(engine_options) if engine_options else {}
            flags = EngineFlags.take(options, ctx.args, given)
            settings = LaunchSettings.resolve(config_path, merged(options | {"engine_options": given or None},
                                                                  parse_assignments(assignments)))
            settings = context_bounds_input(flags.applied(settings, own_option_names(launch)), options)
            check_before_start(settings)
            flags.start_check(settings)
            vocab_size, vocab_from = workload_vocab_size(settings)
            workload = load_launch_workload(settings, vocab_size)
            if ray_address is not None:  # the nodes start their own engines: vLLM's verdict first
                flags.verdict(wait=True)
        except (BadInputError, PipelineError) as exc:
            raise click.ClickException(str(exc)) from exc
        code = _launch(settings, workload, vocab_size, vocab_from, flags, ray_address, ray_node_dir)
    finally:
        if flags is not None:
            flags.close()
    sys.exit(code)


def _launch(settings: LaunchSettings, workload, vocab_size: int, vocab_from: str, flags: EngineFlags,
            ray_address: str | None, ray_node_dir: str | None) -> int:
    """The run, on this machine or a Ray cluster; its exit status."""
    from pipeline.runtime.launcher import Launcher

    if settings.plots and importlib.util.find_spec("matplotlib") is None:  # before the run, not after
        raise click.ClickException("--plots needs matplotlib: pip install 'shape-broker[plots]'")
    if ray_address is not None:
        return _launch_on_ray(settings, workload, ray_address, ray_node_dir)
    launcher = Launcher(settings, workload)
    launcher.engine_check = lambda stop: flags.verdict(True, stop)
    click.echo(f"launch: {workload!r}, {settings.producers} producers, storage {settings.storage}"
               + _engine_line(settings, launcher, vocab_size, vocab_from), err=True)
    try:
        try:
            outcome = _run_with_progress(launcher, len(workload))
        except (ValueError, RuntimeError, TimeoutError, OSError) as exc:  # OSError: a metrics port in use
            raise click.ClickException(str(exc)) from exc
        return _finish(settings, outcome)
    finally:
        launcher.cleanup()  # a temporary data directory stays only for a failed run's unfinished work


def context_bounds_input(settings: LaunchSettings, options: dict) -> LaunchSettings:
    """Where the engine's context (max_model_len) is given and --max-input-len is not, the
    longest prompt is the context less one token (vLLM needs room for one output token)."""
    context = settings.engine_options.get("max_model_len")
    if options.get("max_input_len") is not None or not isinstance(context, int) or context < 2:
        return settings
    settings = replace(settings, max_input_len=context - 1)
    settings.checked("the command line")
    return settings


def _launch_on_ray(settings: LaunchSettings, workload, address: str, node_dir: str | None) -> int:
    """The workload on a Ray cluster (`pipeline/cluster/`); its exit status."""
    from pipeline.cluster.batch import run_workload_on_cluster
    from pipeline.cluster.driver import ClusterError

    click.echo(f"launch: {workload!r} on the Ray cluster at {address}", err=True)
    try:
        return run_workload_on_cluster(settings, workload, address, node_dir)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc


def _engine_line(settings: LaunchSettings, launcher, vocab_size: int, vocab_from: str) -> str:
    """The launch line's engine part: nothing for the sim engine on its defaults (the line
    reads as it always did); else the engine, what the launcher filled in for this machine,
    and where the token ids' vocabulary came from."""
    if settings.engine == "sim" and vocab_from == "the default":
        return ""
    line = f", engine {settings.engine}"
    if launcher.engine_filled:
        shown = ", ".join(f"{key}={value!r}" for key, value in launcher.engine_filled.items())
        line += f" (no GPU found: filled in {shown})"
    return line + f", token ids below {vocab_size:,} ({vocab_from})"


def _run_with_progress(launcher, workload_items: int):
    from pipeline.reporting.progress import LiveProgress, ProgressTracker

    tracker = ProgressTracker(workload_items)
    with LiveProgress() as live:
        def show(status: BrokerStatus, now_s: float) -> None:
            if not tracker.observations:  # what the broker took over from a stopped run is work too
                tracker.expected_items = workload_items + status.items_recovered + status.items_adopted
            tracker.observe(status, now_s)
            live.update(tracker.snapshot(), now_s)

        launcher.on_status = show
        launcher.on_metrics = lambda port: click.echo(f"metrics: http://127.0.0.1:{port}/metrics", err=True)
        outcome = launcher.run()
    outcome.history = tracker.history
    return outcome


def _finish(settings: LaunchSettings, outcome, resume: str | None = None) -> int:
    """Print and write the report (and plots); the exit status. `resume`: the command that
    completes a stopped run (default: `pipeline launch` on its data directory)."""
    from pipeline.reporting.report import render_report, write_report_json

    report = outcome.report
    report["outcome"] = outcome.why
    report["data_dir_kept"] = outcome.data_dir_kept
    render_report(report)
    if settings.report:
        write_report_json(report, settings.report)
        click.echo(f"report: {settings.report}", err=True)
    if settings.plots and outcome.history:
        from pipeline.reporting.plots import write_plots

        for path in write_plots(outcome.history, settings.plots):
            click.echo(f"plot: {path}", err=True)
    elif settings.plots:
        click.echo("plots: none (the run ended before the first progress sample)", err=True)
    if settings.data_dir or outcome.data_dir_kept:
        click.echo(f"results: {outcome.results_dir}", err=True)
    if outcome.why not in ("completed", "interrupted"):
        click.echo(f"launch failed: {outcome.why}", err=True)
    unfinished = report.get("items_unfinished") or 0
    if unfinished and report.get("store_kept"):
        kept = "kept (the temporary data directory stays for them)" if outcome.data_dir_kept else "kept"
        again = resume or f"pipeline launch --data-dir {outcome.data_dir}"
        click.echo(f"launch: {unfinished:,} unfinished items are {kept} in {outcome.data_dir}; "
                   f"`{again}` completes them", err=True)
    if report.get("lost"):
        click.echo(f"launch: {report['lost']:,} items are lost (e.g. item ids {report['lost_examples'][:5]})",
                   err=True)
        return 1
    damaged = (report.get("items_corrupt") or 0) + (report.get("items_undeliverable") or 0)
    if damaged:
        click.echo(f"launch: {damaged:,} items could not be delivered (damaged: see the logs and "
                   f"`pipeline tools verify`)", err=True)
        return 1
    if outcome.why == "completed" and not report.get("accounting_ok", False):
        click.echo("launch: the accounting does not balance (see the report)", err=True)
        return 1
    if report.get("engine_counters_agree") is False:
        click.echo("launch: an engine's own prefix-cache counters disagree with ours over the same requests "
                   "(see the report's per-consumer rows)", err=True)
        return 1
    return outcome.exit_code
