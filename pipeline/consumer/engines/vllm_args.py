"""vLLM's engine flags read by vLLM's own parser, and a vllm engine's settings checked by
vLLM's own config code, beside the run's start.

    vllm = VllmCheck()                       # a child process imports vLLM meanwhile
    vllm.start({**engine_options, "vllm_flags": ["--gpu-memory-utilization", "0.8"]})
    ...                                      # the job scans its input, the consumers start
    vllm.verdict(wait_s=60)                  # {"gpu_memory_utilization": 0.8}, vLLM's refusal, or None

Flags are parsed by `FlexibleArgumentParser` with `EngineArgs.add_cli_args` (what `vllm
serve` and `vllm run-batch` take), so a flag means here what it means to vLLM and a new vLLM
brings its new flags: nothing is copied by hand. Each flag given becomes an engine option
under vLLM's name: a `VllmOptions` field where there is one (`gpu_memory_utilization`,
`dtype`, `block_size`, ...), else a key of `llm_kwargs` (passed to `vllm.LLM` as it is), the
same place `--engine-options` puts it. The check builds vLLM's whole config from the options
as the consumer will (`EngineArgs(...).create_engine_config()`: the model's config read, the
platform's support of the dtype, quantization and parallel sizes checked), so what vLLM would
refuse at load is refused in one line, before any request is submitted. Each consumer reads
the same flags with `read_flags` as its engine starts, where it imports vLLM anyway.

NOTE: the child process, not an import here: importing vLLM takes 3 to 15 s and brings
torch's threads into a process that forks the broker, producers and consumers afterwards.
NOTE: the verdict is awaited once the consumers have started, not before: waiting for it
first put the child's import of vLLM and the consumer's one after the other (the first 15.7 s
of a 67.7 s `pipeline bench run-batch-mix` run went to the check alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from pipeline.consumer.engines.vllm_options import FIXED_LLM_KWARGS, VllmOptions, with_flag_options
from pipeline.wire.errors import EngineOptionsError, EngineUnavailableError

# How long the child may take to import vLLM and answer: 3 to 15 s measured on this 2-core
# machine (more under load); a minute more covers a slow first import of torch from disk.
VLLM_CHECK_TIMEOUT_S = 120.0
# A message line from vLLM is cut to this in the one-line error.
MAX_MESSAGE_CHARS = 600
# vLLM flags that the product sets itself or that mean something else here, with why.
REFUSED_FLAGS: dict[str, str] = {
    "model": "the model is the command's own --model",
    "served_model_name": "the name requests ask for is the command's own --served-model-name",
    "tokenizer": "the producers tokenize with --model's tokenizer: give a model directory holding the tokenizer",
    "skip_tokenizer_init": "the answers' text is vLLM's detokenization",
    "enable_prefix_caching": "prefix caching stays on: the broker groups requests for it, and its counters are checked",
    "disable_log_stats": "vLLM's statistics stay on: the consumers read its prefix-cache counters",
    "data_parallel_size": "the consumers are the data parallel replicas: give --consumers (one per engine's GPUs)",
}
assert set(FIXED_LLM_KWARGS) <= set(REFUSED_FLAGS), "every setting the accounting fixes is refused as a flag"


class VllmCheck:
    """A child process that imports vLLM once and checks one set of engine options (their
    `vllm_flags` read by vLLM's parser). Owner: the command that starts a run; close it."""

    def __init__(self) -> None:
        self._cache = tempfile.TemporaryDirectory(prefix="sbrk-vllm-check-")  # nothing lands in ~/.cache
        self._log = tempfile.TemporaryFile()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = {**os.environ, "VLLM_CACHE_ROOT": self._cache.name, "VLLM_LOGGING_LEVEL": "ERROR",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen([sys.executable, "-m", "pipeline.consumer.engines.vllm_args"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._buffer = b""
        self._deadline_s = 0.0
        self._answer: dict[str, Any] | None = None

    def start(self, options: dict[str, Any]) -> None:
        """Ask for the check of `options` (engine options, their `vllm_flags` as typed)."""
        assert self._deadline_s == 0.0, "one check a child"
        assert self._process.stdin is not None
        self._deadline_s = time.monotonic() + VLLM_CHECK_TIMEOUT_S
        try:
            self._process.stdin.write(json.dumps({"check": options}).encode() + b"\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            self._answer = {"unavailable": f"vLLM's check process ended: {self._log_tail()}"}

    def verdict(self, wait_s: float) -> dict[str, Any] | None:
        """The options vLLM's parser read from the flags, once the check passed; None while it
        runs after waiting `wait_s` for it. EngineOptionsError with vLLM's message where vLLM
        refuses them, EngineUnavailableError where the check could not run."""
        assert self._deadline_s, "start comes first"
        if self._answer is None:
            line = self._read_line(wait_s)
            if line is None:
                return None
            self._answer = json.loads(line)
            with contextlib.suppress(OSError):  # the child ends meanwhile, with vLLM's memory: `close` reaps it
                self._process.stdin.close()
        if "unavailable" in self._answer:
            raise EngineUnavailableError(self._answer["unavailable"])
        if "error" in self._answer:
            raise EngineOptionsError(self._answer["error"])
        return self._answer["ok"]

    def _read_line(self, wait_s: float) -> bytes | None:
        """The child's answer, None if it does not come within `wait_s`; past the check's
        deadline, an answer saying so."""
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = self._deadline_s - time.monotonic()
            if left <= 0:
                return json.dumps({"unavailable": f"vLLM's check did not answer within {VLLM_CHECK_TIMEOUT_S:g} s "
                                                  f"(importing vLLM): {self._log_tail()}"}).encode()
            if not select.select([fd], [], [], min(left, wait_s))[0]:
                if wait_s < left:
                    return None
                continue  # the deadline passed: said above
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return json.dumps({"unavailable": f"vLLM's check process ended: {self._log_tail()}"}).encode()
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _log_tail(self) -> str:
        self._log.seek(0)
        lines = [line for line in self._log.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][:MAX_MESSAGE_CHARS] if lines else "no message"

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                if not self._process.stdin.closed:
                    self._process.stdin.close()  # the child's loop ends at end of input
                self._process.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._log.close()
        self._cache.cleanup()


def engine_options_of(given: dict[str, Any]) -> dict[str, Any]:
    """Flags vLLM's parser read (dest -> value) as engine options: VllmOptions fields at the
    top, the rest in llm_kwargs; EngineOptionsError for a flag in REFUSED_FLAGS."""
    refused = [f"--{dest.replace('_', '-')}: {REFUSED_FLAGS[dest]}" for dest in given if dest in REFUSED_FLAGS]
    if refused:
        raise EngineOptionsError("; ".join(refused))
    own = {f.name for f in dataclasses.fields(VllmOptions)} - {"llm_kwargs"}
    options: dict[str, Any] = {dest: value for dest, value in given.items() if dest in own}
    rest = {dest: value for dest, value in given.items() if dest not in own}
    if rest:
        options["llm_kwargs"] = rest
    return options


def plain(value: Any) -> Any:
    """A value vLLM's parser made, as JSON and TOML hold it (enums by value, sets as sorted
    lists, a config object as a table of its fields that differ from their defaults)."""
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.init and getattr(value, f.name) != _default(f)}
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, cut to MAX_MESSAGE_CHARS."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:MAX_MESSAGE_CHARS]


def _parser() -> Any:
    """vLLM's own parser of its engine flags, raising ValueError instead of exiting."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm", add_help=False, allow_abbrev=False)
    EngineArgs.add_cli_args(parser)

    def refuse(message: str) -> None:
        raise ValueError(f"vLLM: {message}")

    parser.error = refuse
    return parser


def read_flags(words: Sequence[str], parser: Any = None) -> dict[str, Any]:
    """vLLM's engine flags `words` as engine options (the module's doc), read by vLLM's
    parser (`parser`, else one made now: this imports vLLM); EngineOptionsError with vLLM's
    parser's message, or naming a flag the product refuses and why."""
    if not words:
        return {}
    parser = parser if parser is not None else _parser()
    try:
        given = vars(parser.parse_args(list(words)))
        defaults = vars(parser.parse_args([]))
    except ValueError as exc:
        raise EngineOptionsError(one_line(exc)) from None
    return engine_options_of({dest: plain(value) for dest, value in given.items() if value != defaults.get(dest)})


def _check(parser: Any, options: dict[str, Any]) -> dict[str, Any]:
    """What the flags of `options` read as, once vLLM built its config from every option."""
    from vllm.engine.arg_utils import EngineArgs

    flag_options = read_flags(options.get("vllm_flags") or [], parser)
    kwargs = VllmOptions.parse(with_flag_options(options, flag_options)).llm_kwargs_all()
    EngineArgs(**kwargs).create_engine_config()
    return flag_options


def main() -> int:
    """The child: imports vLLM at once, then takes one JSON request on stdin ({"check":
    {...}}) and writes one answer line on stdout ({"ok": {...}}, {"error": "..."} or
    {"unavailable": "..."})."""
    out = sys.stdout
    sys.stdout = sys.stderr  # what vLLM prints goes to the log, never into the answers
    try:
        parser, failure = _parser(), ""
    except Exception as exc:  # an import that fails: the check gets its message
        parser, failure = None, f"vLLM cannot be imported here: {one_line(exc)}"
    line = sys.stdin.readline()
    if not line:
        return 0  # the parent ended before asking
    try:
        answer = {"unavailable": failure} if parser is None else {"ok": _check(parser, json.loads(line)["check"])}
    except Exception as exc:  # vLLM's refusals come as ValueError, pydantic's ValidationError, ...
        answer = {"error": one_line(exc)}
    out.write(json.dumps(answer) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    # The child ends as soon as it answered, without the second an interpreter holding
    # vLLM and torch takes to tear down: the run's forked processes hold its stdin's write
    # end, so an end of input would come only when the whole run ends (the child held
    # vLLM's memory and delayed the command's exit by 1.3 s until then).
    code = main()
    sys.stderr.flush()
    os._exit(code)
