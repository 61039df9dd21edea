"""A batch job's plan: what a command asks (`JobAsk`: files, model, options as given) made
into a checked `JobSpec` (`plan_job`): the model's tokenizer and chat template loaded, the
launch settings resolved with the engine's flags, every limit derived from the model, and
everything that can be refused before a process starts refused in one line. `pipeline
run-batch` and `pipeline serve` (which checks its jobs' options once, before it serves)
plan their jobs here; the job itself (prepare, run, finish) is `job.py`'s.

The engine flags come as a `JobFlags`: the command line's vLLM flags (`cli/engine_flags.py`)
or any object that applies and checks them the same way.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pipeline.batchjob.embeddings import RUNNER_POOLING, job_runner
from pipeline.batchjob.spec import JobSpec
from pipeline.batchjob.sampling import sim_answer_options
from pipeline.batchjob.workload import PromptLimits
from pipeline.runtime.preflight import check_before_start
from pipeline.runtime.settings import LaunchSettings
from pipeline.runtime.tables import merged, parse_assignments
from pipeline.wire.errors import SettingsError

# The data directory a job uses when none is given: beside its output file, so that the
# same command finds it again after a crash.
DEFAULT_DATA_DIR_SUFFIX = ".run"
# The job's summary (counts and usage, JSON) beside its output when none is named.
SUMMARY_SUFFIX = ".summary.json"
# The made-up output ids of the sim engine span 15 bits: a vocabulary above that is cut to it.
SIM_VOCAB_LIMIT = 1 << 15
# Settings of a launch config that mean nothing to a batch job (its requests come from -i).
NOT_FOR_JOBS = frozenset({"workload", "items", "replay_speed", "workload_seed", "vocab_size"})
# Producers by default: the cores this process may use (tokenizing is a job's heaviest
# stage), at most this many (each holds a tokenizer and a 64 MiB ring).
MAX_DEFAULT_PRODUCERS = 16


@dataclass(slots=True)
class JobAsk:
    """What a command asks of a job, as given (None: not given, the plan's default)."""

    input_file: str
    output_file: str
    model_dir: str
    served_model_name: str | None
    data_dir: str | None
    output_order: str  # "input" or "completion"
    error_file: str | None
    overwrite: bool
    summary_file: str | None
    engine: str  # the command's default already taken (cli/common.default_engine)
    config_path: str | None
    assignments: Sequence[str]  # --set KEY=VALUE
    keep_data_dir: bool
    limits: PromptLimits
    options: dict[str, Any]  # the launch settings given as options (producers, consumers, max_batch, ...)


class JobFlags(Protocol):
    """The engine flags of a command line, as `cli/engine_flags.EngineFlags` holds them."""

    chat_template: str | None  # --chat-template, as given
    given: dict[str, Any]  # --engine-options

    def applied(self, settings: LaunchSettings, own: Sequence[str]) -> LaunchSettings: ...

    def start_check(self, settings: LaunchSettings) -> None: ...


def plan_job(ask: JobAsk, flags: JobFlags, own_options: Sequence[str]) -> JobSpec:
    """The job `ask` asks for, every option checked (SettingsError and the like); `own_options`:
    the command's option names, which an unknown engine flag's message suggests from."""
    from pipeline.batchjob.chat import ChatTokenizer
    from pipeline.batchjob.template import read_chat_template
    from pipeline.runtime.settings import load_toml

    config_path, output_file, model_dir = ask.config_path, ask.output_file, ask.model_dir
    file_settings = load_toml(config_path) if config_path else {}
    wrong = sorted(NOT_FOR_JOBS & set(file_settings))
    if wrong:
        raise SettingsError(f"{config_path}: {', '.join(wrong)}: not settings of a batch job (its requests come "
                            f"from -i); remove them")
    data_dir_given = ask.data_dir is not None or "data_dir" in file_settings
    data_dir = ask.data_dir or file_settings.get("data_dir") or output_file + DEFAULT_DATA_DIR_SUFFIX
    engine = ask.engine
    template = read_chat_template(flags.chat_template) if flags.chat_template is not None else None
    tokenizer = ChatTokenizer.load(model_dir, chat_template=template)  # broken: one line, before anything
    settings = _settings(ask, data_dir, engine, flags, own_options, tokenizer)
    check_before_start(settings, lora_adapters=len(settings.engine_options.get("lora_modules") or ()))
    flags.start_check(settings)  # its verdict: before the job submits a request (BatchJob.engine_verdict)
    if settings.plots and not _importable("matplotlib"):
        raise SettingsError("plots: needs matplotlib (pip install 'shape-broker[plots]'), checked before the job runs")
    served = ask.served_model_name or os.path.basename(os.path.normpath(model_dir))
    limits = replace(ask.limits, max_prompt_tokens=settings.max_input_len, context_tokens=_context(settings, model_dir))
    return JobSpec(ask.input_file, output_file, model_dir, served, settings, data_dir_given, ask.output_order,
                   ask.error_file, settings.report, ask.summary_file or output_file + SUMMARY_SUFFIX, ask.overwrite,
                   ask.keep_data_dir, limits, chat_template=template)


def _context(settings: LaunchSettings, model_dir: str) -> int | None:
    """The model's context in tokens: the engine's max_model_len, else its config.json's."""
    from pipeline.runtime.settings import model_context_len

    given = settings.engine_options.get("max_model_len")
    return given if isinstance(given, int) else model_context_len(os.path.join(model_dir, "config.json"))


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _settings(ask: JobAsk, data_dir: str, engine: str, flags: JobFlags, own_options: Sequence[str],
              tokenizer) -> LaunchSettings:
    """The launch settings of the job: the engine's options with the model's own (vllm: the
    model directory; sim: output ids within the tokenizer's vocabulary) and the engine
    flags', the longest prompt from the model's context unless given, producers from the
    cores."""
    model_dir, options = ask.model_dir, dict(ask.options)
    engine_options = dict(flags.given)
    if engine == "vllm":
        engine_options.setdefault("model", model_dir)
    else:
        engine_options.setdefault("vocab_size", min(tokenizer.vocab_size, SIM_VOCAB_LIMIT))
        engine_options = {**sim_answer_options(model_dir, tokenizer, engine_options["vocab_size"]), **engine_options}
    if options.get("producers") is None:
        options["producers"] = max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT_PRODUCERS))
    overrides = merged(options | {"data_dir": data_dir, "engine": engine, "engine_options": engine_options},
                       parse_assignments(ask.assignments))
    settings = flags.applied(LaunchSettings.resolve(ask.config_path, overrides), own_options)
    if job_runner(settings.engine_options, model_dir) == RUNNER_POOLING:
        return _pooling(settings, model_dir, options.get("max_input_len") is None)
    if options.get("max_input_len") is None:
        context = _context(settings, model_dir)
        if context:
            settings = replace(settings, max_input_len=context - 1)
            settings.checked("the command line")
    return settings


def _pooling(settings: LaunchSettings, model_dir: str, default_input_len: bool) -> LaunchSettings:
    """A pooling job's settings: an item holds a request's every input (each checked against
    the context by the producer), so it may be as long as a batch by default; the sim's
    embeddings as large as the model's."""
    from pipeline.batchjob.embeddings import EmbeddingFacts

    size = EmbeddingFacts.load(model_dir).size
    if settings.engine != "vllm" and size is not None:
        settings = replace(settings, engine_options={"embedding_size": size, **settings.engine_options})
    if default_input_len:
        settings = replace(settings, max_input_len=settings.max_batch_tokens)
    settings.checked("the command line")
    return settings
