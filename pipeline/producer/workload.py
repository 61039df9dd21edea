"""Workload files and the embedded demo workload, as work items ready to submit (SPEC §1, §7).

Pure code: no processes, no clock, no sockets. A `Workload` is validated whole when it is
loaded and makes its `WorkItem`s lazily, so several producers can each take a round-robin
share (`Workload.items(index, count)`) of one file without holding every prompt in memory.

Two JSON-lines formats, one per file, told apart by the first non-blank line's keys:

- the product's own, one item a line with its token ids:

      {"model": 0, "components": [[1, 2, 3], [4, 5]], "suffix": [6, 7], "payload": "job-1",
       "timestamp_ms": 12.5}

  `model` defaults to 0, `components` and `suffix` to [], `payload` (text, sent as UTF-8) to
  "", `timestamp_ms` to none (no replay time). The prompt is the components then the suffix;
  the components are the cacheable prefix whose signature names the item's shape (SPEC §1).
- the Mooncake trace (`../shared/workloads/README.md`), which carries no token ids:

      {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152]}

  Each 512-token block's ids are made from its hash id alone (the same id gives the same
  tokens wherever it appears); the prompt is the blocks cut to `input_length` (a prompt
  longer than its blocks is filled from its line number). The leading blocks the request
  shares with other requests of the file (`shared_block_runs`) become its components, one
  per whole block; the payload is the line number as text; the model is 0.

Made-up token ids (the Mooncake blocks and the demo's prompts) are drawn in [0, vocab_size):
VOCAB_SIZE unless the caller passes the model's own (`pipeline launch` does for a vllm
engine, from the model's config.json: an id past a model's vocabulary fails that item).

Bad input (SPEC §8), decided by the team: a malformed line makes the whole run refuse to
start. The file is validated completely before anything is submitted, and the WorkloadError
lists the first 10 bad lines (`path:line: why`) and how many there are in all, because a
half-submitted workload is hard to resume (which items went in, which did not?) and an
offline job should fail before it spends GPU time.
NOTE: skipping bad lines and submitting the rest was rejected for those two reasons; a user
who wants that can filter the file first, knowing which lines they dropped.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.producer.producer import ProducerLimits
from pipeline.producer.signature import INT32_MAX, INT32_MIN
from pipeline.producer.signature import signature as shape_signature
from pipeline.wire.errors import WorkloadError
from pipeline.wire.generation import GenerationParams
from pipeline.wire.textfiles import external_lines, listed

# Tokens per Mooncake block: the trace's hash ids name blocks of 512 tokens (its README).
MOONCAKE_BLOCK_TOKENS = 512
# Range of made-up token ids, [0, 32,000): the vocabulary of Llama 2 and Mistral, so the ids
# are valid for the common 32k-vocabulary models as well as for the sim engine (which only
# hashes them).
VOCAB_SIZE = 32_000
# Largest vocabulary a made-up id may be drawn from: ids are int32 (the ring's layout).
MAX_VOCAB_SIZE = INT32_MAX + 1
# How many bad lines a WorkloadError lists before the total: enough to show the pattern,
# few enough that a file of nothing but bad lines does not bury the message.
MAX_LISTED_ERRORS = 10
# Largest Mooncake hash id: ids are kept in int64 arrays (the trace's go up to ~44,000).
MAX_HASH_ID = (1 << 63) - 1

# Seeds of the token generator, one per use, so that a Mooncake block, the fill of a line
# and a demo prompt with equal numeric ids still get unrelated tokens (arbitrary constants,
# spelled as ASCII so they are recognisable).
BLOCK_STREAM = 0x6D6F_6F6E_6361_6B65  # "mooncake"
FILL_STREAM = 0x6669_6C6C_7461_696C  # "filltail"

_OWN_KEYS = frozenset({"model", "components", "suffix", "payload", "timestamp_ms"})
_TRACE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
# Keys that only one format has: they decide a line's format.
_OWN_MARKS = frozenset({"components", "suffix"})
_TRACE_MARKS = frozenset({"hash_ids", "input_length"})
_OWN = "product's own"
_TRACE = "Mooncake"

# splitmix64's increment and multipliers (Steele, Lea, Flood 2014).
_GAMMA = np.uint64(0x9E37_79B9_7F4A_7C15)
_MIX_1 = np.uint64(0xBF58_476D_1CE4_E5B9)
_MIX_2 = np.uint64(0x94D0_49BB_1331_11EB)


@dataclass(slots=True, eq=False)
class WorkItem:
    """One prompt to submit: its cacheable components, the rest (suffix), and its metadata.

    Arrays are int32 and may be shared with other items of the same shape (they are read-only
    then): treat an item as read-only. `line` is the 1-based line of its file, 0 if generated.
    `known_signature` is the signature when whoever made the item already had it (cached per
    distinct component list); None means it is computed on first use.
    """

    model: int
    components: list[np.ndarray]
    suffix: np.ndarray
    payload: bytes
    timestamp_ms: float | None
    line: int
    known_signature: int | None = None
    params: GenerationParams | None = None  # how the engine generates for it; None: its defaults

    @property
    def prefix_len(self) -> int:
        """Tokens covered by the components (the cacheable prefix)."""
        return sum(len(c) for c in self.components)

    @property
    def length(self) -> int:
        """Tokens in the whole prompt."""
        return self.prefix_len + len(self.suffix)

    @property
    def tokens(self) -> np.ndarray:
        """The prompt: the components then the suffix, one new int32 array."""
        return np.concatenate([*self.components, self.suffix]).astype(np.int32, copy=False)

    @property
    def signature(self) -> int:
        """The shape signature of the components (`pipeline.producer.signature`)."""
        if self.known_signature is None:
            self.known_signature = int(shape_signature(self.components))
        return self.known_signature


class Workload:
    """A validated workload: `count` items that are made on demand by `build(index)`.

    Owner: whoever loaded it. Immutable after construction: own-format items are held and
    served as they are, Mooncake and demo items are made afresh on each pass (a builder may
    cache signatures, an idempotent insert), so threads or forked producers may iterate one
    Workload at the same time as long as nobody changes an item.

        workload = load_workload("jobs.jsonl")
        len(workload), workload.total_tokens, workload.models
        for item in workload.items(producer_index=1, producer_count=4): ...  # items 1, 5, 9...
    """

    def __init__(self, source: str, count: int, build: Callable[[int], WorkItem], *,
                 total_tokens: int, models: tuple[int, ...], block_tokens: int | None = None) -> None:
        assert count >= 0, count  # a file's holds at least one item; a job resumed may have none left
        self.source = source
        # The block size its prefixes are defined at, if the format has one (Mooncake's 512).
        self.block_tokens = block_tokens
        self.total_tokens = total_tokens
        self.models = models  # the model ids its items use, ascending
        self._count = count
        self._build = build

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[WorkItem]:
        return self.items(0, 1)

    def items(self, producer_index: int = 0, producer_count: int = 1) -> Iterator[WorkItem]:
        """Producer `producer_index`'s share of `producer_count`: items index, index + count,
        index + 2 * count... in file order. The shares are disjoint and together the whole."""
        if producer_count < 1 or not 0 <= producer_index < producer_count:
            raise ValueError(f"producer {producer_index} of {producer_count}: need 0 <= index < count")
        return (self._build(k) for k in range(producer_index, self._count, producer_count))

    def head(self, count: int) -> Workload:
        """The first `count` items (all of them if there are fewer), for `--items N`."""
        if count < 1:
            raise ValueError(f"head({count}): a workload holds at least one item")
        if count >= self._count:
            return self
        tokens, models = 0, set()
        for k in range(count):  # one build per item (a trace's makes its tokens), none kept
            item = self._build(k)
            tokens += item.length
            models.add(item.model)
        return Workload(f"{self.source} (first {count})", count, self._build, total_tokens=tokens,
                        models=tuple(sorted(models)), block_tokens=self.block_tokens)

    def __repr__(self) -> str:
        return f"Workload({self.source!r}, {self._count} items, {self.total_tokens} tokens)"


def hashed_tokens(stream: int, ids: np.ndarray | Sequence[int], count: int,
                  vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """`count` token ids in [0, vocab_size) for each id, as a (len(ids), count) int32 array:
    a function of (stream, id, position, vocab_size) only, the same on every machine and
    NumPy version.

    NOTE: `np.random.default_rng((seed, block_id))` per block was rejected: NumPy does not
    promise a Generator's stream across versions, and making one generator per block costs
    more than the block's tokens (the Mooncake trace has ~120,000 blocks). This is
    splitmix64, vectorised over every block of a prompt.
    """
    seeds = _mix64(_mix64(np.asarray(ids, dtype=np.uint64)) ^ np.uint64(stream))
    states = seeds[:, None] + np.arange(1, count + 1, dtype=np.uint64) * _GAMMA
    return (_mix64(states) % np.uint64(vocab_size)).astype(np.int32)


def check_vocab_size(vocab_size: int) -> None:
    """A vocabulary to draw made-up ids from: 1 to MAX_VOCAB_SIZE ids (ValueError)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size!r}: must be an integer in [1, {MAX_VOCAB_SIZE:,}]")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


def shared_block_runs(hash_ids: Sequence[Sequence[int]]) -> list[int]:
    """How many leading blocks each request shares with the other requests of its file.

    A block at position i is shared when another request has the same hash id at position
    i (one pass counts every (position, id) pair of the file); a request's shared run is its
    longest prefix of shared blocks. Three requests:

        shared_block_runs([[1, 2, 3], [1, 2, 4], [1, 5, 3]]) == [3, 2, 1]

    (0, 1) is in all three and (1, 2) in the first two; (2, 3) is in the first and the
    third, so all of the first request counts as shared although no single other request
    has all of it. Mooncake's ids hash the block and everything before it, so in a real
    trace equal ids at one position mean equal prefixes and that case does not arise.
    """
    counts = Counter((position, block) for ids in hash_ids for position, block in enumerate(ids))
    runs = []
    for ids in hash_ids:
        run = 0
        while run < len(ids) and counts[(run, ids[run])] > 1:
            run += 1
        runs.append(run)
    return runs


# The longest workload line read: a prompt of the largest item (262,144 token ids, at most
# 11 characters each in JSON) and the largest payload fit in 3 MiB; 16 MiB leaves room for
# spacing, and bounds what a file of one endless line (a device) can cost.
MAX_WORKLOAD_LINE_BYTES = 16 << 20


def load_workload(path: str | os.PathLike[str], limits: ProducerLimits = ProducerLimits(),
                  vocab_size: int = VOCAB_SIZE) -> Workload:
    """Read and validate a workload file of either format (see the module docstring); a
    Mooncake trace's made-up token ids are drawn below `vocab_size` (an own-format file's ids
    are its own).

    Every line is checked (JSON, types, int32 token ids, a non-empty prompt within
    `limits.max_item_tokens`, payload within `limits.max_payload_bytes`, model below
    `limits.max_models`) before this returns; any problem raises one WorkloadError naming
    the first bad lines as path:line and the total count. Nothing is submitted here.
    """
    name = os.fspath(path)
    check_vocab_size(vocab_size)
    parser = _FileParser(name, limits, vocab_size)
    for number, raw in external_lines(name, MAX_WORKLOAD_LINE_BYTES, WorkloadError, "workload file"):
        if raw is None:
            parser.bad(number, f"longer than {MAX_WORKLOAD_LINE_BYTES:,} bytes (the longest prompt and payload "
                               f"fit in far less)")
        else:
            parser.add(number, raw)
    return parser.finish()


class _FileParser:
    """Validates one file line by line, keeping the light records it will serve from and
    the first errors. Owner: `load_workload`, for one file; single-threaded."""

    def __init__(self, path: str, limits: ProducerLimits, vocab_size: int = VOCAB_SIZE) -> None:
        self.path = path
        self.limits = limits
        self.vocab_size = vocab_size
        self.kind: str | None = None
        self.kind_line = 0
        self.own_items: list[WorkItem] = []
        self.trace_records: list[_TraceRecord] = []
        self.interned: dict[tuple[bytes, ...], tuple[list[np.ndarray], int]] = {}
        self.errors: list[str] = []
        self.bad_lines = 0

    def add(self, line: int, raw: bytes) -> None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._bad(line, f"not UTF-8 ({exc.reason} at byte {exc.start})")
            return
        if not text.strip():
            return
        try:
            record = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            self._bad(line, f"not JSON ({exc})")
            return
        try:
            if not isinstance(record, dict):
                raise WorkloadError(f"a line must be a JSON object, got {type(record).__name__}")
            if self._kind_of(record, line) == _OWN:
                self.own_items.append(_parse_own(record, line, self.limits, self.interned))
            else:
                self.trace_records.append(_parse_trace(record, line, self.limits))
        except WorkloadError as exc:
            self._bad(line, str(exc))

    def bad(self, line: int, why: str) -> None:
        """Line `line` cannot be used: counted, and named among the first errors."""
        self._bad(line, why)

    def _bad(self, line: int, why: str) -> None:
        self.bad_lines += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append(f"{self.path}:{line}: {why}")

    def _kind_of(self, record: dict, line: int) -> str:
        """This line's format; the first recognised line sets the file's."""
        keys = set(record)
        own, trace = bool(keys & _OWN_MARKS), bool(keys & _TRACE_MARKS)
        if own and trace:
            raise WorkloadError(f"mixes fields of both formats: {listed(sorted(keys))}")
        if not own and not trace:
            raise WorkloadError(
                f"neither format: expected 'components'/'suffix' (own format) or "
                f"'hash_ids'/'input_length' (Mooncake), got keys {listed(sorted(keys))}"
            )
        kind = _OWN if own else _TRACE
        if self.kind is None:
            self.kind, self.kind_line = kind, line
        elif kind != self.kind:
            raise WorkloadError(
                f"this line is in the {kind} format but the file is in the {self.kind} format "
                f"(set by line {self.kind_line}); one file holds one format"
            )
        return kind

    def finish(self) -> Workload:
        if self.bad_lines:
            plural = "s" if self.bad_lines != 1 else ""
            shown = f", the first {len(self.errors)}" if self.bad_lines > len(self.errors) else ""
            raise WorkloadError(
                f"{self.path}: {self.bad_lines} bad line{plural}; nothing was submitted and the "
                f"run does not start{shown}:\n  " + "\n  ".join(self.errors)
            )
        if self.kind == _OWN:
            items = self.own_items
            return Workload(self.path, len(items), items.__getitem__,
                            total_tokens=sum(item.length for item in items),
                            models=tuple(sorted({item.model for item in items})))
        if self.kind == _TRACE:
            records = self.trace_records
            return Workload(self.path, len(records), _TraceItems(records, self.vocab_size),
                            total_tokens=sum(r.input_length for r in records), models=(0,),
                            block_tokens=MOONCAKE_BLOCK_TOKENS)
        raise WorkloadError(f"{self.path}: no work items (the file is empty or blank)")


def _parse_own(record: dict, line: int, limits: ProducerLimits,
               interned: dict[tuple[bytes, ...], tuple[list[np.ndarray], int]]) -> WorkItem:
    """One own-format line as a WorkItem. Equal component lists share their arrays and
    signature through `interned`."""
    _reject_unknown(record, _OWN_KEYS)
    model = _integer(record.get("model", 0), "model", 0, limits.max_models - 1)
    raw_components = record.get("components", [])
    if not isinstance(raw_components, list):
        raise WorkloadError(f"components must be a list of token-id lists, got {_show(raw_components)}")
    components = [_token_array(c, f"components[{k}]") for k, c in enumerate(raw_components)]
    for k, component in enumerate(components):
        if not len(component):
            raise WorkloadError(f"components[{k}] is empty (a component covers at least one token)")
    suffix = _token_array(record.get("suffix", []), "suffix")
    length = sum(len(c) for c in components) + len(suffix)
    if length == 0:
        raise WorkloadError("empty prompt: components and suffix hold no tokens")
    if length > limits.max_item_tokens:
        raise WorkloadError(f"prompt of {length} tokens, limit {limits.max_item_tokens}")
    text = record.get("payload", "")
    if not isinstance(text, str):
        raise WorkloadError(f"payload must be a string, got {_show(text)}")
    try:
        payload = text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") is valid JSON, not UTF-8
        raise WorkloadError(f"payload is not valid Unicode text ({exc.reason} at character {exc.start}: "
                            f"{text[exc.start:exc.end]!r})") from exc
    if len(payload) > limits.max_payload_bytes:
        raise WorkloadError(f"payload of {len(payload)} bytes, limit {limits.max_payload_bytes}")
    key = tuple(c.tobytes() for c in components)
    if key not in interned:
        for component in components:
            component.flags.writeable = False  # shared by every item of this shape
        interned[key] = (components, int(shape_signature(components)))
    shared, signature = interned[key]
    suffix.flags.writeable = False
    return WorkItem(model, list(shared), suffix, payload,
                    _timestamp(record.get("timestamp_ms"), "timestamp_ms", optional=True), line, signature)


@dataclass(slots=True)
class _TraceRecord:
    """A validated Mooncake line: what it takes to make its prompt later."""

    line: int
    timestamp_ms: float
    input_length: int
    hash_ids: np.ndarray  # int64


def _parse_trace(record: dict, line: int, limits: ProducerLimits) -> _TraceRecord:
    _reject_unknown(record, _TRACE_KEYS)
    for key in ("timestamp", "input_length", "hash_ids"):
        if key not in record:
            raise WorkloadError(f"missing field {key!r}")
    timestamp = _timestamp(record["timestamp"], "timestamp", optional=False)
    input_length = _integer(record["input_length"], "input_length", 1, limits.max_item_tokens)
    if "output_length" in record:
        _integer(record["output_length"], "output_length", 0, INT32_MAX)  # checked, not used
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise WorkloadError(f"hash_ids must be a list of block ids, got {_show(hash_ids)}")
    for position, block in enumerate(hash_ids):
        _integer(block, f"hash_ids[{position}]", 0, MAX_HASH_ID)
    needed = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) > needed:
        raise WorkloadError(
            f"{len(hash_ids)} hash_ids for input_length {input_length}, which takes at most "
            f"{needed} blocks of {MOONCAKE_BLOCK_TOKENS} tokens"
        )
    payload_bytes = len(str(line))
    if payload_bytes > limits.max_payload_bytes:
        raise WorkloadError(f"payload (the line number) of {payload_bytes} bytes, limit {limits.max_payload_bytes}")
    return _TraceRecord(line, timestamp, input_length, np.array(hash_ids, dtype=np.int64))


class _TraceItems:
    """Makes Mooncake work items on demand from the light records (a prompt exists only
    while its item does). Owner: one Workload; its signature cache may be filled from
    several threads (idempotent inserts of equal values)."""

    def __init__(self, records: list[_TraceRecord], vocab_size: int = VOCAB_SIZE) -> None:
        self._records = records
        self._vocab_size = vocab_size
        runs = shared_block_runs([r.hash_ids.tolist() for r in records])
        # Whole blocks only: a block cut by input_length is not a component.
        # NOTE: cutting the last component to the prompt was rejected: two requests sharing
        # that block but with other lengths would get different signatures for one block.
        self._prefix_blocks = [min(run, r.input_length // MOONCAKE_BLOCK_TOKENS)
                               for run, r in zip(runs, records)]
        self._signatures: dict[tuple[int, ...], int] = {}

    def __call__(self, index: int) -> WorkItem:
        record = self._records[index]
        blocks = hashed_tokens(BLOCK_STREAM, record.hash_ids, MOONCAKE_BLOCK_TOKENS, self._vocab_size)
        prompt = blocks.reshape(-1)
        missing = record.input_length - len(prompt)
        if missing > 0:
            prompt = np.concatenate([prompt, hashed_tokens(FILL_STREAM, [record.line], missing, self._vocab_size)[0]])
        prefix_blocks = self._prefix_blocks[index]
        components = list(blocks[:prefix_blocks])
        key = tuple(record.hash_ids[:prefix_blocks].tolist())
        signature = self._signatures.get(key)
        if signature is None:
            signature = self._signatures[key] = int(shape_signature(components))
        suffix = prompt[prefix_blocks * MOONCAKE_BLOCK_TOKENS:record.input_length]
        return WorkItem(0, components, suffix, str(record.line).encode(), record.timestamp_ms,
                        record.line, signature)


def _reject_unknown(record: dict, allowed: frozenset[str]) -> None:
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise WorkloadError(f"unknown field(s) {listed(unknown)}; allowed: {sorted(allowed)}")


def _integer(value: object, what: str, low: int, high: int) -> int:
    """A JSON integer (not a bool, not a float) in [low, high], or WorkloadError."""
    if type(value) is not int:
        raise WorkloadError(f"{what} must be an integer, got {_show(value)}")
    if not low <= value <= high:
        raise WorkloadError(f"{what} {value} outside [{low}, {high}]")
    return value


# The latest timestamp a workload line may carry: 10**12 ms is 31 years of replay; past it a
# replay's sleep overflows (1e308 ms was refused only inside a producer, after the start).
MAX_TIMESTAMP_MS = 10**12


def _timestamp(value: object, what: str, *, optional: bool) -> float | None:
    """Milliseconds since the start of the run: a finite number in [0, MAX_TIMESTAMP_MS] (or
    None if optional)."""
    if value is None and optional:
        return None
    # The range first: an integer past a float's range (10**400) makes math.isfinite raise.
    if type(value) not in (int, float) or not 0 <= value <= MAX_TIMESTAMP_MS or not math.isfinite(value):  # type: ignore[arg-type,operator]
        raise WorkloadError(f"{what} must be a number of milliseconds in [0, {MAX_TIMESTAMP_MS:,}], got {_show(value)}")
    return float(value)  # type: ignore[arg-type]


def _token_array(value: object, what: str) -> np.ndarray:
    """A JSON list of token ids as an int32 array, or WorkloadError naming the bad id."""
    if not isinstance(value, list):
        raise WorkloadError(f"{what} must be a list of token ids, got {_show(value)}")
    if not value:
        return np.zeros(0, dtype=np.int32)
    # The fast path checks types in C and the range in numpy (a Python test per token would
    # cost as much as parsing the JSON); only a bad list is searched for its first bad id.
    array = np.array(value) if set(map(type, value)) == {int} else None
    if array is None or array.dtype != np.int64 or array.min() < INT32_MIN or array.max() > INT32_MAX:
        index, token = next((k, t) for k, t in enumerate(value)
                            if type(t) is not int or not INT32_MIN <= t <= INT32_MAX)
        raise WorkloadError(
            f"{what}[{index}] is {_show(token)}: a token id is an integer in int32 "
            f"[{INT32_MIN}, {INT32_MAX}]"
        )
    return array.astype(np.int32)


def _show(value: object) -> str:
    """A value for an error message: its type and a bounded repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
