"""`pipeline run-batch`: an OpenAI Batch file of chat or completion requests through the
pipeline, into an output file of one response line per request; resumable.

The flags of `vllm run-batch` where they mean the same (-i, -o, --model,
--served-model-name), and the product's own (data directory, output order, error file,
producers, consumers, the consumer contract, engine, config file). This module parses them
and calls the job: its plan is `pipeline/batchjob/plan.py`'s, the job itself `job.py`'s. The same command again finishes a
stopped job.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from pipeline.batchjob.job import BatchJob
from pipeline.batchjob.spec import JobSpec, JobSummary
from pipeline.batchjob.manifest import load_manifest
from pipeline.batchjob.plan import DEFAULT_DATA_DIR_SUFFIX, SUMMARY_SUFFIX, JobAsk, plan_job
from pipeline.batchjob.progress import JobView, format_job_line
from pipeline.batchjob.tools import tool_calling
from pipeline.batchjob.workload import DEFAULT_PROMPT_MEMORY_LIMIT_BYTES, DEFAULT_PROMPT_TIME_LIMIT_S, PromptLimits
from pipeline.cli.engine_flags import (
    CONTEXT_SETTINGS,
    VLLM_FLAGS_HELP,
    EngineFlags,
    engine_flag_options,
    own_option_names,
)
from pipeline.cli.common import (
    ENGINE_OPTIONS_HELP,
    MAX_BATCH_TOKENS_HELP,
    METRICS_TOKEN_HELP,
    check_ray,
    default_engine,
    setup_logging,
)
from pipeline.cli.numbers import FiniteFloat
from pipeline.consumer.engines import ENGINES
from pipeline.reporting.report import store_damage_note
from pipeline.runtime.tables import parse_engine_options
from pipeline.wire.errors import BadInputError, DataDirMovedError, PipelineError, SettingsError
from pipeline.wire.textfiles import counted, for_terminal, printable

# With --ray, each node's data directory is made under this name in its temporary directory
# (short: the broker's Unix socket path must stay within 108 bytes).
RAY_NODE_DIR_DEFAULT = "sbrk-ray"
# Limits of the prompt limits' options: a second to a day, 64 MiB to 1 TiB.
PROMPT_TIME_LIMIT_RANGE_S = (1.0, 86_400.0)
PROMPT_MEMORY_LIMIT_RANGE_MB = (64, 1 << 20)
# A progress line this often when stderr is not a terminal (a log file of an hour-long job
# stays ~700 lines).
LOG_INTERVAL_S = 5.0


@click.command("run-batch", context_settings=CONTEXT_SETTINGS, epilog=VLLM_FLAGS_HELP)
@click.option("-i", "--input-file", "input_file", required=True, type=click.Path(dir_okay=False),
              help="The requests: an OpenAI Batch file (JSON lines; /v1/chat/completions, /v1/completions).")
@click.option("-o", "--output-file", "output_file", required=True, type=click.Path(dir_okay=False),
              help="The responses, one line per request.")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The model directory: its tokenizer and chat template (and, for vllm, its weights).")
@click.option("--served-model-name", help="The model name requests must ask for (default: the directory's name).")
@click.option("--data-dir", type=click.Path(file_okay=False),
              help=f"The job's data directory (default: the output file's name with {DEFAULT_DATA_DIR_SUFFIX}, "
                   f"removed once the output is written). The same command on it resumes the job.")
@click.option("--output-order", type=click.Choice(["input", "completion"]), default="input", show_default=True,
              help="input: the input file's order, written at the end; completion: each answer appended as it comes, "
                   "so the output can be read while the job runs.")
@click.option("--error-file", type=click.Path(dir_okay=False),
              help="Failed requests go here, and only successes to the output (as OpenAI's batches do).")
@click.option("--overwrite", is_flag=True, help="Replace output, error, summary and report files that exist.")
@click.option("--summary-file", type=click.Path(dir_okay=False),
              help=f"The job's summary as JSON (default: the output file's name with {SUMMARY_SUFFIX}).")
@click.option("--engine", type=click.Choice(sorted(ENGINES)),
              help="Engine of the consumers (default vllm where it is installed; sim makes up outputs).")
@click.option("--engine-options", "engine_options", multiple=True, metavar="KEY=VALUE,...", help=ENGINE_OPTIONS_HELP)
@click.option("--producers", type=int, help="Producer processes: they tokenize (default: the cores, at most 16).")
@click.option("--consumers", type=int, help="Consumer processes (default: one per engine's GPUs, else 2).")
@click.option("--max-batch", type=int, help="Consumer contract: items per batch (default 64).")
@click.option("--max-batch-tokens", type=int, help=MAX_BATCH_TOKENS_HELP)
@click.option("--max-input-len", type=int,
              help="Longest prompt run (default: the model's context less one token); longer ones are answered 400.")
@click.option("--prompt-time-limit-s", type=FiniteFloat(*PROMPT_TIME_LIMIT_RANGE_S),
              default=DEFAULT_PROMPT_TIME_LIMIT_S, show_default=True,
              help="Longest the chat template and tokenizer may take on one request; past it, that request is "
                   "answered 400.")
@click.option("--prompt-memory-limit-mb", type=click.IntRange(*PROMPT_MEMORY_LIMIT_RANGE_MB),
              default=DEFAULT_PROMPT_MEMORY_LIMIT_BYTES >> 20, show_default=True,
              help="Memory the chat template and tokenizer may take in a producer beyond its tokenizer; past it, "
                   "the request is answered 400.")
@click.option("--tool-call-parser", help="vLLM's: the parser of tool calls in answers (this job reads hermes).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="vLLM's: tool_choice auto (the default with tools) reads tool calls; needs --tool-call-parser.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), help="TOML file of launch options.")
@click.option("--report", type=click.Path(dir_okay=False), help="Write the full run report as JSON here.")
@click.option("--metrics-port", type=int,
              help="Serve Prometheus metrics on this port (0: any free one, said at the start), as `pipeline launch` "
                   "does.")
@click.option("--metrics-token-file", type=click.Path(dir_okay=False), help=METRICS_TOKEN_HELP)
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE", help="A setting of the config file's form.")
@click.option("--keep-data-dir", is_flag=True, help="Keep the default data directory after the output is written.")
@click.option("-v", "--verbose", is_flag=True, help="Log every process's info messages to stderr.")
@click.option("--ray", "ray_address", metavar="ADDRESS|auto",
              help="Run on a Ray cluster (pip install 'shape-broker[ray]'): one broker and its consumers per node, "
                   "each shape's items on one node.")
@click.option("--ray-node-dir", type=click.Path(file_okay=False),
              help="With --ray: the directory on each node's own disk under which its data directory is made "
                   f"(default: {RAY_NODE_DIR_DEFAULT}-JOB in the system's temporary directory).")
@click.option("--ray-route", type=click.Choice(["shape", "round-robin"]), default="shape", show_default=True,
              help="With --ray: shape-affine routing, or round-robin over nodes (the baseline an actor pool is).")
@click.option("--input-scan", "input_scan", hidden=True, metavar="PREFIX",
              help="The batch service's scan of the input at upload (PREFIX.index, PREFIX.lines), adopted by a new "
                   "job instead of reading the input again (pipeline/batchjob/prescan.py).")
@click.option("--node", "node_dir", hidden=True, type=click.Path(file_okay=False),
              help="The data directory of a node that serves already (the batch service's, `pipeline.runtime.node`): "
                   "the job's producers feed its broker, and its answers are read from its consumers' results.")
@engine_flag_options(jobs=True)
def run_batch(input_file: str, output_file: str, model_dir: str, served_model_name: str | None,
              data_dir: str | None, output_order: str, error_file: str | None, overwrite: bool,
              summary_file: str | None, engine: str | None, engine_options: tuple[str, ...],
              prompt_time_limit_s: float, prompt_memory_limit_mb: int, config_path: str | None,
              assignments: tuple[str, ...], keep_data_dir: bool, verbose: bool, ray_address: str | None,
              ray_node_dir: str | None, ray_route: str, tool_call_parser: str | None, enable_auto_tool_choice: bool,
              input_scan: str | None, node_dir: str | None, **options) -> None:
    """Run an OpenAI Batch file through the broker and consumers and write one response line
    per request to the output file; run it again on the same data directory to resume."""
    setup_logging(verbose)
    if ray_address is not None:
        check_ray(ray_address)
    flags = None
    try:
        try:
            given = parse_engine_options(engine_options) if engine_options else {}
            flags = EngineFlags.take(options, click.get_current_context().args, given)
            flags.check = node_dir is None  # the node's owner checked its engine
            ask = JobAsk(input_file, output_file, model_dir, served_model_name, data_dir, output_order, error_file,
                         overwrite, summary_file, engine or default_engine(), config_path, assignments, keep_data_dir,
                         PromptLimits(prompt_time_limit_s, prompt_memory_limit_mb << 20), options)
            spec = plan_job(ask, flags, own_option_names(run_batch))
            spec.tool_calling = tool_calling(tool_call_parser, enable_auto_tool_choice)
            spec.input_scan = input_scan
            spec.node_dir = os.path.abspath(node_dir) if node_dir is not None else None
            if node_dir is not None and (ray_address is not None or spec.settings.metrics_port is not None):
                raise SettingsError("--node: a job on a node that serves already starts no cluster run (--ray) and "
                                    "serves no metrics (--metrics-port)")
            if ray_address is not None and spec.settings.metrics_port is not None:  # bound by prepare, never served
                raise SettingsError("metrics_port: a job on a Ray cluster (--ray) serves no metrics; drop "
                                    "--metrics-port")
            if ray_address is not None and spec.settings.engine_options.get("lora_modules"):  # nodes serve model 0
                raise SettingsError("--lora-modules: a job on a Ray cluster (--ray) serves the base model only")
            if ray_address is not None:  # the nodes start their own engines: vLLM's verdict first
                flags.verdict(wait=True)
            job = BatchJob(spec, say=_say, show=_Progress())
            job.engine_verdict = flags.verdict
            _prepare(job)
        except (BadInputError, PipelineError) as exc:
            raise click.ClickException(str(exc)) from exc
        code = _run(job, spec, ray_address, ray_route, ray_node_dir)
    finally:
        if flags is not None:
            flags.close()
    sys.exit(code)


# Signals that stop a job while it prepares: Ctrl-C, a kill, a closed terminal.
_PREPARE_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopSignal(KeyboardInterrupt):
    """One of _PREPARE_STOPS while the job prepares."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_signal(signum: int, _frame) -> None:
    for other in _PREPARE_STOPS:  # the first one stops it; more would cut its clean-up short
        signal.signal(other, signal.SIG_IGN)
    raise _StopSignal(signum)


def _prepare(job: BatchJob) -> None:
    """The job's checks and reads; a refused new job leaves no data directory behind. A stop
    (SIGINT, SIGTERM, SIGHUP) meanwhile ends the command in one line, with the shell's
    status for that signal: a new job's data directory removed, a resumed job's kept."""
    held = {signum: signal.signal(signum, _stop_signal) for signum in _PREPARE_STOPS}
    try:
        try:
            job.prepare()
        except BaseException:
            job.abandon_new()
            raise
    except _StopSignal as stop:
        signum = stop.signum
        kept = (f"the same command resumes the job (data directory {printable(job.data_dir)})"
                if os.path.isdir(job.data_dir) and load_manifest(job.data_dir) is not None else "nothing was kept")
        _say(f"run-batch: stopped ({signal.Signals(signum).name}) while checking the input; {kept}")
        sys.exit(128 + signum)
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


def _run(job: BatchJob, spec: JobSpec, ray_address: str | None, ray_route: str, ray_node_dir: str | None) -> int:
    """Run what is left, write what is done; the exit status. SIGHUP stops the job as
    Ctrl-C does (a closed terminal), so the resume line is always said."""
    from pipeline.runtime.launcher import EXIT_INTERRUPTED

    signal.signal(signal.SIGHUP, signal.default_int_handler)
    code = 1
    refused: SettingsError | None = None
    try:
        try:
            if ray_address is not None:
                code = _run_on_ray(job, ray_address, ray_route, ray_node_dir)
            else:
                code = job.run()
        except KeyboardInterrupt:
            code = 130
        except SettingsError as exc:  # the launcher's start refused (vLLM's check): before a request was submitted
            if job.new_job and ray_address is None:  # as a refusal before the start: nothing is left behind
                refused = exc
            else:
                _say(f"run-batch: {exc}")
        except DataDirMovedError:
            raise  # nothing more is read or written there: said once, as the command's error
        except (ValueError, RuntimeError, TimeoutError, OSError, PipelineError) as exc:
            _say(f"run-batch: {exc}")
            code = 1
        if refused is None:
            stopped_by_failure = code not in (0, EXIT_INTERRUPTED)
            code, summary = job.finish(code)
    except BaseException:
        job.close(remove=False)
        raise
    if refused is not None:
        job.abandon_new()
        raise click.ClickException(str(refused))
    _say_summary(summary, spec, job, stopped_by_failure)
    remove = summary.output_written and not spec.data_dir_given and not spec.keep_data_dir
    left = job.close(remove=remove)
    if left:
        _say(f"run-batch: {printable(job.data_dir)} was kept: it holds {', '.join(map(printable, left[:5]))}, which the job "
             f"did not make")
    return code


def _say(text: str) -> None:
    """A line of the job's on stderr, with what a terminal would act on escaped."""
    click.echo(for_terminal(text), err=True)


def _say_summary(summary: JobSummary, spec: JobSpec, job: BatchJob, stopped_by_failure: bool) -> None:
    """The job's end in a line or two; `stopped_by_failure`: the run stopped on a failure
    (said above), not a stop the user asked for."""
    data_dir = printable(job.data_dir)
    if not summary.output_written:
        left = summary.requests - summary.completed - summary.failed
        collector = job.collector
        full = (f"; the disk of {printable(collector.disk_full_path)} was full: make room on it first"
                if collector is not None and collector.disk_full else "")
        when = "once what stopped the run (above) is dealt with, " if stopped_by_failure else ""
        _say(f"run-batch: {left:,} of {counted(summary.requests, 'request')} {'has' if left == 1 else 'have'} no "
             f"answer yet; {when}the same command finishes the job (data directory {data_dir}{full})")
        return
    failed = ", ".join(f"{count:,} with status {status}" for status, count in summary.failed_by_status.items())
    cached = f" ({summary.cached_tokens / summary.prompt_tokens:.1%} cached)" if summary.prompt_tokens else ""
    rate = summary.run_answered / summary.run_wall_s if summary.run_wall_s > 0 else 0.0
    _say(f"run-batch: {summary.completed:,} completed, {summary.failed:,} failed{f' ({failed})' if failed else ''}"
         f"; usage: {counted(summary.prompt_tokens, 'prompt token')}{cached}, "
         f"{counted(summary.completion_tokens, 'completion token')}; this run: {summary.run_answered:,} answered in "
         f"{summary.run_wall_s:,.1f} s ({rate:,.0f} requests/s), paced by {summary.paced_by}")
    outputs = [spec.output_path] + [p for p in (spec.error_file, spec.summary_path, spec.report_path) if p]
    _say(f"run-batch: wrote {', '.join(map(printable, outputs))}")
    damage = store_damage_note(job.report or {}, data_dir)
    if damage is not None:
        _say(f"run-batch: {'store damage: ' if damage[0] else ''}{damage[1]}")


class _Progress:
    """The job's progress on stderr: one line redrawn on a terminal, a line every
    LOG_INTERVAL_S otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.next_s = 0.0

    def __call__(self, view: JobView, now_s: float) -> None:
        if now_s < self.next_s and view.to_do:
            return
        self.next_s = now_s + (0.5 if self.tty else LOG_INTERVAL_S)
        line = for_terminal(format_job_line(view))
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line)
            if not view.to_do:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _run_on_ray(job: BatchJob, address: str, route: str, node_dir: str | None) -> int:
    """The job's requests to run on a Ray cluster (`pipeline/cluster/`); its exit status."""
    from pipeline.cluster.batch import run_job_on_cluster
    from pipeline.cluster.driver import ClusterError

    node_dir = node_dir or os.path.join(_tempdir(), f"{RAY_NODE_DIR_DEFAULT}-{job.manifest.input_xxh3[:12]}")
    try:
        return run_job_on_cluster(job, address, node_dir, route=route)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc


def _tempdir() -> str:
    import tempfile

    return tempfile.gettempdir()

