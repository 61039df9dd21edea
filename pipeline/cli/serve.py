"""`pipeline serve`: OpenAI's Files and Batches API over this machine's engine
(`pipeline/service/`), each batch run as a `pipeline run-batch` job.

The jobs' options are run-batch's own, the same click options (`JOB_OPTIONS`, taken from
the run-batch command, never a copy), checked here once with run-batch's own check
(`plan_job`) before anything is served, and handed to every job as given.
"""

from __future__ import annotations

import os
import sys

import click

from pipeline.batchjob.plan import JobAsk, plan_job
from pipeline.cli.batch import run_batch
from pipeline.cli.common import default_engine, setup_logging
from pipeline.cli.engine_flags import CONTEXT_SETTINGS, VLLM_FLAGS_HELP, EngineFlags, own_option_names
from pipeline.service.limits import (
    DEFAULT_KEY_MAX_ACTIVE_BATCHES,
    DEFAULT_KEY_MAX_STORED_BYTES,
    DEFAULT_MAX_CONCURRENT_BATCHES,
    DEFAULT_MAX_UPLOAD_BYTES,
    MAX_ACTIVE_BATCHES_LIMIT,
    MAX_CONCURRENT_BATCHES,
    MAX_STORED_BYTES_LIMIT,
    MAX_UPLOAD_BYTES_LIMIT,
    TEST_WINDOW_RANGE_S,
)
from pipeline.runtime.settings import LaunchSettings
from pipeline.wire.errors import BadInputError, PipelineError, SettingsError
from pipeline.wire.textfiles import for_terminal

# run-batch's options every job of the service takes (its model, engine and engine flags,
# its producers and consumers, its prompt limits, its config file), by their parameter names.
JOB_OPTIONS = ("model_dir", "served_model_name", "engine", "engine_options", "producers", "consumers", "max_batch",
               "max_batch_tokens", "max_input_len", "prompt_time_limit_s", "prompt_memory_limit_mb",
               "tool_call_parser", "enable_auto_tool_choice", "config_path", "assignments", "max_model_len",
               "tensor_parallel_size", "pipeline_parallel_size", "runner", "seed", "chat_template")
# Options whose value is a path: handed to the jobs absolute (they may run elsewhere).
PATH_OPTIONS = ("model_dir", "config_path")
# The job directory checked before serving: a long sequence number, so every later job's
# broker socket path fits where this one's does.
SAMPLE_JOB_DIR = os.path.join("jobs", "99999999", "data")


def _job_options(command: click.Command) -> click.Command:
    """Add run-batch's JOB_OPTIONS to `command`."""
    by_name = {param.name: param for param in run_batch.params}
    command.params.extend(by_name[name] for name in JOB_OPTIONS)
    return command


@_job_options
@click.command("serve", context_settings=CONTEXT_SETTINGS, epilog=VLLM_FLAGS_HELP)
@click.option("--data-dir", required=True, type=click.Path(file_okay=False),
              help="The service's directory: files, batches and their jobs. The same command on it resumes every "
                   "batch that had not ended.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; another than loopback needs --api-keys.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free one, said at the start).")
@click.option("--api-keys", "api_keys", type=click.Path(dir_okay=False),
              help="File of API keys (mode 0600), one a line: the key, then optionally its tenant's name. Each "
                   "tenant sees only its own files and batches. Without it: loopback only, one tenant.")
@click.option("--max-concurrent-batches", type=click.IntRange(1, MAX_CONCURRENT_BATCHES),
              default=DEFAULT_MAX_CONCURRENT_BATCHES, show_default=True,
              help="Batches whose jobs run at once, all on the one broker and engines, in submission order.")
@click.option("--max-upload-bytes", type=click.IntRange(1, MAX_UPLOAD_BYTES_LIMIT), default=DEFAULT_MAX_UPLOAD_BYTES,
              show_default=True, help="The largest file an upload may be.")
@click.option("--key-max-stored-bytes", type=click.IntRange(1, MAX_STORED_BYTES_LIMIT),
              default=DEFAULT_KEY_MAX_STORED_BYTES, show_default=True,
              help="Bytes of files one tenant may store; an upload past it is refused (429).")
@click.option("--key-max-active-batches", type=click.IntRange(1, MAX_ACTIVE_BATCHES_LIMIT),
              default=DEFAULT_KEY_MAX_ACTIVE_BATCHES, show_default=True,
              help="Batches of one tenant not ended at once; a create past it is refused (429).")
@click.option("--test-completion-window-s", type=click.IntRange(*TEST_WINDOW_RANGE_S),
              help="For tests: every batch's deadline, in seconds after its creation, whatever its completion "
                   "window.")
@click.option("-v", "--verbose", is_flag=True, help="Log the service's and the HTTP server's info messages.")
def serve(data_dir: str, host: str, port: int, api_keys: str | None, max_concurrent_batches: int,
          max_upload_bytes: int, key_max_stored_bytes: int, key_max_active_batches: int,
          test_completion_window_s: int | None, verbose: bool, **options) -> None:
    """Serve OpenAI's Files and Batches API (the `openai` client works against it): each batch
    runs as a run-batch job of the model given; stopped (SIGTERM, Ctrl-C) or killed, the same
    command resumes every batch."""
    from pipeline.service.app import ServiceConfig
    from pipeline.service.auth import check_host, read_api_keys
    from pipeline.service.runner import node_spec
    from pipeline.service.store import NODE_DIR
    from pipeline.service.server import ServeOptions, serve as serve_forever

    setup_logging(verbose)
    ctx = click.get_current_context()
    try:
        tenants = read_api_keys(api_keys) if api_keys else None
        check_host(host, tenants)
        job_args = _job_args(ctx, options)
        model, endpoints, settings = _checked_jobs(data_dir, dict(options), list(ctx.args))
        api = ServiceConfig(model, endpoints, test_completion_window_s, max_upload_bytes,
                            key_max_stored_bytes, key_max_active_batches)
        node = node_spec(settings, os.path.join(os.path.abspath(data_dir), NODE_DIR))
        serve_forever(ServeOptions(data_dir, host, port, tenants, job_args, max_concurrent_batches, api, node, verbose),
                      say=lambda line: click.echo(for_terminal(line), err=True))
    except (BadInputError, PipelineError) as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:  # Ctrl-C, after the graceful stop (uvicorn raises it again once stopped)
        from pipeline.runtime.launcher import EXIT_INTERRUPTED

        sys.exit(EXIT_INTERRUPTED)


def _job_args(ctx: click.Context, options: dict) -> list[str]:
    """The run-batch arguments of the JOB_OPTIONS given on this command line, then the
    flags it left for vLLM's parser, as typed."""
    by_name = {param.name: param for param in run_batch.params}
    args: list[str] = []
    for name in JOB_OPTIONS:
        if ctx.get_parameter_source(name) in (None, click.core.ParameterSource.DEFAULT):
            continue
        param, value = by_name[name], options[name]
        flag = next(opt for opt in param.opts if opt.startswith("--"))
        if name in PATH_OPTIONS:
            value = os.path.abspath(value)
        if getattr(param, "is_flag", False):
            args += [flag] if value else []
        elif param.multiple:
            for each in value:
                args += [flag, str(each)]
        else:
            args += [flag, str(value)]
    return args + list(ctx.args)


def _checked_jobs(data_dir: str, options: dict, extra: list[str]) -> tuple[str, tuple[str, ...], LaunchSettings]:
    """The jobs' options checked as run-batch checks its own (a one-line error where one is
    wrong, before anything is served); the served model's name, the endpoints it serves and
    a job's launch settings (the node's)."""
    from pipeline.batchjob.embeddings import EMBEDDINGS_URL, RUNNER_POOLING, job_runner
    from pipeline.batchjob.requests import ENDPOINTS
    from pipeline.batchjob.tools import tool_calling
    from pipeline.batchjob.workload import PromptLimits
    from pipeline.runtime.tables import parse_engine_options

    raw_engine_options = options.pop("engine_options")
    given = parse_engine_options(raw_engine_options) if raw_engine_options else {}
    flags = EngineFlags.take(options, extra, given)
    try:
        limits = PromptLimits(options.pop("prompt_time_limit_s"), options.pop("prompt_memory_limit_mb") << 20)
        tool_calling(options.pop("tool_call_parser"), options.pop("enable_auto_tool_choice"))
        model_dir = options.pop("model_dir")
        ask = JobAsk("requests.jsonl", "output.jsonl", model_dir, options.pop("served_model_name"),
                     os.path.join(os.path.abspath(data_dir), SAMPLE_JOB_DIR), "completion", None, False, None,
                     options.pop("engine") or default_engine(), options.pop("config_path"), options.pop("assignments"), False, limits,
                     options)
        spec = plan_job(ask, flags, own_option_names(run_batch))
        if spec.settings.storage != "disk" or spec.settings.metrics_port is not None:
            raise SettingsError("storage and metrics_port: the service's node keeps every batch's requests on disk "
                                "(storage = \"disk\") and serves its metrics at /metrics: leave both to it")
        flags.verdict(wait=True)  # refused before anything is served
    finally:
        flags.close()
    pooling = job_runner(spec.settings.engine_options, model_dir) == RUNNER_POOLING
    endpoints = tuple(url for url in ENDPOINTS if (url == EMBEDDINGS_URL) == pooling)
    return spec.served_model, endpoints, spec.settings
