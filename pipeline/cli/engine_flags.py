"""vLLM's engine flags on `pipeline run-batch` and `pipeline launch`, by vLLM's names and
meanings; each becomes the engine option of the same name (`--engine-options` stays the
escape hatch for what has no flag, `VllmOptions`' own options such as `cpu_threads`).

    pipeline run-batch ... --max-model-len 8k -tp 2 --gpu-memory-utilization 0.85 --dtype bfloat16

Declared here, so that they work without vLLM (the sim engine, a machine without it) and
show in `--help`: the flags the product reads itself, `--max-model-len` (the context a job
checks prompts and max_tokens against), `--tensor-parallel-size` / `-tp` and
`--pipeline-parallel-size` / `-pp` (GPUs per engine: the launcher's groups), `--runner`
(generate or pool: which endpoints a job answers, `pipeline/batchjob/embeddings.py`), `--seed`, and
on run-batch `--chat-template` (the producers' template). Every other vLLM engine flag
(`--gpu-memory-utilization`, `--dtype`, `--quantization`, `--kv-cache-dtype`,
`--max-num-seqs`, `--max-num-batched-tokens`, `--enforce-eager`, `--load-format`,
`--trust-remote-code`, ...) travels as typed (the engine option `vllm_flags`) and is read by
vLLM's own parser (`vllm_args.py`), never a copy kept here: in each consumer as its engine
starts, and in the check of the engine's settings by vLLM's config code, which runs beside
the job's start and is awaited before any request is submitted. A flag the engine cannot
take is a one-line error naming why.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import click

from pipeline.cli.lora_flag import take_lora_modules
from pipeline.consumer.engines.base import MAX_PARALLEL_SIZE
from pipeline.runtime.settings import MAX_CONTEXT_TOKENS, LaunchSettings
from pipeline.wire.errors import SettingsError

# What the commands' context takes: flags click does not know are kept for vLLM's parser.
CONTEXT_SETTINGS = {"ignore_unknown_options": True, "allow_extra_args": True}
# The declared flags the sim engine takes (vLLM's sizes; the sim makes up its outputs, so a
# seed or a weights format would mean nothing to it).
SIM_FLAGS = ("max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "runner", "lora_modules")
# What `--help` says of the flags vLLM's parser reads.
VLLM_FLAGS_HELP = (
    "vLLM's engine flags, by vLLM's names and meanings (`vllm serve --help`), with --engine vllm: "
    "--gpu-memory-utilization, --dtype, --quantization, --kv-cache-dtype, --max-num-seqs, "
    "--max-num-batched-tokens, --enforce-eager, --load-format, --trust-remote-code, ... (read by vLLM's own "
    "parser and checked by vLLM's config before any request is submitted); each is the engine option of its "
    "name.")
# How often a wait for vLLM's check looks whether the run was asked to stop (Ctrl-C).
VERDICT_POLL_S = 0.1
# Flags this command does not take, and why: vLLM's server flags that are not engine flags,
# and the product's old names.
NOT_TAKEN = {
    "--max-tokens": "now --max-batch-tokens (the consumer contract's padded tokens per batch; a request's "
                    "max_tokens is its own)",
}


def parse_context_len(text: str) -> int:
    """--max-model-len as vLLM reads it: an integer, or with a suffix, k/m/g decimal (25.6k
    = 25,600) and K/M/G binary (1K = 1,024); "auto" (vLLM: the longest the GPU memory holds)
    is refused, since a job checks prompts against the context before vLLM has loaded."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        raise click.BadParameter("auto (the longest that fits vLLM's memory) is known only once vLLM has loaded, "
                                 "and prompts are checked against the context before: give a length, or leave it "
                                 "out for the model's own (config.json)")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", value)
    if match is None:
        raise click.BadParameter(f"{text!r} is not a length (1024, 8k, 32K)")
    number, suffix = match.groups()
    if suffix in ("K", "M", "G") and "." in number:
        raise click.BadParameter(f"{text!r}: no decimals with a binary suffix ({suffix}); did you mean "
                                 f"{number}{suffix.lower()}?")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    length = int(float(number) * scale) if "." in number else int(number) * scale
    if not 2 <= length <= MAX_CONTEXT_TOKENS:
        raise click.BadParameter(f"{length:,} tokens: a context is 2 to {MAX_CONTEXT_TOKENS:,} tokens")
    return length


def engine_flag_options(jobs: bool) -> Callable:
    """The declared flags, as click options of a command (run-batch: `jobs`, with --chat-template)."""
    sizes = click.IntRange(1, MAX_PARALLEL_SIZE)
    options = [
        click.option("--max-model-len", "max_model_len", type=click.STRING, metavar="LENGTH",
                     help="vLLM's: the model's context, prompt and output tokens together (1024, 8k, 32K; default: "
                          "the model's config.json)." + (" Prompts and max_tokens past it are answered 400." if jobs
                                                         else "")),
        click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", type=sizes,
                     help="vLLM's: GPUs of one engine's stage; each consumer (one engine) gets tensor x pipeline "
                          "parallel GPUs, as many consumers as whole groups fit."),
        click.option("--pipeline-parallel-size", "-pp", "pipeline_parallel_size", type=sizes,
                     help="vLLM's: pipeline stages of one engine (see --tensor-parallel-size)."),
        click.option("--runner", "runner", type=click.Choice(["auto", "generate", "pooling"]),
                     help="vLLM's: whether the engine generates or pools (embeddings); auto: by the model's "
                          "architecture." + (" A request to an endpoint it does not serve is answered 400." if jobs
                                             else "")),
        click.option("--seed", "seed", type=int, help="vLLM's: the engine's random seed (vllm engine)."),
    ]
    if jobs:
        options.append(click.option(
            "--chat-template", "chat_template", metavar="PATH|TEMPLATE",
            help="vLLM's: the chat template (a file, or the Jinja text itself) over the model directory's own."))

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


class EngineFlags:
    """The engine flags of one command line: the declared ones (dest -> value given), the
    ones left for vLLM's parser (`extra`, as typed), and the command's --engine-options
    (`given`, for clashes). Holds the vLLM check's child process from `applied` to `close`.

        flags = EngineFlags.take(options, ctx.args, given)
        try:
            settings = flags.applied(LaunchSettings.resolve(...), own_option_names(command))
            check_before_start(settings)
            flags.start_check(settings)
            ...                                # the consumers start meanwhile
            flags.verdict(wait=True)           # before any request is submitted
        finally:
            flags.close()
    """

    def __init__(self, declared: dict[str, Any], extra: Sequence[str] = (), chat_template: str | None = None,
                 given: dict[str, Any] | None = None) -> None:
        self.declared = declared
        self.extra = list(extra)
        self.chat_template = chat_template
        self.given = dict(given or {})
        self._vllm: Any = None  # a VllmCheck, for a vllm engine where vLLM is installed
        # False: the engine was checked already (a job on the batch service's node): no VllmCheck.
        self.check = True
        self._own: Sequence[str] = ()  # the command's option names, for suggestions

    @classmethod
    def take(cls, options: dict[str, Any], extra: Sequence[str], given: dict[str, Any]) -> EngineFlags:
        """The flags out of a command's keyword arguments (removed from `options`); `given`:
        the command's --engine-options."""
        declared = {name: options.pop(name, None) for name in ("max_model_len", "tensor_parallel_size",
                                                              "pipeline_parallel_size", "runner", "seed")}
        if declared["max_model_len"] is not None:
            try:
                declared["max_model_len"] = parse_context_len(declared["max_model_len"])
            except click.BadParameter as exc:
                raise SettingsError(f"--max-model-len {declared['max_model_len']}: {exc.message}") from None
        lora_modules, extra = take_lora_modules(extra)
        if lora_modules:
            declared["lora_modules"] = lora_modules
        named = _named(extra)
        if any(flag in NOT_TAKEN for flag in named):
            raise SettingsError("; ".join(f"{flag}: {NOT_TAKEN[flag]}" for flag in named if flag in NOT_TAKEN))
        if extra and not extra[0].startswith("-"):
            raise SettingsError(f"unexpected argument {extra[0]!r} (this command takes options only)")
        return cls({k: v for k, v in declared.items() if v is not None}, extra, options.pop("chat_template", None),
                   given)

    def applied(self, settings: LaunchSettings, own: Sequence[str]) -> LaunchSettings:
        """`settings` with every flag in its engine options (vLLM's as typed, `vllm_flags`),
        checked as far as can be without vLLM; SettingsError in one line for a flag the engine
        cannot take (vLLM's flags mean nothing to the sim; without vLLM nothing can read
        them), or one --engine-options gives too. `own`: the command's own option names, to
        suggest the one a typo meant. Starts vLLM's import in a child for `start_check`."""
        from pipeline.consumer.engines.vllm import INSTALL_HINT, vllm_installed

        engine, extra = settings.engine, self.extra
        named = _named(extra)
        self._own = own
        if engine != "vllm":
            sim_flags = ", ".join(map(_flag, SIM_FLAGS))
            wrong = sorted(set(self.declared) - set(SIM_FLAGS))
            if wrong:
                seed = " (the generated workloads' seed is --workload-seed)" if "seed" in wrong else ""
                raise SettingsError(f"{', '.join(map(_flag, wrong))}: vLLM's engine flag{'s' if len(wrong) > 1 else ''}, "
                                    f"and the {engine} engine makes up its outputs: of vLLM's flags it takes "
                                    f"{sim_flags}{seed}")
            if extra:
                raise SettingsError(_with_suggestions(
                    f"{', '.join(named)}: not options of this command; vLLM's engine flags are the vllm engine's, and "
                    f"the {engine} engine takes of them only {sim_flags}", extra, own))
        options = dict(self.declared)
        if engine == "vllm" and vllm_installed():
            from pipeline.consumer.engines.vllm_args import VllmCheck

            if self.check:
                self._vllm = self._vllm or VllmCheck()  # it imports vLLM meanwhile
            if extra:
                _refuse_product_flags(extra)
                options["vllm_flags"] = list(extra)
        elif extra:
            raise SettingsError(_with_suggestions(
                f"{', '.join(named)}: not options of this command; vLLM's engine flags are read by vLLM's own parser, "
                f"and vLLM is not installed here: {INSTALL_HINT}", extra, own))
        self._refuse_clashes(options)
        settings = replace(settings, engine_options={**settings.engine_options, **options})
        settings.checked("the command line")
        return settings

    def _refuse_clashes(self, options: dict[str, Any]) -> None:
        """SettingsError for an option both a flag and --engine-options give: one way to say a
        thing (a config file's [engine_options] is overridden by either, as every setting)."""
        from pipeline.consumer.engines.vllm_options import flag_option_names

        given = {name: name for name in self.given if name != "llm_kwargs"}
        kwargs = self.given.get("llm_kwargs")
        given |= {name: f"llm_kwargs.{name}" for name in (kwargs if isinstance(kwargs, dict) else {})}
        both = sorted(name for name in flag_option_names(options) if name in given)
        if both:
            raise SettingsError("; ".join(f"{_flag(name)} and --engine-options {given[name]}: give it once (the flag)"
                                          for name in both))

    def start_check(self, settings: LaunchSettings) -> None:
        """Where `applied` started vLLM's child: the engine options each consumer will run
        with, given to vLLM's config code (what it would refuse at load, refused by `verdict`)."""
        if self._vllm is not None:
            self._vllm.start(_host_options(settings))

    def verdict(self, wait: bool, stop: Callable[[], bool] = lambda: False) -> dict[str, Any] | None:
        """The engine options vLLM's parser read from the flags ({} without a check), once the
        check passed; None while it runs: at once (`wait` false), or once `stop()` turned true
        while waiting. SettingsError in one line where vLLM refuses the engine's settings or
        the check cannot run."""
        if self._vllm is None:
            return {}
        from pipeline.wire.errors import EngineOptionsError, EngineUnavailableError

        try:
            while True:
                found = self._vllm.verdict(VERDICT_POLL_S if wait else 0.0)
                if found is not None or not wait or stop():
                    return found
        except (EngineOptionsError, EngineUnavailableError) as exc:
            raise SettingsError(_with_suggestions(f"vllm engine: {exc}", self.extra, self._own)) from None

    def close(self) -> None:
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None


def _refuse_product_flags(extra: Sequence[str]) -> None:
    """SettingsError naming each flag of vLLM's that the product sets itself, and why: said
    at once, as vLLM's parser would only say it once vLLM is imported."""
    from pipeline.consumer.engines.vllm_args import REFUSED_FLAGS
    from pipeline.consumer.engines.vllm_options import flag_words

    refused = sorted({dest for dest, _value in flag_words(extra) if dest in REFUSED_FLAGS})
    if refused:
        raise SettingsError("vllm engine: " + "; ".join(f"{_flag(dest)}: {REFUSED_FLAGS[dest]}" for dest in refused))


def _named(extra: Sequence[str]) -> list[str]:
    """The flags among a command line's left-over words (--dtype of --dtype=bfloat16)."""
    return [arg.split("=", 1)[0] for arg in extra if arg.startswith("-")]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _host_options(settings: LaunchSettings) -> dict[str, Any]:
    """The engine options each consumer will run with on this machine (the launcher fills
    in what a CPU needs), as vLLM's config check must see them."""
    import os

    from pipeline.runtime.gpus import detect_gpus
    from pipeline.runtime.settings import engine_options_for_host

    gpus = detect_gpus()
    options, _filled = engine_options_for_host(settings.engine, settings.engine_options, gpus=len(gpus),
                                               consumers=settings.consumers or 1, cores=len(os.sched_getaffinity(0)),
                                               data_dir=settings.data_dir or "")
    return {key: value for key, value in options.items() if key != "cache_dir"}


def _with_suggestions(message: str, extra: Sequence[str], own: Sequence[str]) -> str:
    """`message`, with the command's own option that an unknown flag most likely meant."""
    guesses = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            close = difflib.get_close_matches(name, own, n=1, cutoff=0.8)
            if close:
                guesses.append(f"{name}: did you mean {close[0]}?")
    return message + (f" ({'; '.join(guesses)})" if guesses else "")


def own_option_names(command: click.Command) -> list[str]:
    """Every long option name of a click command."""
    return [name for param in command.params for name in getattr(param, "opts", []) if name.startswith("--")]
