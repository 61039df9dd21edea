"""A batch job as a workload: each producer reads its share of the input file by offset and
makes each request's item itself.

    workload = JobWorkload(job_input, skip_bits, manifest, model_dir, data_dir, limits, chat_template)
    len(workload)                    # requests to submit in this run
    workload.shares(2)               # [(first, end), (first, end)]: request index ranges

The launcher forks its producers with the workload; nothing parsed crosses the fork (the
workload holds the input's path, its sparse index and one bit per request: which to skip,
answered or still in the store). Producer k takes a contiguous range of request indices
holding about 1/count of the requests to submit, seeks to its first line through the sparse
index, and for each request it takes: parses the line's body (`requests.py`), makes the
prompt with the model's tokenizer and chat template (`chat.py`, loaded in the producer: the
broker never sees text), and submits it as one item whose payload names the job and the
request (`layout.encode_job_payload`), with its generation parameters, every default vLLM's
server would fill in filled in here (`sampling.py`: the rest of the context, the model's
generation config). A request it cannot
make an item of is answered by the producer itself (`rejections.py`): a body the job cannot
serve, a prompt the template or tokenizer fails on (any exception: they are foreign code),
one longer than the model's context or the broker's item cap. One bad request never takes
another with it.

Foreign code runs under limits per request (`PromptLimits`): memory (RLIMIT_DATA, set in the
producer after its tokenizer is loaded: a template that allocates past it fails that request
with MemoryError) and time (the producer says which request it is on and since when, in the
launcher's ledger; the launcher stops a producer that runs past the limit on one request,
or that dies on one, answers that request 400 naming the limit, and starts a producer again
after it: `on_stuck`, `produce(..., start_at=...)`).
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from pipeline.batchjob.chat import TOKENIZE_BYTES_PER_TEXT_BYTE, ChatTokenizer
from pipeline.batchjob.embeddings import KIND_EMBEDDING, EmbeddingFacts, endpoint_refusal
from pipeline.batchjob.layout import INDEX_STRIDE, JOB_FLAG_READS_BODY, encode_job_payload
from pipeline.batchjob.linedigests import LineDigests
from pipeline.batchjob.manifest import INDEX_NAME, INPUT_CHANGED_NAME, JOB_DIR, LINES_NAME, JobManifest, load_manifest
from pipeline.batchjob.params import Refused
from pipeline.batchjob.paths import replace_file
from pipeline.batchjob.rejections import RejectionLog
from pipeline.batchjob.requests import PROMPT_PARAMS, BatchRequest, parse_line
from pipeline.batchjob.sampling import ModelFacts
from pipeline.batchjob.scan import MAX_REQUEST_LINE_BYTES, read_index
from pipeline.producer.workload import WorkItem, Workload
from pipeline.wire.dirpin import DirPin
from pipeline.wire.errors import BadInputError, InputChangedError, JobPathError
from pipeline.wire.generation import LORA_FIRST_MODEL, GenerationParams

# The one model id a job's items use (a job runs one served model).
JOB_MODEL = 0
HTTP_BAD_REQUEST = 400
CODE_CONTEXT_LENGTH = "context_length_exceeded"
# How long the chat template and tokenizer may take on one request, by default: a real
# prompt takes milliseconds (a 3,000-turn conversation under a second), so a minute only
# ever stops a template that loops or a tokenizer that backtracks without end.
DEFAULT_PROMPT_TIME_LIMIT_S = 60.0
# How much memory a producer may allocate past what it holds once its tokenizer is loaded,
# by default: a prompt at the broker's item cap takes a few MiB to render and tokenize, so
# 2 GiB stops only a template that builds strings without end.
DEFAULT_PROMPT_MEMORY_LIMIT_BYTES = 2 << 30


@dataclass(slots=True, frozen=True)
class PromptLimits:
    """Bounds on the foreign code a request runs in its producer, and the longest prompt."""

    time_s: float = DEFAULT_PROMPT_TIME_LIMIT_S
    memory_bytes: int = DEFAULT_PROMPT_MEMORY_LIMIT_BYTES
    max_prompt_tokens: int | None = None  # the model's context less one, or --max-input-len
    context_tokens: int | None = None  # the model's context: prompt and new tokens together
    item_cap_tokens: int = 262_144  # the broker's largest item (ProducerLimits.max_item_tokens)


@dataclass(slots=True, frozen=True)
class JobInput:
    """The scanned input: its path, request count, sparse index (`scan.InputScan`) and the
    path of its lines' digests (`linedigests.LineDigests`)."""

    path: str
    requests: int
    index: np.ndarray
    lines_path: str


class Watch(Protocol):
    """The launcher's ledger slot of one producer (`pipeline/runtime/inventory.py`)."""

    def busy(self, position: int) -> None: ...

    def idle(self) -> None: ...

    def resume_at(self, position: int) -> None: ...


class JobWorkload(Workload):
    """See the module's doc. Forked into the producers; the job completes its skip bits
    before they fork (`__len__`), and `on_stuck` marks a request answered in the launcher."""

    item_stock = False  # the job accounts by request (its answer log), not by broker item
    # Items per submit call: a frame of a job mixes dozens of shapes and their lanes, and the
    # broker appends once per (shape, lane) of a frame; 4,096 items made its CPU per item 2.5x
    # smaller than 256 did (3.4 s against 8.6 s for 100,000 chat requests of 40 shapes).
    feed_chunk_items = 4096

    def __init__(self, job_input: JobInput, skip: np.ndarray, manifest: JobManifest, model_dir: str, data_dir: str,
                 limits: PromptLimits, chat_template: str | None = None, pin: DirPin | None = None) -> None:
        todo = job_input.requests - bits_set(skip, job_input.requests)
        # the served model's items and each LoRA adapter's (its model id LORA_FIRST_MODEL + k)
        models = job_models(len(manifest.adapters))
        super().__init__(f"{job_input.path} (job)", todo, _unused, total_tokens=0, models=models)
        self.job_input = job_input
        self.skip = skip
        self.manifest = manifest
        self.model_dir = model_dir
        self.chat_template = chat_template  # --chat-template's, over the model directory's
        self.data_dir = data_dir
        self.pin = pin  # the data directory as the job checked it: nothing is made by path elsewhere
        self.limits = limits
        self.busy_limit_s = limits.time_s
        self._facts: ModelFacts | None = None  # read in the process that makes items
        self._embedding_facts: EmbeddingFacts | None = None  # there too
        self._line_digests: LineDigests | None = None  # opened there too

    def __len__(self) -> int:
        """Requests to submit: read from the skip bits each time, which the job completes
        once the broker serves (`BatchJob.find_pending`), before the producers fork."""
        return self.job_input.requests - bits_set(self.skip, self.job_input.requests)

    def shares(self, count: int) -> list[tuple[int, int]]:
        """`count` contiguous ranges of request indices holding as many requests to submit as
        each other, to within one. A range may start inside an INDEX_STRIDE block: its producer
        reads from the block's start and skips what comes before (`lines`), at most a block.
        NOTE: cutting at block starts alone left 904 of 5,000 requests to one of two producers."""
        n = self.job_input.requests
        todo = np.cumsum(block_todo(self.skip, n))
        total = int(todo[-1]) if n else 0
        starts = [0]
        for k in range(1, count):
            starts.append(max(starts[-1], self._index_after(-(-total * k // count), todo)))
        starts.append(n)
        return [(starts[k], starts[k + 1]) for k in range(count)]

    def _index_after(self, wanted: int, todo: np.ndarray) -> int:
        """The least index with `wanted` requests to submit before it (`todo`: the running sum of
        `block_todo`)."""
        if wanted <= 0:
            return 0
        block = int(np.searchsorted(todo, wanted, side="left"))
        before = int(todo[block - 1]) if block else 0
        first = block * INDEX_STRIDE
        size = min(INDEX_STRIDE, self.job_input.requests - first)
        done = np.unpackbits(self.skip[first // 8:first // 8 + INDEX_STRIDE // 8], bitorder="little")[:size]
        return first + int(np.searchsorted(np.cumsum(1 - done.astype(np.int64)), wanted - before, side="left")) + 1

    def items(self, producer_index: int = 0, producer_count: int = 1) -> Iterator[WorkItem]:
        """Share `producer_index` of `producer_count`'s items as a producer makes them, made
        in this process with a tokenizer of its own and without limits; a request no item
        can be made of is left out (a checker's view of what the job submits)."""
        first, end = self.shares(producer_count)[producer_index]
        tokenizer = self.tokenizer()
        log = _NoLog()
        for index, line, offset, raw in self.to_do_lines(first, end):
            item = self.make(raw, self._where(index, line, offset, raw), line, tokenizer, log)
            if item is not None:
                yield item

    def tokenizer(self) -> ChatTokenizer:
        """The model's tokenizer with the job's chat template, as every producer loads it."""
        return ChatTokenizer.load(self.model_dir, chat_template=self.chat_template)

    def skipped(self, index: int) -> bool:
        return bool(self.skip[index >> 3] >> (index & 7) & 1)

    def produce(self, submit: Callable[[Iterator[WorkItem], Callable[[int], None]], None], producer_index: int,
                producer_count: int, watch: Watch, stop: Callable[[], bool], start_at: int | None = None) -> None:
        """Producer `producer_index`'s loop: its share's items through `submit(items,
        on_submitted)` (the launcher's feed; `on_submitted(n)` after each call with the items
        submitted so far), from `start_at` when the launcher restarts it."""
        first, end = self.shares(producer_count)[producer_index]
        if start_at is not None:
            first = max(first, start_at)
        tokenizer = self.tokenizer()
        tokenizer.max_text_bytes = self.limits.memory_bytes // TOKENIZE_BYTES_PER_TEXT_BYTE
        tokenizer.one_thread()
        self.model_facts(tokenizer)  # read before the memory limit, as the tokenizer is
        limit_memory(self.limits.memory_bytes)
        log = RejectionLog(self.data_dir, f"p{producer_index}-{os.getpid()}", self.pin)
        positions: deque[tuple[int, int]] = deque()  # (items yielded, the last one's index)
        try:
            items = self._items(first, end, tokenizer, log, watch, stop, positions)

            def on_submitted(count: int) -> None:
                last = None
                while positions and positions[0][0] <= count:
                    last = positions.popleft()[1]
                if last is not None:
                    watch.resume_at(last + 1)

            submit(items, on_submitted)
        except InputChangedError as exc:  # the job stops, saying so (`BatchJob.finish`)
            if self.pin is not None:
                self.pin.check()
            replace_file(os.path.join(self.data_dir, JOB_DIR, INPUT_CHANGED_NAME), [str(exc).encode()])
            raise
        finally:
            log.close()

    def _items(self, first: int, end: int, tokenizer: ChatTokenizer, log: RejectionLog, watch: Watch,
               stop: Callable[[], bool], positions: deque) -> Iterator[WorkItem]:
        yielded = 0
        for index, line, offset, raw in self.to_do_lines(first, end):
            if stop():
                return
            where = self._where(index, line, offset, raw)
            watch.busy(index)
            item = self.make(raw, where, line, tokenizer, log)
            watch.idle()
            if item is not None:
                yielded += 1
                positions.append((yielded, index))
                yield item

    def _where(self, index: int, line: int, offset: int, raw: bytes) -> tuple[int, int, int, int]:
        """(index, offset, length, digest) of a request's line as read now; InputChangedError
        where it is not the line the job's scan read (the file was edited in place)."""
        if self._line_digests is None:
            self._line_digests = LineDigests(self.job_input.lines_path, self.job_input.requests)
        digest = xxhash.xxh3_64_intdigest(raw)
        if digest != self._line_digests[index]:
            raise InputChangedError(f"{self.job_input.path}:{line}: request {index} (byte {offset}) is not the line "
                                    f"the job read when it started: the input file was changed while the job ran")
        return index, offset, len(raw), digest

    def to_do_lines(self, first: int, end: int) -> Iterator[tuple[int, int, int, bytes]]:
        """`lines` of the requests first..end-1 not skipped, read only from the INDEX_STRIDE
        blocks that hold one: a resumed job's producer seeks past the answered part of its
        share rather than reading it a line at a time."""
        todo = block_todo(self.skip, self.job_input.requests)
        for start, stop in to_do_runs(todo, first, end):
            for found in self.lines(start, stop):
                if not self.skipped(found[0]):
                    yield found

    def lines(self, first: int, end: int) -> Iterator[tuple[int, int, int, bytes]]:
        """(index, line number, byte offset, line without its newline) of requests first..end-1."""
        if first >= end:
            return
        entry = self.job_input.index[first // INDEX_STRIDE]
        index, line, offset = first // INDEX_STRIDE * INDEX_STRIDE, int(entry["line"]), int(entry["offset"])
        with open(self.job_input.path, "rb") as f:
            f.seek(offset)
            while index < end:
                raw = f.readline(MAX_REQUEST_LINE_BYTES + 2)
                if not raw:
                    return
                start, offset, line = offset, offset + len(raw), line + 1
                raw = raw[:-1] if raw.endswith(b"\n") else raw
                if not raw.strip():
                    continue
                if index >= first:
                    yield index, line - 1, start, raw
                index += 1

    def make(self, raw: bytes, where: tuple[int, int, int, int], line: int, tokenizer: ChatTokenizer,
              log: RejectionLog) -> WorkItem | None:
        """The request's item; None when it was answered here (logged)."""
        param = None
        try:
            request = parse_line(raw, where[0], line, self.manifest.served_model, self.manifest.tool_calling,
                                 self.manifest.adapters)
            if request.error is not None:
                log.reject(where, HTTP_BAD_REQUEST, request.error, request.error_param)
                return None
            refusal = endpoint_refusal(request.url, request.kind, self.manifest.runner)
            if refusal is not None:
                log.reject(where, HTTP_BAD_REQUEST, refusal, "url")
                return None
            param = PROMPT_PARAMS[request.kind]  # type: ignore[index]
            if request.kind == KIND_EMBEDDING:
                return self._embedding(request, where, tokenizer, log)
            return self._made(request, where, tokenizer, log)
        except BadInputError as exc:
            if isinstance(exc.__cause__, MemoryError):  # the template's own failure, wrapped
                log.reject(where, HTTP_BAD_REQUEST, self._memory_message(), param)
            else:
                log.reject(where, HTTP_BAD_REQUEST, str(exc), param)
        except MemoryError:
            log.reject(where, HTTP_BAD_REQUEST, self._memory_message(), param)
        except Exception as exc:  # noqa: BLE001 - template and tokenizer are foreign code: this request's failure
            log.reject(where, HTTP_BAD_REQUEST, f"making this request's prompt failed: {type(exc).__name__}: "
                       f"{_one_line(exc)}", param)
        return None

    def _memory_message(self) -> str:
        return (f"making this request's prompt needed more than the {self.limits.memory_bytes >> 20:,} MiB memory "
                f"limit of the chat template and tokenizer (--prompt-memory-limit-mb)")

    def _made(self, request: BatchRequest, where: tuple[int, int, int, int], tokenizer: ChatTokenizer,
              log: RejectionLog) -> WorkItem | None:
        if request.kind == "chat":
            prompt = tokenizer.chat_prompt(request.messages, request.tools.tools, request.template_kwargs)
        else:
            prompt = tokenizer.completion_prompt(request.prompt)
        length = int(prompt.tokens.shape[0])
        if not length:
            raise BadInputError("the prompt is empty")
        limit, what = self._prompt_limit()
        if length > limit:
            log.reject(where, HTTP_BAD_REQUEST, f"the prompt is {length:,} tokens, more than the {limit:,} {what}: "
                       f"shorten it", "messages" if request.kind == "chat" else "prompt", CODE_CONTEXT_LENGTH)
            return None
        asked = request.params.max_tokens
        context = self.limits.context_tokens
        if asked is not None and context is not None and length + asked > context:
            name = "max_completion_tokens" if request.kind == "chat" else "max_tokens"
            log.reject(where, HTTP_BAD_REQUEST, f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This "
                       f"model's maximum context length is {context} tokens and your request has {length} input "
                       f"tokens ({asked} > {context} - {length})", name)
            return None
        try:
            params = self.model_facts(tokenizer).params_for(request.params, length, context)
        except Refused as refused:
            log.reject(where, HTTP_BAD_REQUEST, str(refused), refused.param)
            return None
        prefix = prompt.prefix_len
        flags = JOB_FLAG_READS_BODY if request.answer_reads_body else 0
        payload = encode_job_payload(self.manifest.job_id, *where, time.monotonic_ns(), flags)
        return WorkItem(model=request.model_id, components=list(prompt.components),
                        suffix=np.asarray(prompt.tokens[prefix:], dtype=np.int32), payload=payload,
                        timestamp_ms=None, line=0, params=params, known_signature=prompt.signature)

    def _embedding(self, request: BatchRequest, where: tuple[int, int, int, int], tokenizer: ChatTokenizer,
                   log: RejectionLog) -> WorkItem | None:
        """An embeddings request's item: its inputs' tokens back to back, each input's length
        in its parameters; None where it was answered here (an input past the context, all of
        them past the broker's item, dimensions the model cannot give)."""
        asked = request.embedding
        assert asked is not None
        if self._embedding_facts is None:
            self._embedding_facts = EmbeddingFacts.load(self.model_dir)
        try:
            self._embedding_facts.check(asked.dimensions, self.manifest.served_model)
        except Refused as refused:
            log.reject(where, HTTP_BAD_REQUEST, str(refused), refused.param)
            return None
        names = [f"input[{k}]" for k in range(len(asked.inputs))] if len(asked.inputs) > 1 else ["input"]
        parts = [tokenizer.completion_prompt(one, f"the embeddings {name}", name).tokens
                 for one, name in zip(asked.inputs, names)]
        lengths = tuple(int(p.shape[0]) for p in parts)
        limit, what = self._prompt_limit()
        context = self.limits.context_tokens or limit
        longest = max(lengths)
        if longest > context:  # vLLM's message
            log.reject(where, HTTP_BAD_REQUEST, f"This model's maximum context length is {context} tokens. However, "
                       f"you requested {longest} tokens in the input for embedding generation (input "
                       f"{lengths.index(longest)}). Please reduce the length of the input.", "input",
                       CODE_CONTEXT_LENGTH)
            return None
        if sum(lengths) > limit:  # one item holds them all
            said = (f"the input is {sum(lengths):,} tokens, more than the {limit:,} {what}: shorten it"
                    if len(lengths) == 1 else f"the {len(lengths):,} inputs are {sum(lengths):,} tokens together, "
                    f"more than the {limit:,} {what}: split the request")
            log.reject(where, HTTP_BAD_REQUEST, said, "input", CODE_CONTEXT_LENGTH)
            return None
        params = GenerationParams(embed=True, input_lengths=lengths, dimensions=asked.dimensions)
        flags = JOB_FLAG_READS_BODY if request.answer_reads_body else 0
        payload = encode_job_payload(self.manifest.job_id, *where, time.monotonic_ns(), flags)
        return WorkItem(model=request.model_id, components=[], suffix=np.concatenate(parts).astype(np.int32, copy=False),
                        payload=payload, timestamp_ms=None, line=0, params=params)

    def model_facts(self, tokenizer: ChatTokenizer) -> ModelFacts:
        """The model's sampling defaults and vocabulary, read once per process."""
        if self._facts is None:
            self._facts = ModelFacts.load(self.model_dir, tokenizer.vocab_size)
        return self._facts

    def _prompt_limit(self) -> tuple[int, str]:
        cap = self.limits.item_cap_tokens
        given = self.limits.max_prompt_tokens
        if given is not None and given < cap:
            return given, "this job runs (the model's context less one token, or --max-input-len)"
        return cap, "the broker takes in one item"

    def on_stuck(self, position: int, why: str) -> None:
        """The launcher stopped a producer on request `position` (`why`: past the time limit,
        or it died there): that request is answered 400 here, and skipped by the producer the
        launcher starts again (forked from this process after this call)."""
        self.skip[position >> 3] |= np.uint8(1 << (position & 7))
        for index, _line, offset, raw in self.lines(position, position + 1):
            log = RejectionLog(self.data_dir, "supervisor", self.pin)
            try:
                log.reject((index, offset, len(raw), xxhash.xxh3_64_intdigest(raw)), HTTP_BAD_REQUEST,
                           f"making this request's prompt was stopped: {why}", None)
            finally:
                log.close()

    def __repr__(self) -> str:
        return f"BatchJob({self.job_input.path!r}, {len(self)} requests to submit)"


class _NoLog:
    """A rejection log that keeps nothing (`items`: a view, not a run)."""

    def reject(self, *_args, **_kwargs) -> None:
        pass


def _unused(_k: int) -> WorkItem:
    raise AssertionError("a job's items are made by `produce`, with the producer's tokenizer")


def job_models(adapters: int) -> tuple[int, ...]:
    """The model ids of a job's items: the served model's, then each LoRA adapter's."""
    return (JOB_MODEL, *range(LORA_FIRST_MODEL, LORA_FIRST_MODEL + adapters))


def bits_set(bits: np.ndarray, count: int) -> int:
    """How many of the first `count` bits of a bit set (bit k of byte k // 8) are set,
    counted a byte at a time (never a byte per bit: memory stays 1/8 of the set's)."""
    whole, rest = divmod(count, 8)
    found = int(np.bitwise_count(bits[:whole]).sum(dtype=np.int64))
    if rest:
        found += int(np.bitwise_count(bits[whole] & np.uint8((1 << rest) - 1)))
    return found


def set_bits(bits: np.ndarray, indices: np.ndarray) -> int:
    """Set bits `indices` of a bit set (bit k of byte k // 8), all at once; how many were not
    set before (an index given twice counts once)."""
    indices = np.unique(indices.astype(np.int64, copy=False))
    fresh = indices[(bits[indices >> 3] >> (indices & 7).astype(np.uint8) & 1) == 0]
    np.bitwise_or.at(bits, fresh >> 3, (np.uint8(1) << (fresh & 7).astype(np.uint8)))
    return int(fresh.size)


def block_todo(skip: np.ndarray, count: int) -> np.ndarray:
    """Requests not skipped in each INDEX_STRIDE-request block of the first `count` (the
    last block may be short), from the bit set `skip`, a block's bytes at a time."""
    blocks = -(-count // INDEX_STRIDE)
    held = np.zeros(blocks * (INDEX_STRIDE // 8), dtype=np.uint8)
    whole, rest = divmod(count, 8)
    held[:whole] = skip[:whole]
    if rest:
        held[whole] = skip[whole] & np.uint8((1 << rest) - 1)
    skipped = np.bitwise_count(held).reshape(blocks, INDEX_STRIDE // 8).sum(axis=1, dtype=np.int64)
    sizes = np.full(blocks, INDEX_STRIDE, dtype=np.int64)
    if blocks:
        sizes[-1] = count - (blocks - 1) * INDEX_STRIDE
    return sizes - skipped


def to_do_runs(todo: np.ndarray, first: int, end: int) -> list[tuple[int, int]]:
    """The index ranges within first..end-1 of the runs of consecutive INDEX_STRIDE blocks
    with a request to do (`todo`: `block_todo`'s counts), in order."""
    if first >= end:
        return []
    low, high = first // INDEX_STRIDE, -(-end // INDEX_STRIDE)
    busy = np.concatenate(([False], todo[low:high] > 0, [False]))
    edges = np.flatnonzero(busy[1:] != busy[:-1]) + low
    return [(max(first, a * INDEX_STRIDE), min(end, b * INDEX_STRIDE))
            for a, b in zip(edges[::2].tolist(), edges[1::2].tolist())]


def limit_memory(margin_bytes: int) -> None:
    """Cap this process's data memory (RLIMIT_DATA) at what it holds now plus `margin_bytes`."""
    with open("/proc/self/status", "rb") as f:
        held_kib = next(int(line.split()[1]) for line in f if line.startswith(b"VmData:"))
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    want = held_kib * 1024 + margin_bytes
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (want, hard))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def job_workload(data_dir: str, model_dir: str, chat_template: str | None = None) -> JobWorkload:
    """Every request of the job on `data_dir` as its producers make them (a checker's view:
    `pipeline/audit`), from the job's manifest and input index (and the job's
    --chat-template, where it had one)."""
    manifest = load_manifest(data_dir)
    if manifest is None:
        raise JobPathError(f"{data_dir}: not a batch job's data directory (no job manifest)")
    index = read_index(os.path.join(data_dir, JOB_DIR, INDEX_NAME), manifest)
    skip = np.zeros((manifest.requests + 7) // 8, dtype=np.uint8)
    return JobWorkload(JobInput(manifest.input_path, manifest.requests, index,
                                os.path.join(data_dir, JOB_DIR, LINES_NAME)), skip, manifest, model_dir, data_dir,
                       PromptLimits(), chat_template)
