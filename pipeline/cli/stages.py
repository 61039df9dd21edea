"""Stage commands: start, stop and query each process of a pipeline on a data directory.

    pipeline broker start --data-dir D [--detach]      pipeline broker stop --data-dir D
    pipeline consumer start --data-dir D --name gpu0   pipeline consumer stop --data-dir D [--name gpu0]
    pipeline produce FILE --data-dir D                 pipeline status --data-dir D [--json]

Foreground stages run until stopped (Ctrl-C or `stop`); `--detach` runs them in the
background with a pid file and a log file in `D/run/` (see pipeline/runtime/daemon.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import click

from pipeline.broker.config import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DISPATCH_POLICIES,
    MAX_HEARTBEAT_TIMEOUT_S,
    MIN_HEARTBEAT_TIMEOUT_S,
    BrokerConfig,
)
from pipeline.broker.selection import SHAPE_ORDERS
from pipeline.cli.common import (
    DISPATCH_HELP,
    ENGINE_OPTIONS_HELP,
    METRICS_TOKEN_HELP,
    SHAPE_ORDER_HELP,
    STORAGE_HELP,
    setup_logging,
)
from pipeline.cli.numbers import FiniteFloat
from pipeline.consumer.engines import ENGINES
from pipeline.runtime import daemon
from pipeline.runtime.datadir import (
    check_data_dir,
    describe_holder,
    launch_lock_path,
    lock_holder,
    prepare_data_dir,
)
from pipeline.runtime.gpus import gpus_per_engine
from pipeline.runtime.madefiles import RESULTS_DIR
from pipeline.runtime.processes import DURABILITY_LEVELS, STORAGE_KINDS
from pipeline.runtime.settings import (
    DEFAULT_MAX_BATCH_ITEMS,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_INPUT_LEN,
    MAX_ITEMS,
    MAX_PRODUCER_PROCESSES,
    check_engine_options,
    check_replay_speed,
)
from pipeline.runtime.tables import broker_config, consumer_settings, parse_assignments, parse_engine_options
from pipeline.wire.errors import BadInputError, PipelineError, ProtocolError, SettingsError
from pipeline.wire.protocol import check_consumer_name
from pipeline.wire.textfiles import counted, for_terminal, printable

# A graceful stop (a batch in hand finished, files closed) gets this long before SIGKILL.
DEFAULT_STOP_TIMEOUT_S = 30.0
# A stop timeout: 0 kills at once; past a day, a stage that ignores SIGTERM would hold the
# command that long.
STOP_TIMEOUT_RANGE_S = (0.0, 86_400.0)
# While its producers wait for the broker (a full disk, a broker that does not answer),
# `produce` says so again this often.
PRODUCE_WAIT_REPORT_S = 30.0

data_dir_option = click.option("--data-dir", required=True, type=click.Path(file_okay=False),
                               help="The pipeline's data directory.")


def _broker_answers(socket_path: str, pid: int | None = None) -> bool:
    """A broker answers on the socket (the one with `pid`, when given)."""
    from pipeline.wire.client import broker_status

    try:
        answered = broker_status(socket_path, timeout_s=1.0)
    except (OSError, TimeoutError, ProtocolError):  # UntrustedPeerError is not "no broker": it says why
        return False
    return pid is None or answered.pid == pid


def _detach(stage: str, data_dir: str, argv: list[str], ready) -> None:
    """Run `pipeline ARGV...` (this command without --detach) in the background."""
    files = daemon.StageFiles.of(BrokerConfig(data_dir).run_dir, stage)
    try:
        pid = daemon.detach(argv, files, ready)
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(f"{stage} did not start: {exc}") from exc
    click.echo(f"{stage} started in the background: pid {pid}, log {files.log_path}")


def _refuse_if_running(stage: str, data_dir: str) -> daemon.StageFiles:
    files = daemon.StageFiles.of(BrokerConfig(data_dir).run_dir, stage)
    running = daemon.running_stage(files.pid_path)
    if running is not None:
        raise click.ClickException(f"{stage} is already running on {data_dir} (pid {running.pid})")
    return files


def _serve_with_pid_file(files: daemon.StageFiles, serve) -> None:
    """Run `serve(on_ready)`; the pid file is written once the stage serves (a broker that
    finds another one on the data directory never touches that one's pid file)."""
    try:
        code = serve(lambda: daemon.write_pid_file(files.pid_path))
    finally:
        daemon.remove_pid_file(files.pid_path)
    sys.exit(code)


# ---------------------------------------------------------------------- broker


@click.group()
def broker() -> None:
    """Start or stop the broker of a data directory."""


@broker.command("start")
@data_dir_option
@click.option("--storage", type=click.Choice(STORAGE_KINDS), default="disk", show_default=True, help=STORAGE_HELP)
@click.option("--durability", type=click.Choice(DURABILITY_LEVELS), default="process", show_default=True)
@click.option("--heartbeat-timeout-s", type=FiniteFloat(MIN_HEARTBEAT_TIMEOUT_S, MAX_HEARTBEAT_TIMEOUT_S),
              default=DEFAULT_HEARTBEAT_TIMEOUT_S, show_default=True,
              help="A consumer silent this long is declared dead.")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port, on the loopback, to your own processes only (or see "
                   "--metrics-token-file).")
@click.option("--metrics-token-file", type=click.Path(dir_okay=False), help=METRICS_TOKEN_HELP)
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="A broker setting, as in a launch config's [broker] table: max_age_s=30, lanes.max_lanes=512 (repeatable).")
@click.option("--shape-order", type=click.Choice(SHAPE_ORDERS), help=SHAPE_ORDER_HELP)
@click.option("--dispatch", type=click.Choice(DISPATCH_POLICIES), help=DISPATCH_HELP)
@click.option("--detach", is_flag=True, help="Run in the background (pid and log files in DATA_DIR/run).")
@click.option("-v", "--verbose", is_flag=True)
def broker_start(data_dir: str, storage: str, durability: str, heartbeat_timeout_s: float,
                 metrics_port: int | None, metrics_token_file: str | None, assignments: tuple[str, ...],
                 shape_order: str | None, dispatch: str | None, detach: bool, verbose: bool) -> None:
    """Run the broker until stopped (Ctrl-C or `pipeline broker stop`)."""
    if shape_order is not None:
        assignments = (*assignments, f"shape_order={shape_order}")
    if dispatch is not None:
        assignments = (*assignments, f"dispatch={dispatch}")
    table = {"heartbeat_timeout_s": heartbeat_timeout_s} | parse_assignments(assignments)
    config = broker_config(data_dir, table, "the command line")  # SettingsError: one line (cli.py)
    metrics_token_file = _checked_token_file(metrics_token_file, metrics_port)
    prepare_data_dir(data_dir)  # created owner-only, or refused if another user could change it
    launcher = lock_holder(launch_lock_path(data_dir))
    if launcher is not None:  # its broker may be starting: this one would take its place
        raise click.ClickException(f"a run is in progress on {data_dir} ({describe_holder(launcher)}, a `pipeline "
                                   f"launch` or `run-batch`, holds {launch_lock_path(data_dir)}): it runs a broker "
                                   f"of its own; use another --data-dir")
    files = _refuse_if_running("broker", data_dir)
    if detach:
        argv = ["broker", "start", "--data-dir", data_dir, "--storage", storage, "--durability", durability,
                "--heartbeat-timeout-s", repr(heartbeat_timeout_s)]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        if metrics_token_file is not None:
            argv += ["--metrics-token-file", metrics_token_file]
        argv += [arg for pair in assignments for arg in ("--set", pair)]
        _detach("broker", data_dir, argv, lambda pid: _broker_answers(config.socket_path, pid))
        return
    from pipeline.runtime.processes import serve_broker

    setup_logging(True)
    def ready(write_pid) -> None:
        write_pid()
        click.echo(f"broker serving {config.socket_path}", err=True)

    _serve_with_pid_file(files, lambda write_pid: serve_broker(
        config, storage, durability, metrics_port=metrics_port, metrics_token_file=metrics_token_file,
        on_ready=lambda: ready(write_pid)))


def _checked_token_file(path: str | None, port: int | None) -> str | None:
    """The metrics token file as an absolute path (a detached broker runs elsewhere), read
    now: one line if it is refused, before anything starts."""
    if path is None:
        return None
    if port is None:
        raise click.ClickException("--metrics-token-file is given without --metrics-port: no metrics are served")
    from pipeline.reporting.metrics_endpoint import read_token_file

    read_token_file(path)  # SettingsError: one line (cli.py)
    return os.path.abspath(path)


@broker.command("stop")
@data_dir_option
@click.option("--timeout-s", type=FiniteFloat(*STOP_TIMEOUT_RANGE_S), default=DEFAULT_STOP_TIMEOUT_S,
              show_default=True,
              help="Graceful stop first; killed after this.")
def broker_stop(data_dir: str, timeout_s: float) -> None:
    """Stop the broker: SIGTERM (it closes its files), SIGKILL after the timeout."""
    files = daemon.StageFiles.of(BrokerConfig(data_dir).run_dir, "broker")
    click.echo(f"broker: {daemon.stop_stage(files.pid_path, timeout_s)}")


# ---------------------------------------------------------------------- consumer


@click.group()
def consumer() -> None:
    """Start or stop consumers (one per GPU) of a data directory's broker."""


@consumer.command("start")
@data_dir_option
@click.option("--name", help="Consumer name (default gpuN with --gpu, else cpu-PID); names its results file.")
@click.option("--model", type=int, default=0, show_default=True)
@click.option("--max-batch", type=int, default=DEFAULT_MAX_BATCH_ITEMS, show_default=True)
@click.option("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, show_default=True)
@click.option("--max-input-len", type=int, default=DEFAULT_MAX_INPUT_LEN, show_default=True)
@click.option("--engine", type=click.Choice(sorted(ENGINES)), default="sim", show_default=True)
@click.option("--engine-options", "engine_options", multiple=True, metavar="KEY=VALUE,...",
              help=ENGINE_OPTIONS_HELP.replace(", over the config file's [engine_options]", "")
              + " Used as given: nothing is filled in for a CPU (see README, Running on vLLM).")
@click.option("--gpu", help="Pin to this GPU: an index or a GPU-/MIG- UUID (CUDA_VISIBLE_DEVICES); an engine over "
                            "several GPUs (tensor or pipeline parallel) takes them comma-separated: 0,1.")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="A consumer setting, as in a launch config's [consumer] table: credit_max_batches=8 (repeatable).")
@click.option("--detach", is_flag=True, help="Run in the background (pid and log files in DATA_DIR/run).")
@click.option("-v", "--verbose", is_flag=True)
def consumer_start(data_dir: str, name: str | None, model: int, max_batch: int, max_batch_tokens: int,
                   max_input_len: int, engine: str, engine_options: tuple[str, ...], gpu: str | None,
                   assignments: tuple[str, ...], detach: bool, verbose: bool) -> None:
    """Run a consumer until stopped (Ctrl-C or `pipeline consumer stop`); it reconnects if
    the broker restarts. Results go to DATA_DIR/results/NAME.jsonl."""
    from pipeline.consumer.config import ConsumerConfig

    if name is None:  # a GPU's UUID may hold '/' (MIG-GPU-.../1/0): not in a file name
        name = re.sub(r"[^A-Za-z0-9._-]", "-", f"gpu{gpu}") if gpu is not None else f"cpu-{os.getpid()}"
    check_consumer_name(name)  # it names a results file and a pid file: before any is touched
    check_data_dir(data_dir)
    config = BrokerConfig(data_dir)
    own = consumer_settings(parse_assignments(assignments), "the command line")
    options = parse_engine_options(engine_options)
    check_engine_options(engine, options)  # a typo is refused here, not in the detached child's log
    if gpu is not None and len(gpu.split(",")) != gpus_per_engine(options):
        raise SettingsError(f"--gpu {gpu}: {len(gpu.split(','))} GPUs for an engine of {gpus_per_engine(options)} "
                            f"(tensor_parallel_size x pipeline_parallel_size in --engine-options): give as many")
    stage = f"consumer-{name}"
    files = _refuse_if_running(stage, data_dir)
    if detach:
        argv = ["consumer", "start", "--data-dir", data_dir, "--name", name, "--model", str(model),
                "--max-batch", str(max_batch), "--max-batch-tokens", str(max_batch_tokens), "--max-input-len",
                str(max_input_len), "--engine", engine]
        if gpu is not None:
            argv += ["--gpu", gpu]
        argv += [arg for value in engine_options for arg in ("--engine-options", value)]
        argv += [arg for pair in assignments for arg in ("--set", pair)]
        _detach(stage, data_dir, argv, lambda pid: _consumer_registered(config.socket_path, name, pid))
        return
    from pipeline.runtime.processes import serve_consumer

    setup_logging(True)
    consumer_config = ConsumerConfig(config.socket_path, os.path.join(data_dir, RESULTS_DIR), name, model=model,
                                     max_batch_items=max_batch, max_batch_tokens=max_batch_tokens,
                                     max_input_len=max_input_len, engine=engine, engine_options=options, gpu=gpu,
                                     **own)
    def serve(write_pid) -> int:
        write_pid()  # a consumer holds no lock: it serves (or retries to) from its start
        return serve_consumer(consumer_config)

    _serve_with_pid_file(files, serve)


def _consumer_registered(socket_path: str, name: str, pid: int) -> bool:
    from pipeline.wire.client import broker_status

    try:
        consumers = broker_status(socket_path, timeout_s=1.0).consumers
    except (OSError, TimeoutError):
        return False
    return name in consumers and consumers[name].pid == pid


@consumer.command("stop")
@data_dir_option
@click.option("--name", help="The consumer to stop (default: every consumer of DATA_DIR).")
@click.option("--timeout-s", type=FiniteFloat(*STOP_TIMEOUT_RANGE_S), default=DEFAULT_STOP_TIMEOUT_S,
              show_default=True,
              help="Graceful stop first (finishes its batch in hand); killed after this.")
def consumer_stop(data_dir: str, name: str | None, timeout_s: float) -> None:
    """Stop consumers: each finishes its batch in hand and says goodbye (batches it held
    but had not started go back to dispatch); SIGKILL after the timeout."""
    run_dir = BrokerConfig(data_dir).run_dir
    if name is not None:
        stages = [f"consumer-{name}"]
    else:
        names = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
        stages = [n[: -len(".pid")] for n in names if n.startswith("consumer-") and n.endswith(".pid")]
    if not stages:
        click.echo("no consumer is running")
    for stage in stages:
        files = daemon.StageFiles.of(run_dir, stage)
        click.echo(f"{stage}: {daemon.stop_stage(files.pid_path, timeout_s)}")


# ---------------------------------------------------------------------- produce and status


@click.command()
@click.argument("workload_file", type=click.Path(dir_okay=False, exists=True))
@data_dir_option
@click.option("--producers", type=click.IntRange(min=1, max=MAX_PRODUCER_PROCESSES), default=1, show_default=True,
              help="Producer processes.")
@click.option("--items", type=click.IntRange(min=1, max=MAX_ITEMS), help="Submit only the first N items.")
@click.option("--replay-speed", type=FiniteFloat(min=0, min_open=True),
              help="Honour the file's timestamps, X times faster.")
def produce(workload_file: str, data_dir: str, producers: int, items: int | None, replay_speed: float | None) -> None:
    """Submit a workload file to the running broker; exits once all of it is stored. While
    the broker cannot store (its disk is full, it is stopped or restarting) the items wait
    in the producer rings, and this command waits and says so; Ctrl-C stops submitting (exit
    130) and says how many items are stored and how many wait in the rings, which the
    broker stores once it can: nothing submitted is lost."""
    from pipeline.producer.workload import load_workload
    from pipeline.runtime.local import ShmNeeds, check_shm_space
    from pipeline.runtime.producer_processes import feed_processes

    check_data_dir(data_dir)
    config = BrokerConfig(data_dir)
    check_replay_speed(replay_speed)
    setup_logging(False)  # a producer's failure is said on stderr
    if not _broker_answers(config.socket_path):
        raise click.ClickException(f"no broker answers on {config.socket_path}: start one first")
    check_shm_space(ShmNeeds(producers, doorbells=0))  # the broker's objects exist: only the rings are new
    try:
        workload = load_workload(workload_file)
    except BadInputError as exc:
        raise click.ClickException(str(exc)) from exc
    if items:
        workload = workload.head(items)
    watch = _StoreWatch(config.socket_path)
    outcome = feed_processes(config.socket_path, workload, producers, replay_speed, on_wait=watch.check,
                             on_stopping=lambda: click.echo(
                                 "produce: stopping: the producers hand over what they submitted once the broker "
                                 "has stored it; Ctrl-C again leaves the rest in the producer rings, where the "
                                 f"broker on {data_dir} stores it later", err=True))
    published, left = published_and_unstored(data_dir, outcome.ledger_entries)
    stored = published - left
    where = (f"; {left:,} wait in the producer rings (a few may be stored already: none is stored twice), "
             f"and the broker on {data_dir} stores them once it can (nothing is lost)" if left else "")
    unsent = len(workload) - published
    never = f"; {unsent:,} were never submitted: submit them again" if unsent else ""
    if outcome.failed:
        raise click.ClickException(f"producers failed or were killed: {outcome.failed:,} of {producers:,}; "
                                   f"{stored:,} of {counted(len(workload), 'item')} stored{where}{never}")
    if outcome.interrupted:
        click.echo(f"interrupted: {stored:,} of {counted(len(workload), 'item')} stored{where}{never}", err=True)
        sys.exit(130)
    click.echo(f"submitted {counted(len(workload), 'item')}, {counted(workload.total_tokens, 'token')}: all stored")


class _StoreWatch:
    """What `produce` says while its producers wait for the broker: a full disk, a broker that
    does not answer, and when it stores again. Owner: the produce command's main thread."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.state = "storing"
        self.said_s = 0.0

    def check(self, published: int) -> None:
        from pipeline.wire.client import broker_status

        try:
            state = "disk full" if broker_status(self.socket_path, timeout_s=1.0).disk_full else "storing"
        except (OSError, TimeoutError, PipelineError):
            state = "not answering"
        now_s = time.monotonic()
        if state == self.state and (state == "storing" or now_s - self.said_s < PRODUCE_WAIT_REPORT_S):
            return
        self.state, self.said_s = state, now_s
        if state == "disk full":
            click.echo(f"produce: the broker's disk is full; {published:,} items submitted so far, the rest of "
                       f"what is submitted waits in the producer rings until space comes back (Ctrl-C stops "
                       f"submitting; nothing submitted is lost)", err=True)
        elif state == "not answering":
            click.echo(f"produce: the broker does not answer on {self.socket_path}; submitted items wait in the "
                       f"producer rings until a broker runs on this data directory", err=True)
        else:
            click.echo("produce: the broker stores again", err=True)


def published_and_unstored(data_dir: str, ledger_entries: list[tuple[int, int]]) -> tuple[int, int]:
    """Items the producers of `ledger_entries` (producer id, items its ledger says it
    published) published, and how many of them their rings still hold unreleased (rings
    left behind: a producer that was killed, or stopped before the broker stored everything).

    Published: the ledger's count, or one past the highest sequence a ring holds where that
    is more. The ledger counts a frame once it is published, so a producer killed between
    publishing and recording its last frame left that frame in its ring, where it is found
    (if the broker stored it meanwhile, it is resubmitted: at-least-once). A record the
    broker stored in part and has not released yet counts as unstored whole: an upper bound
    by at most a frame."""
    from pipeline.broker.peers import namespace_for, producer_ring_name
    from pipeline.reporting.accounting import published_counts
    from pipeline.runtime.inventory import producer_ring_names, ring_stock

    namespace = namespace_for(data_dir)
    ours = {producer_ring_name(namespace, producer_id) for producer_id, _published in ledger_entries}
    in_rings = ring_stock(name for name in producer_ring_names(data_dir) if name in ours).item_ids
    return sum(published_counts(ledger_entries, in_rings).values()), int(in_rings.size)


# The broker status fields `status` shows beside the report (in their wire form in --json).
STATUS_FIELDS: tuple[str, ...] = (
    "backlog_items", "backlog_tokens", "pending_items", "consumers", "shapes", "lanes_in_use", "top_shapes",
    "disk_full", "peers_refused", "peers_shed", "stalls", "stalled_s",
)


def _say_service(data_dir: str, as_json: bool) -> bool:
    """A batch service's batches (`pipeline serve`'s data directory), a line each; False
    where `data_dir` is not one."""
    from pipeline.service.status import service_status

    found = service_status(data_dir)
    if found is None:
        return False
    if as_json:
        click.echo(json.dumps(found, indent=2, sort_keys=True))
        return True
    server = f"pid {found['server']} serves it" if found["server"] else "no server runs on it"
    _say(f"batch service ({server}): {counted(len(found['batches']), 'batch', 'batches')}")
    for batch in found["batches"]:
        counts = batch["request_counts"]
        _say(f"{batch['id']} {batch['status']} ({printable(batch['owner'])}): {counts['completed']:,} completed, "
             f"{counts['failed']:,} failed of {counted(counts['total'], 'request')}; expires at {batch['expires_at']}")
    return True


def _say_job(found: dict, data_dir: str) -> None:
    """A batch job's view, from its own files (running or stopped)."""
    from pipeline.batchjob.jobstatus import CHECKING
    from pipeline.batchjob.progress import format_duration

    if found["state"] == CHECKING:
        click.echo(f"job {CHECKING} (its process runs): no request runs before the check ends")
        return
    rate = found.get("requests_per_s")
    eta = f", ETA {format_duration(found.get('eta_s'))}" if found.get("eta_s") and found["running"] else ""
    pace = f", {rate:,.0f} requests/s" if rate and found["running"] else ""
    port = found.get("metrics_port")
    metrics = f"; metrics on http://127.0.0.1:{port}/metrics" if port is not None and found["running"] else ""
    _say(f"job {printable(found['state'])}{' (its process runs)' if found['running'] else ''}: {found['done']:,} of "
         f"{counted(found['requests'], 'request')} answered, {found['failed']:,} failed, {found['to_do']:,} to do"
         f"{pace}{eta}; input {printable(found['input'])}, output {printable(found['output'])}{metrics}")
    changed = found.get("input_changed")
    command = f"the same run-batch command (with --data-dir {printable(data_dir)})"
    if not found["running"] and found["state"] != "completed" and changed:
        _say(f"its input changed ({changed}), and a run refuses it: with the input as it was, {command} finishes the "
             f"job; to run the file as it is now, give another --data-dir")
    elif not found["running"] and found["to_do"]:
        _say(f"{command} finishes it")
    elif not found["running"] and found["state"] != "completed":
        _say(f"{command} writes its output")


def _say(line: str) -> None:
    """A line of `status` on stdout, with what a terminal would act on escaped."""
    click.echo(for_terminal(line))


@click.command()
@data_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable: the report's counters and more.")
@click.option("--results-dir", type=click.Path(file_okay=False),
              help="Results files to account (default DATA_DIR/results).")
def status(data_dir: str, as_json: bool, results_dir: str | None) -> None:
    """The running broker's counters, backlog and consumers, with the results accounted; on
    a batch job's data directory, the job (running or stopped) in its requests; on a batch
    service's (`pipeline serve`), each batch's status and requests."""
    from pipeline.reporting.accounting import ResultsSummary, summarize_results
    from pipeline.reporting.report import build_report, render_report
    from pipeline.wire.client import broker_status

    from pipeline.batchjob.jobstatus import job_status

    if not os.path.isdir(data_dir):
        raise click.ClickException(f"no data directory at {printable(data_dir)}")
    check_data_dir(data_dir)
    if _say_service(data_dir, as_json):
        return
    job = job_status(data_dir)
    config = BrokerConfig(data_dir)
    try:
        counters = broker_status(config.socket_path)
    except (OSError, TimeoutError) as exc:
        if job is None:
            raise click.ClickException(f"no broker answers on {config.socket_path} ({exc})") from exc
        if as_json:
            click.echo(json.dumps({"job": job}, indent=2, sort_keys=True))
        else:
            _say_job(job, data_dir)
        return
    except ProtocolError as exc:  # an error reply, or a status of another version: never misread
        raise click.ClickException(f"cannot read the status of the broker on {config.socket_path} ({exc})") from exc
    # A job's results are its answer log's to count: reading every row of a large job here
    # would take as long as the job's own collecting did.
    results = summarize_results(results_dir or os.path.join(data_dir, RESULTS_DIR)) \
        if results_dir or job is None else ResultsSummary()
    # The broker's uptime is the window its busy counters cover (the results span runs).
    report = build_report(counters, results, counters.uptime_s, makespan_s=counters.uptime_s)
    # NOTE: a live broker's counters cover its own life only, while results files span
    # restarts and runs: `lost` and the verdict would be noise. The end of a run (launch's
    # report, or `pipeline tools verify`) is where the accounting is checked.
    report.update(lost=None, accounting_ok=None)
    wire = counters.to_wire()
    report.update({key: wire[key] for key in STATUS_FIELDS})
    if job is not None:
        report["job"] = job
        if not as_json:
            _say_job(job, data_dir)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    render_report(report)
    _say(f"backlog {report['backlog_items']} items / {report['backlog_tokens']} tokens, "
         f"pending {report['pending_items']}, consumers: {', '.join(report['consumers']) or 'none'}; "
         f"peers refused {report['peers_refused']}, shed {report['peers_shed']}; "
         f"broker stalls {report['stalls']} ({report['stalled_s']:.1f} s)"
         + ("; DISK FULL: ingest paused" if report["disk_full"] else ""))
