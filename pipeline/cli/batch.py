"""`pipeline run-batch`: an OpenAI Batch file of chat or completion requests through the
pipeline, into an output file of one response line per request; resumable.

The flags of `vllm run-batch` where they mean the same (-i, -o, --model,
--served-model-name), and the product's own (data directory, producers, consumers, the
consumer contract, engine, config file). The job's state lives on its data directory
(`pipeline/runtime/batchrun.py`); the same command again finishes a stopped job.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import click

from pipeline.cli.launch import (
    ENGINE_OPTIONS_HELP,
    METRICS_TOKEN_HELP,
    _finish,
    _run_with_progress,
    check_before_start,
    check_ray,
    setup_logging,
)
from pipeline.consumer.engines import ENGINES
from pipeline.runtime.tables import merged, parse_assignments, parse_engine_options
from pipeline.wire.errors import BadInputError, PipelineError

# The data directory a job uses when none is given: beside its output file, so that the
# same command finds it again after a crash.
DEFAULT_DATA_DIR_SUFFIX = ".run"
# The made-up output ids of the sim engine span 15 bits: a vocabulary above that is cut to it.
SIM_VOCAB_LIMIT = 1 << 15
# With --ray, each node's data directory is made under this name in its temporary directory
# (short: the broker's Unix socket path must stay within 108 bytes).
RAY_NODE_DIR_DEFAULT = "sbrk-ray"


@click.command("run-batch")
@click.option("-i", "--input-file", "input_file", required=True, type=click.Path(dir_okay=False),
              help="The requests: an OpenAI Batch file (JSON lines; /v1/chat/completions, /v1/completions).")
@click.option("-o", "--output-file", "output_file", required=True, type=click.Path(dir_okay=False),
              help="The responses, one line per request (written whole once every request has its answer).")
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The model directory: its tokenizer and chat template (and, for vllm, its weights).")
@click.option("--served-model-name", help="The model name requests must ask for (default: the directory's name).")
@click.option("--data-dir", type=click.Path(file_okay=False),
              help=f"The job's data directory (default: the output file's name with {DEFAULT_DATA_DIR_SUFFIX}, "
                   f"removed once the output is written). The same command on it resumes the job.")
@click.option("--output-order", type=click.Choice(["input", "completion"]), default="input", show_default=True,
              help="Output lines in the input file's order, or in the order answers came.")
@click.option("--engine", type=click.Choice(sorted(ENGINES)),
              help="Engine of the consumers (default vllm where it is installed; sim makes up outputs).")
@click.option("--engine-options", "engine_options", multiple=True, metavar="KEY=VALUE,...", help=ENGINE_OPTIONS_HELP)
@click.option("--producers", type=int, help="Producer processes: they tokenize (default 2).")
@click.option("--consumers", type=int, help="Consumer processes (default: one per GPU, else 2).")
@click.option("--max-batch", type=int, help="Consumer contract: items per batch (default 64).")
@click.option("--max-tokens", type=int, help="Consumer contract: padded tokens per batch (default 65536).")
@click.option("--max-input-len", type=int,
              help="Longest prompt run (default: the model's context less one token); longer ones are answered 400.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), help="TOML file of launch options.")
@click.option("--report", type=click.Path(dir_okay=False), help="Write the run report as JSON here.")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port, as `pipeline launch` does.")
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
def run_batch(input_file: str, output_file: str, model_dir: str, served_model_name: str | None, data_dir: str | None,
              output_order: str, engine: str | None, engine_options: tuple[str, ...], config_path: str | None,
              assignments: tuple[str, ...], keep_data_dir: bool, verbose: bool, ray_address: str | None,
              ray_node_dir: str | None, ray_route: str, **options) -> None:
    """Run an OpenAI Batch file through the broker and consumers and write one response line
    per request to the output file; run it again on the same data directory to resume."""
    from pipeline.batchjob.chat import ChatTokenizer
    from pipeline.batchjob.requests import load_requests
    from pipeline.runtime.batchrun import plan_job

    setup_logging(verbose)
    if os.path.exists(output_file) and os.path.samefile(input_file, output_file):
        raise click.ClickException(f"the output file {output_file} is the input file: it would be replaced")
    own_data_dir = data_dir is None
    data_dir = data_dir or output_file + DEFAULT_DATA_DIR_SUFFIX
    if ray_address is not None:
        check_ray(ray_address)
    try:
        engine = engine or _default_engine()
        tokenizer = ChatTokenizer.load(model_dir)
        served = served_model_name or os.path.basename(os.path.normpath(model_dir))
        batch_file = load_requests(input_file, served)
        given = parse_engine_options(engine_options) if engine_options else {}
        settings = _settings(config_path, assignments, options, data_dir, engine, given, model_dir, tokenizer)
        check_before_start(settings)
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        plan = plan_job(batch_file, data_dir, served, now_s=time.time())
    except (BadInputError, PipelineError) as exc:
        raise click.ClickException(str(exc)) from exc
    refused = sum(1 for r in batch_file.requests if r.error is not None)
    click.echo(f"run-batch: {len(batch_file.requests):,} requests in {input_file}: {len(plan.answers.answered()):,} "
               f"answered already, {len(plan.pending):,} waiting in the store, {len(plan.to_submit):,} to submit, "
               f"{refused:,} refused as bad requests; data directory {data_dir}", err=True)
    if ray_address is not None and (plan.to_submit or plan.pending):
        code = _run_on_ray(settings, batch_file, plan, model_dir, data_dir, ray_address, ray_route,
                           ray_node_dir or _default_node_dir(plan.manifest.input_sha256))
    else:
        code = _run(settings, batch_file, plan, model_dir, data_dir) if plan.to_submit or plan.pending else 0
    code = _write_output(batch_file, tokenizer, plan, settings, output_file, output_order, data_dir, code)
    if code == 0 and own_data_dir and not keep_data_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
    sys.exit(code)


def _default_engine() -> str:
    """vllm where it is installed; elsewhere a one-line error saying how to get it."""
    from pipeline.consumer.engines.vllm import INSTALL_HINT, vllm_installed

    if vllm_installed():
        return "vllm"
    raise click.ClickException(f"run-batch runs vllm by default, and vLLM is not installed here: {INSTALL_HINT}; "
                               f"or pass --engine sim (made-up outputs)")


def _settings(config_path, assignments, options: dict, data_dir: str, engine: str, given: dict, model_dir: str,
              tokenizer):
    """The launch settings of the job: the engine's options with the model's own (vllm: the
    model directory; sim: output ids within the tokenizer's vocabulary), and the longest
    prompt from the model's context unless given."""
    from pipeline.runtime.settings import LaunchSettings, model_context_len

    engine_options = dict(given)
    if engine == "vllm":
        engine_options.setdefault("model", model_dir)
    else:
        engine_options.setdefault("vocab_size", min(tokenizer.vocab_size, SIM_VOCAB_LIMIT))
    if options.get("max_input_len") is None:
        context = engine_options.get("max_model_len") or model_context_len(os.path.join(model_dir, "config.json"))
        options["max_input_len"] = context - 1 if context else None
    overrides = merged(options | {"data_dir": data_dir, "engine": engine, "engine_options": engine_options},
                       parse_assignments(assignments))
    return LaunchSettings.resolve(config_path, overrides)


def _run(settings, batch_file, plan, model_dir: str, data_dir: str) -> int:
    """One run of the pipeline on what the job has to do; its exit status."""
    from pipeline.batchjob.workload import JobWorkload
    from pipeline.runtime.launcher import Launcher

    workload = JobWorkload(batch_file, plan.to_submit, model_dir, data_dir)
    launcher = Launcher(settings, workload)
    try:
        try:
            outcome = _run_with_progress(launcher, len(workload))
        except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
            raise click.ClickException(str(exc)) from exc
        return _finish(settings, outcome, resume=f"pipeline run-batch ... --data-dir {data_dir}")
    finally:
        launcher.cleanup()


def _default_node_dir(job_sha256: str) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"{RAY_NODE_DIR_DEFAULT}-{job_sha256[:12]}")


def _run_on_ray(settings, batch_file, plan, model_dir: str, data_dir: str, address: str, route: str,
                node_dir: str) -> int:
    """The job's requests to run on a Ray cluster (`pipeline/cluster/`); its exit status."""
    from pipeline.cluster.batch import run_job_on_cluster
    from pipeline.cluster.driver import ClusterError

    try:
        return run_job_on_cluster(settings, batch_file, sorted(set(plan.to_submit) | plan.pending), model_dir,
                                  data_dir, address, node_dir, route=route)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc


def _add_to_report(path: str, summary) -> None:
    """The job's summary under "job" in the run report's JSON (a report of its own when this
    run ran nothing: every request was answered before)."""
    import dataclasses
    import json

    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    report["job"] = {**dataclasses.asdict(summary), "unanswered": len(summary.unanswered),
                     "failed_by_status": {str(k): v for k, v in summary.failed_by_status.items()}}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _write_output(batch_file, tokenizer, plan, settings, output_file: str, order: str, data_dir: str,
                  code: int) -> int:
    """The output file, once every request has its answer; the job's summary; the exit status."""
    from pipeline.batchjob.job import read_answers
    from pipeline.runtime.batchrun import finish_job

    summary = finish_job(batch_file, read_answers(data_dir), tokenizer, plan.manifest, output_file, order)
    if not summary.output_written:
        click.echo(f"run-batch: {len(summary.unanswered):,} of {summary.requests:,} requests have no answer yet; "
                   f"the same command finishes the job (data directory {data_dir})", err=True)
        return code or 1
    if settings.report:
        _add_to_report(settings.report, summary)
    usage = summary.usage
    failed = ", ".join(f"{count:,} with status {status}" for status, count in sorted(summary.failed_by_status.items()))
    click.echo(f"run-batch: {summary.completed:,} completed, {summary.failed:,} failed{f' ({failed})' if failed else ''}"
               f"; usage: {usage.prompt_tokens:,} prompt tokens ({usage.cached_tokens:,} cached), "
               f"{usage.completion_tokens:,} completion tokens; output: {output_file}", err=True)
    return code
