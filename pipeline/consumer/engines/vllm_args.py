"""vLLM's engine flags read by vLLM's own parser, and a vllm engine's settings checked by
vLLM's own config code, before anything starts.

    with VllmCheck() as vllm:                         # a child process imports vLLM meanwhile
        options = vllm.flags(["--gpu-memory-utilization", "0.8", "--max-num-seqs", "64"])
        # {"gpu_memory_utilization": 0.8, "llm_kwargs": {"max_num_seqs": 64}}
        vllm.check({**engine_options, **options})     # vLLM's refusal, in one line, or None

Flags are parsed by `FlexibleArgumentParser` with `EngineArgs.add_cli_args` (what `vllm
serve` and `vllm run-batch` take), so a flag means here what it means to vLLM and a new vLLM
brings its new flags: nothing is copied by hand. Each flag given becomes an engine option
under vLLM's name: a `VllmOptions` field where there is one (`gpu_memory_utilization`,
`dtype`, `block_size`, ...), else a key of `llm_kwargs` (passed to `vllm.LLM` as it is), the
same place `--engine-options` puts it. `check` builds vLLM's whole config from the options
as the consumer would (`EngineArgs(...).create_engine_config()`: the model's config read, the
platform's support of the dtype, quantization and parallel sizes checked), so what vLLM would
refuse at load is refused before the broker starts.

NOTE: the child process, not an import here: importing vLLM takes 3 to 15 s and brings
torch's threads into a process that forks the broker, producers and consumers afterwards.
"""

from __future__ import annotations

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

from pipeline.consumer.engines.vllm_options import FIXED_LLM_KWARGS, VllmOptions
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
    """A child process that imports vLLM once and answers `flags` and `check` in turn.
    Owner: the command that starts a run; close it (or use `with`)."""

    def __init__(self) -> None:
        self._cache = tempfile.TemporaryDirectory(prefix="sbrk-vllm-check-")  # nothing lands in ~/.cache
        self._log = tempfile.TemporaryFile()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = {**os.environ, "VLLM_CACHE_ROOT": self._cache.name, "VLLM_LOGGING_LEVEL": "ERROR",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen([sys.executable, "-m", "pipeline.consumer.engines.vllm_args"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._buffer = b""

    def __enter__(self) -> VllmCheck:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def flags(self, args: Sequence[str]) -> dict[str, Any]:
        """vLLM's engine flags `args` as engine options (module doc); EngineOptionsError with
        vLLM's parser's message, or naming a flag the product refuses and why."""
        return self._ask({"flags": list(args)})

    def check(self, options: dict[str, Any]) -> None:
        """EngineOptionsError with vLLM's message where vLLM would refuse the engine options."""
        self._ask({"check": options})

    def _ask(self, request: dict[str, Any]) -> Any:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            raise EngineUnavailableError(f"vLLM's check process ended: {self._log_tail()}") from None
        answer = json.loads(self._read_line())
        if "error" in answer:
            raise EngineOptionsError(answer["error"])
        return answer["ok"]

    def _read_line(self) -> bytes:
        assert self._process.stdout is not None
        deadline = time.monotonic() + VLLM_CHECK_TIMEOUT_S
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailableError(f"vLLM's check did not answer within {VLLM_CHECK_TIMEOUT_S:g} s "
                                             f"(importing vLLM): {self._log_tail()}")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EngineUnavailableError(f"vLLM's check process ended: {self._log_tail()}")
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


def _one_line(exc: BaseException) -> str:
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


def _flags(parser: Any, args: list[str]) -> dict[str, Any]:
    given = vars(parser.parse_args(args))
    defaults = vars(parser.parse_args([]))
    return engine_options_of({dest: plain(value) for dest, value in given.items() if value != defaults.get(dest)})


def _check(options: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    kwargs = VllmOptions.parse(options).llm_kwargs_all()
    EngineArgs(**kwargs).create_engine_config()


def main() -> int:
    """The child: one JSON request a line on stdin ({"flags": [...]} or {"check": {...}}),
    one answer a line on stdout ({"ok": ...} or {"error": "..."}), until end of input."""
    out = sys.stdout
    sys.stdout = sys.stderr  # what vLLM prints goes to the log, never into the answers
    failure = ""
    try:
        parser = _parser()
    except Exception as exc:  # an import that fails: every request gets its message
        parser, failure = None, f"vLLM cannot be imported here: {_one_line(exc)}"
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if parser is None:
                raise EngineUnavailableError(failure)
            if "flags" in request:
                answer = {"ok": _flags(parser, request["flags"])}
            else:
                answer = {"ok": _check(request["check"])}
        except Exception as exc:  # vLLM's refusals come as ValueError, pydantic's ValidationError, ...
            answer = {"error": _one_line(exc)}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
