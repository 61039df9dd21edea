"""A vllm engine's options (`--engine-options`, `[engine_options]`, vLLM's engine flags),
checked without loading anything; `vllm.py` runs the engine they describe.

vLLM's engine flags travel as typed (`vllm_flags`) and are read by vLLM's own parser where
vLLM is imported anyway (each consumer as its engine starts, and the command's check beside
it, `vllm_args.py`), so no process waits for a vLLM import only to read them. What has to be
known of them before (which options they name, for the host's fill-ins and the job's
manifest) is read off the words here (`flag_words`), without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.consumer.engines.base import MAX_PARALLEL_SIZE
from pipeline.wire.errors import EngineOptionsError

# vLLM's default KV block size on GPUs (the CPU backend wants multiples of 32). The engine
# passes it explicitly: the cacheable-token accounting must use the engine's own blocks.
DEFAULT_BLOCK_SIZE_TOKENS = 16
# Generation defaults of an item without parameters (a token-id workload's, `pipeline
# launch`): greedy, so that a run's outputs repeat; 16 new tokens, a short answer's worth.
# A batch job's items never take them: their producer fills in vLLM's server's defaults.
DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_P = 1.0
# Settings the accounting depends on: never taken from `llm_kwargs`.
FIXED_LLM_KWARGS = {"enable_prefix_caching": True, "disable_log_stats": False}

@dataclass(slots=True, frozen=True)
class VllmOptions:
    """The `engine_options` of a vllm consumer (`--engine-options` / `[engine_options]`)."""

    model: str = ""  # a model directory (or a hub name where the machine reaches a hub)
    kv_cache_memory_bytes: int | None = None  # the KV cache's size; or a GPU memory fraction:
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE_TOKENS
    dtype: str = "auto"
    tensor_parallel_size: int = 1  # GPUs of a pipeline stage; the launcher gives the engine
    pipeline_parallel_size: int = 1  # tensor x pipeline GPUs (CUDA_VISIBLE_DEVICES)
    enforce_eager: bool = False
    load_format: str = "auto"  # "dummy": random weights, nothing read (the CPU tests' tiny model)
    runner: str = "auto"  # vLLM's: generate, or pooling (embeddings); auto by the architecture
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    # The engine core in the consumer's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0; with
    # one GPU the "uni" executor, so one process per consumer) instead of vLLM's default, a
    # process of its own that schedules and runs steps while the consumer reads segments,
    # writes results and talks to the broker (see VllmEngine).
    in_process: bool = False
    cache_dir: str | None = None  # VLLM_CACHE_ROOT and TMPDIR go under it (the run's directory)
    cpu_threads: int | None = None  # OMP_NUM_THREADS: 1 where two engines share 2 cores
    llm_kwargs: dict = field(default_factory=dict)  # passed to vllm.LLM as they are
    # vLLM's --lora-modules ([{"name", "path"}]): adapter k serves the broker's model k + 1
    # (base.LORA_FIRST_MODEL), and LoRA is enabled (vLLM's enable_lora) where there are any.
    lora_modules: list = field(default_factory=list)
    # vLLM's engine flags as the command line gave them (["--dtype", "bfloat16", ...]), read
    # by vLLM's parser as the engine starts (`with_flag_options`); they win over the above.
    vllm_flags: list = field(default_factory=list)

    @classmethod
    def parse(cls, options: dict[str, Any]) -> VllmOptions:
        """The options, checked without loading anything; EngineOptionsError names every
        unknown or wrong one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise EngineOptionsError(f"vllm engine: unknown options {', '.join(unknown)}; known: "
                                     f"{', '.join(sorted(known))}")
        parsed = cls(**options)
        wrong = parsed._problems()
        if wrong:
            raise EngineOptionsError("vllm engine: " + "; ".join(wrong))
        return parsed

    def _problems(self) -> list[str]:
        wrong = []
        if not isinstance(self.model, str) or not self.model:
            wrong.append("model (a model directory) is required")
        for name in ("kv_cache_memory_bytes", "max_model_len", "block_size", "tensor_parallel_size",
                     "pipeline_parallel_size", "max_tokens", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                wrong.append(f"{name} must be a positive integer, got {value!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if isinstance(getattr(self, name), int) and getattr(self, name) > MAX_PARALLEL_SIZE:
                wrong.append(f"{name} must be at most {MAX_PARALLEL_SIZE}, got {getattr(self, name)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            wrong.append(f"seed must be an integer, got {self.seed!r}")
        if self.kv_cache_memory_bytes is not None and self.gpu_memory_utilization is not None:
            wrong.append("give kv_cache_memory_bytes or gpu_memory_utilization, not both")
        if self.gpu_memory_utilization is not None and not _number_in(self.gpu_memory_utilization, 0, 1):
            wrong.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not _number_in(self.top_p, 0, 1):
            wrong.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_number_in(self.temperature, -1, float("inf")) and self.temperature >= 0):
            wrong.append(f"temperature must be a number >= 0, got {self.temperature!r}")
        for name in ("enforce_eager", "in_process"):
            if not isinstance(getattr(self, name), bool):
                wrong.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            wrong.append(f"runner must be auto, generate or pooling, got {self.runner!r}")
        for name in ("dtype", "load_format", "cache_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                wrong.append(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.lora_modules, list) or not all(
                isinstance(m, dict) and set(m) == {"name", "path"} and all(isinstance(v, str) and v for v in m.values())
                for m in self.lora_modules):
            wrong.append(f"lora_modules must be a list of {{name, path}} tables, got {self.lora_modules!r}")
        if not isinstance(self.vllm_flags, list) or not all(isinstance(word, str) for word in self.vllm_flags):
            wrong.append(f"vllm_flags must be a list of strings, got {self.vllm_flags!r}")
        if not isinstance(self.llm_kwargs, dict):
            wrong.append(f"llm_kwargs must be a table, got {self.llm_kwargs!r}")
        else:
            clash = sorted(set(self.llm_kwargs) & ({f.name for f in fields(self)} | set(FIXED_LLM_KWARGS)))
            if clash:
                wrong.append(f"llm_kwargs may not set {', '.join(clash)} (an engine option, or a setting the "
                             f"cache accounting needs)")
        return wrong

    def llm_kwargs_all(self) -> dict[str, Any]:
        """The keyword arguments of `vllm.LLM`."""
        assert not self.vllm_flags, "vLLM's flags are read first (with_flag_options)"
        kwargs: dict[str, Any] = {
            "model": self.model, "block_size": self.block_size, "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size, "pipeline_parallel_size": self.pipeline_parallel_size,
            "enforce_eager": self.enforce_eager, "load_format": self.load_format, "runner": self.runner,
            **FIXED_LLM_KWARGS,
        }
        for name in ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len", "seed"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        # One process per GPU beyond the first: vLLM's multiprocessing executor starts them.
        if self.world_size > 1:
            kwargs["distributed_executor_backend"] = "mp"
        elif self.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        if self.lora_modules:
            kwargs["enable_lora"] = True
        return {**kwargs, **self.llm_kwargs}

    @property
    def world_size(self) -> int:
        """The GPUs (on the CPU build, worker processes) of one engine."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _number_in(value: object, low: float, high: float) -> bool:
    """A real number (not a bool) in (low, high]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low < value <= high


def with_flag_options(options: dict[str, Any], flag_options: dict[str, Any]) -> dict[str, Any]:
    """`options` without their `vllm_flags`, with the options vLLM's parser read from them
    (`vllm_args.read_flags`) over: a flag wins, and llm_kwargs are merged key by key."""
    merged = {key: value for key, value in options.items() if key != "vllm_flags"}
    for key, value in flag_options.items():
        merged[key] = {**merged.get(key, {}), **value} if key == "llm_kwargs" else value
    return merged


def flag_words(words: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """vLLM's flags as typed, read without vLLM: (dest, value) a flag, in order. A dest is
    the flag's long name with underscores (as vLLM's parser names it: `--max-num-seqs` and
    `--max_num_seqs` are max_num_seqs); the value is the words up to the next flag (`=`
    joined), one word as a number or boolean where it reads as one, True for none, and
    `--no-X` is X False (vLLM's booleans are argparse's BooleanOptionalAction). A short
    flag (`-q`) is named as typed: only vLLM's parser knows its long name."""
    found: list[tuple[str, Any]] = []
    for word in words:
        if word.startswith("-") and not _is_number(word):
            name, equals, value = word.partition("=")
            dest = name.lstrip("-").replace("-", "_") if name.startswith("--") else name
            found.append((dest, [value] if equals else []))
        elif found:
            found[-1][1].append(word)
    return [_flag_value(dest, values) for dest, values in found]


def flag_option_names(options: dict[str, Any]) -> set[str]:
    """The engine options `options` set, those of its vLLM flags among them (`flag_words`):
    what the host must not fill in."""
    names = {key for key in options if key not in ("vllm_flags", "llm_kwargs")}
    kwargs = options.get("llm_kwargs")
    names |= set(kwargs) if isinstance(kwargs, dict) else set()
    return names | {dest for dest, _value in flag_words(options.get("vllm_flags") or [])}


def _flag_value(dest: str, values: list[str]) -> tuple[str, Any]:
    if dest.startswith("no_") and not values:
        return dest[3:], False
    if not values:
        return dest, True
    if len(values) > 1:
        return dest, values
    word = values[0]
    if word.lower() in ("true", "false"):
        return dest, word.lower() == "true"
    if _is_number(word):
        number = float(word)
        return dest, int(number) if number.is_integer() and "." not in word and "e" not in word.lower() else number
    return dest, word


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return word.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")
