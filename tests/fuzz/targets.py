"""The decoders the outside world reaches, as fuzz targets: bytes in, and only a typed
rejection (or a result) out. Shared by the hypothesis tests beside this module and by
`tools/fuzz_atheris.py`.

Each target has valid encodings to mutate (`seeds`, made by the product's own encoders),
the byte ranges of their header fields (`fields`, derived from the layouts' dtypes, so a
field overwrite hits every header offset), the errors that count as a rejection
(`allowed`), and a bound on what one input may make the decoder allocate
(`memory_bound_bytes`, from the input's size and the named limits). `run(data)` decodes
`data` as the product does where it enters, then uses what came out as the product would
next (a parsed frame is ingested and stored, a results file's ids go into a uint64 array),
so that a value that passes the decoder but breaks its user counts as a crash too.

    target = TARGETS["frame"]
    target.run(target.seeds[0])  # returns; garbage raises one of target.allowed
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.batchjob.requests import BatchRequest, parse_line
from pipeline.batchjob.scan import scan_input
from pipeline.broker.config import BrokerConfig
from pipeline.broker.dispatch import Dispatcher
from pipeline.storage import DiskTier
from pipeline.storage.identity import SegmentKeys, boundary_checksum, identity_bytes
from pipeline.storage.scan import census_segment, scan_segment
from pipeline.storage.segment import encode_entries
from pipeline.storage.storelog import encode_completed, encode_lifecycle, log_key
from pipeline.storage.storelog import encode_records as encode_log
from pipeline.consumer.reader import SegmentReader
from pipeline.producer.workload import load_workload
from pipeline.reporting.accounting import result_rows, summarize_results
from pipeline.wire.errors import (
    BadInputError,
    BatchFileError,
    FrameError,
    GenerationParamsError,
    ProtocolError,
    SegmentCorruptError,
    SegmentFormatError,
    SegmentNameError,
    SegmentReadError,
    WorkloadError,
)
from pipeline.wire.generation import GENERATION_HEADER_DTYPE, GenerationParams, decode_payload, encode_payload
from pipeline.wire.layouts.descriptors import (
    DESCRIPTOR_HEADER_DTYPE,
    DESCRIPTOR_HEADER_SIZE_BYTES,
    DESCRIPTOR_ITEM_DTYPE,
    descriptor_size_bytes,
    parse_descriptor,
    write_descriptor,
)
from pipeline.wire.layouts.frames import (
    CHAIN_HEADER_DTYPE,
    FRAME_HEADER_DTYPE,
    FRAME_HEADER_SIZE_BYTES,
    FRAME_HEADER_STRUCT,
    FRAME_MAGIC,
    FRAME_VERSION,
    ITEM_HEADER_DTYPE,
    ITEM_HEADER_SIZE_BYTES,
    encode_chains,
    frame_size_bytes,
    make_item_id,
    parse_frame,
)
from pipeline.wire.layouts.names import SEGMENTS_DIR, segment_relpath
from pipeline.wire.layouts.segments import (
    ENTRY_HEADER_DTYPE,
    SEGMENT_BOUNDARY_CHECKSUM,
    SEGMENT_DATA_END,
    SEGMENT_ENTRY_COUNT,
    SEGMENT_HEADER_DTYPE,
    SEGMENT_HEADER_SIZE_BYTES,
    SYNC_ALIGN_BYTES,
)
from pipeline.wire.layouts.storelog import (
    LOG_BOUNDARY,
    LOG_CREATED,
    LOG_DELETED,
    LOG_QUARANTINED,
    LOG_RECORD_SIZE_BYTES,
    LOG_SEALED,
    STORE_LOG_DTYPE,
    STORE_LOG_FILE,
)
from pipeline.wire.protocol import MAX_REQUEST_BYTES, MessageReader, check_consumer_name, encode
from pipeline.wire.status import ConsumerWork

# The producer whose ring every fuzzed frame comes from: a frame naming another is refused.
FRAME_PRODUCER = 7
# A fresh store every this many frames, so that the seeds' sequences are not all duplicates
# of what an earlier input stored (the lanes and the append path stay exercised).
FRAME_STORE_RUNS = 64
# What any decoder may allocate whatever its input: interpreter and numpy overheads, a
# store's bookkeeping, a line's error message.
BASE_MEMORY_BYTES = 4 << 20
# A rejection's message: enough for the offending value and where, never a dump of the input.
MAX_MESSAGE_CHARS = 16_384
# The served model a batch file is checked against.
SERVED_MODEL = "tiny"
# Where a process whose parent removes its scratch directory finds it (tools/fuzz_atheris.py).
SCRATCH_ENV = "SBRK_FUZZ_SCRATCH"
# The segment every segment input is read as (its path carries these keys).
SEGMENT_KEYS = SegmentKeys(model=0, signature=0x5EED, lane=1, segment_seq=3)


@dataclass
class Target:
    """One decoder. `fields`: (offset, size) of every header field of each seed, by seed."""

    name: str
    run: Callable[[bytes], None]
    seeds: list[bytes]
    allowed: tuple[type[BaseException], ...]
    fields: list[list[tuple[int, int]]]
    # bytes per input byte a decoder may hold (parsed JSON is ~50x its text), on top of
    # BASE_MEMORY_BYTES and `fixed_bytes` (what a named limit lets one input make).
    per_input_byte: int = 8
    fixed_bytes: int = 0
    text: bool = False  # JSON lines: the tests also mutate values, not only bytes
    notes: dict[str, int] = field(default_factory=dict)

    def memory_bound_bytes(self, size: int) -> int:
        return BASE_MEMORY_BYTES + self.fixed_bytes + self.per_input_byte * size


def dtype_fields(dtype: np.dtype, base: int = 0) -> list[tuple[int, int]]:
    """(offset, size) of each field of a record of `dtype` at byte `base`."""
    return [(base + dtype.fields[name][1], dtype.fields[name][0].itemsize) for name in dtype.names]


class _Scratch:
    """A temporary directory for the targets that read files, removed at exit. Owner: this
    module (one per process); not thread-safe, as the fuzz loops are not."""

    def __init__(self) -> None:
        self._root: str | None = None

    @property
    def root(self) -> str:
        if self._root is None:  # a process that cannot clean up (libFuzzer exits it) is given one
            self._root = os.environ.get(SCRATCH_ENV) or tempfile.mkdtemp(prefix="sbrk-fuzz-")
            os.makedirs(self._root, exist_ok=True)
        return self._root

    def write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)
        return path

    def cleanup(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


SCRATCH = _Scratch()


# ------------------------------------------------------------------------------- frames


def frame_bytes(producer_id: int, first_seq: int, items: list[tuple[int, int, int, int, bytes]],
                chains: list[tuple[int, tuple[int, ...]]] = ()) -> bytes:
    """A frame as a producer writes it: items (model, signature, length, prefix_len, payload)."""
    count = len(items)
    headers = np.zeros(count, dtype=ITEM_HEADER_DTYPE)
    seqs = np.arange(first_seq, first_seq + count, dtype=np.uint64)
    headers["seq"] = seqs
    headers["item_id"] = [make_item_id(producer_id, int(s)) for s in seqs]
    headers["model"] = [m for m, *_ in items]
    headers["signature"] = np.array([s for _, s, *_ in items], dtype=np.uint64)
    headers["submit_ns"] = 1_000_000
    headers["length"] = [n for _, _, n, _, _ in items]
    headers["prefix_len"] = [p for _, _, _, p, _ in items]
    headers["payload_len"] = [len(b) for *_, b in items]
    tokens = np.concatenate([np.arange(n, dtype="<i4") + 11 * k for k, (_, _, n, _, _) in enumerate(items)])
    blob = b"".join(b for *_, b in items)
    chain_section = encode_chains(list(chains))
    head = FRAME_HEADER_STRUCT.pack(FRAME_MAGIC, FRAME_VERSION, FRAME_HEADER_SIZE_BYTES, producer_id, count,
                                    int(tokens.size), len(blob), len(chain_section))
    body = head + headers.tobytes() + tokens.tobytes() + blob + chain_section
    assert len(body) == frame_size_bytes(count, int(tokens.size), len(blob), len(chain_section))
    return body


def _frame_fields(body: bytes) -> list[tuple[int, int]]:
    count = FRAME_HEADER_STRUCT.unpack_from(body, 0)[4]
    out = dtype_fields(FRAME_HEADER_DTYPE)
    for k in range(count):
        out += dtype_fields(ITEM_HEADER_DTYPE, FRAME_HEADER_SIZE_BYTES + k * ITEM_HEADER_SIZE_BYTES)
    chain_bytes = FRAME_HEADER_STRUCT.unpack_from(body, 0)[7]
    if chain_bytes:
        out += dtype_fields(CHAIN_HEADER_DTYPE, len(body) - chain_bytes)
    return out


class _FrameStore:
    """The broker's ingest path on a store of its own, renewed every FRAME_STORE_RUNS."""

    def __init__(self) -> None:
        self.tier: DiskTier | None = None
        self.dispatcher: Dispatcher | None = None
        self.runs = 0
        self.opened = 0

    def dispatcher_now(self) -> Dispatcher:
        if self.tier is None or self.runs % FRAME_STORE_RUNS == 0:
            self.close()
            self.opened += 1
            self.tier = DiskTier.open(os.path.join(SCRATCH.root, f"store-{self.opened}"), segment_max_bytes=1 << 20)
            self.dispatcher = Dispatcher(self.tier, max_models=4)
        self.runs += 1
        return self.dispatcher

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            shutil.rmtree(self.tier_dir, ignore_errors=True)
            self.tier = self.dispatcher = None

    @property
    def tier_dir(self) -> str:
        return os.path.join(SCRATCH.root, f"store-{self.opened}")


FRAME_STORE = _FrameStore()


def run_frame(data: bytes) -> None:
    """A ring record as the broker's fill takes it: parsed against its ring's producer,
    ingested (lanes assigned, entries encoded and appended), flushed, invariants checked."""
    body = np.frombuffer(data, dtype=np.uint8)
    frame = parse_frame(body, where="fuzzed record", producer_id=FRAME_PRODUCER)
    dispatcher = FRAME_STORE.dispatcher_now()
    dispatcher.ingest(frame, 1.0)
    dispatcher.flush()
    dispatcher.check_invariants()


FRAME_SEEDS = [
    frame_bytes(FRAME_PRODUCER, 0, [(0, 0xA1, 5, 2, b"")]),
    frame_bytes(FRAME_PRODUCER, 1, [(0, 0xA1, 3, 0, b"p1"), (1, 0xB2, 9, 9, b""), (0, 0xA1, 4, 1, b"xyz")]),
    frame_bytes(FRAME_PRODUCER, 4, [(2, 0xC3, 6, 3, b"q"), (2, 0xC4, 2, 1, b"")],
                chains=[(2, (0xC0, 0xC3)), (2, (0xC0, 0xC4))]),
]


# ------------------------------------------------------------------------ control messages


def run_control(data: bytes) -> None:
    """Bytes from one control connection, decoded as the broker reads requests, and each
    message's fields checked as its handler checks them before acting."""
    reader = MessageReader(MAX_REQUEST_BYTES)
    config = BrokerConfig(os.path.join(SCRATCH.root, "broker"))
    for message in reader.feed(data):
        kind = message["type"]
        if kind == "register_consumer":
            config.check_contract(message["model"], message["max_batch_items"], message["max_batch_tokens"],
                                  message["max_input_len"])
            if message.get("name") is not None:
                check_consumer_name(message["name"])
        elif kind == "complete":
            ConsumerWork.from_results(message["results"])


def _control_seed(*messages: dict) -> bytes:
    return b"".join(encode(m) for m in messages)


_RESULTS = {name: 0 for name in ConsumerWork.__dataclass_fields__}
CONTROL_SEEDS = [
    _control_seed({"type": "register_consumer", "model": 0, "max_batch_items": 8, "max_batch_tokens": 4096,
                   "max_input_len": 512, "pid": 1, "gpu": 0, "name": "gpu-0"}),
    _control_seed({"type": "heartbeat"}, {"type": "request_work", "credit": 4},
                  {"type": "complete", "batch_id": 3, "results": {**_RESULTS, "items_ok": 2}, "credit": 1}),
    _control_seed({"type": "register_producer", "pid": 5, "producer_id": -1},
                  {"type": "producer_ready", "ring": "/sbrk-x-producer-0"}, {"type": "unregister_producer"}),
    _control_seed({"type": "status"}, {"type": "goodbye"}),
]


def _length_prefix_fields(data: bytes) -> list[tuple[int, int]]:
    """The u32 length of each message: the control protocol's one binary field."""
    out, at = [], 0
    while at + 4 <= len(data):
        out.append((at, 4))
        at += 4 + int.from_bytes(data[at:at + 4], "little")
    return out


# ---------------------------------------------------------------------------- segments


def segment_file_bytes(entries: list[tuple[int, int, int, bytes]], keys: SegmentKeys = SEGMENT_KEYS,
                       tail_zero_bytes: int = 256) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A segment as the broker writes it: (file bytes, entry offsets, its DESCRIPTOR_ITEMs).
    Entries: (seq, length, prefix_len, payload) of producer FRAME_PRODUCER."""
    frame = parse_frame(np.frombuffer(frame_bytes(
        FRAME_PRODUCER, entries[0][0], [(keys.model, keys.signature, n, p, b) for _, n, p, b in entries]),
        dtype=np.uint8))
    group = encode_entries(frame.items, frame.tokens, frame.token_starts, frame.payloads, frame.payload_starts,
                           np.arange(len(entries)), FRAME_PRODUCER)
    header = bytearray(SEGMENT_HEADER_SIZE_BYTES)
    header[:56] = identity_bytes(keys, 1_700_000_000_000_000_000)
    data_end = SEGMENT_HEADER_SIZE_BYTES + group.data.size
    SEGMENT_ENTRY_COUNT.write(header, len(entries))
    SEGMENT_DATA_END.write(header, data_end)
    SEGMENT_BOUNDARY_CHECKSUM.write(header, boundary_checksum(len(entries), data_end))
    offsets = group.offsets + SEGMENT_HEADER_SIZE_BYTES
    items = np.zeros(len(entries), dtype=DESCRIPTOR_ITEM_DTYPE)
    items["lane"], items["segment_seq"] = keys.lane, keys.segment_seq
    items["offset"], items["length"], items["item_id"] = offsets, frame.items["length"], frame.items["item_id"]
    return bytes(header) + group.data.tobytes() + bytes(tail_zero_bytes), offsets, items


_SEGMENT_ENTRIES = [[(0, 5, 2, b"")], [(10, 3, 1, b"pay"), (11, 40, 0, b""), (12, 1, 1, b"z" * 17)]]
SEGMENT_SEEDS, SEGMENT_OFFSETS, SEGMENT_ITEMS = [], [], []
for _entries in _SEGMENT_ENTRIES:
    _data, _offsets, _items = segment_file_bytes(_entries)
    SEGMENT_SEEDS.append(_data)
    SEGMENT_OFFSETS.append(_offsets)
    SEGMENT_ITEMS.append(_items)
SEGMENT_PATH = os.path.join(SEGMENTS_DIR, segment_relpath(SEGMENT_KEYS.model, SEGMENT_KEYS.signature,
                                                          SEGMENT_KEYS.lane, SEGMENT_KEYS.segment_seq))


def _segment_fields(index: int) -> list[tuple[int, int]]:
    out = dtype_fields(SEGMENT_HEADER_DTYPE)
    for offset in SEGMENT_OFFSETS[index].tolist():
        out += dtype_fields(ENTRY_HEADER_DTYPE, offset)
    return out


def run_segment_scan(data: bytes) -> None:
    """A segment file as recovery and the tools read it: the salvage scan, and the census of
    a file whose identity fails. Whatever the scan reports lies within the file."""
    path = SCRATCH.write(SEGMENT_PATH, data)
    report = scan_segment(path)
    for offset, header in zip(report.offsets.tolist(), report.headers):
        assert SEGMENT_HEADER_SIZE_BYTES <= offset < report.file_size, (offset, report.file_size)
        assert 1 <= int(header["length"]) and int(header["prefix_len"]) <= int(header["length"]), header
    for damage in report.damaged:
        assert damage.entries >= 1, damage
    census_segment(path)


class _Readers:
    """One consumer's segment reader over the scratch data directory (its mappings are
    dropped after each input: every input is a new file under the same name)."""

    def __init__(self) -> None:
        self.reader: SegmentReader | None = None

    def get(self) -> SegmentReader:
        if self.reader is None:
            self.reader = SegmentReader(SCRATCH.root)
        return self.reader

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


READERS = _Readers()


def _read_checked(items: np.ndarray) -> None:
    """A descriptor's items read as the consumer reads a batch: every item is either read
    (tokens of its length) or listed as failed, with a typed error."""
    reader = READERS.get()
    try:
        got = reader.read_batch(SEGMENT_KEYS.model, SEGMENT_KEYS.signature, items)
    finally:
        reader.close()
    assert len(got.item_ids) + len(got.failed) == items.shape[0], (len(got.item_ids), len(got.failed))
    for tokens, length in zip(got.tokens, got.lengths):
        assert tokens.shape[0] == length
    for _item, _length, error in got.failed:
        assert isinstance(error, SegmentCorruptError), error
    for payload in got.payloads:
        decode_payload_or_reject(payload)


def decode_payload_or_reject(payload: bytes) -> None:
    """What the consumer does with a payload it read: split off the generation envelope (a
    malformed one is that item's error, GenerationParamsError)."""
    try:
        decode_payload(payload)
    except GenerationParamsError:
        pass


def run_segment_read(data: bytes) -> None:
    """A segment file (damaged anyhow) read by the consumer through the descriptors the
    broker made for the file it wrote (the seed the input is nearest in size to)."""
    SCRATCH.write(SEGMENT_PATH, data)
    index = min(range(len(SEGMENT_SEEDS)), key=lambda k: abs(len(SEGMENT_SEEDS[k]) - len(data)))
    _read_checked(SEGMENT_ITEMS[index])


def descriptor_bytes(items: np.ndarray) -> bytes:
    buf = np.zeros(descriptor_size_bytes(items.shape[0]), dtype=np.uint8)
    write_descriptor(buf, 0, 9, SEGMENT_KEYS.signature, SEGMENT_KEYS.model, 64, 5, items)
    return buf.tobytes()


def run_descriptor(data: bytes) -> None:
    """A descriptor record (the broker's, damaged anyhow) parsed and read by the consumer
    against the intact seed segment."""
    descriptor = parse_descriptor(np.frombuffer(data, dtype=np.uint8), where="fuzzed descriptor")
    SCRATCH.write(SEGMENT_PATH, SEGMENT_SEEDS[1])
    _read_checked(descriptor.items)


DESCRIPTOR_SEEDS = [descriptor_bytes(items) for items in SEGMENT_ITEMS]


def _descriptor_fields(data: bytes) -> list[tuple[int, int]]:
    out = dtype_fields(DESCRIPTOR_HEADER_DTYPE)
    for at in range(DESCRIPTOR_HEADER_SIZE_BYTES, len(data) - DESCRIPTOR_ITEM_DTYPE.itemsize + 1,
                    DESCRIPTOR_ITEM_DTYPE.itemsize):
        out += dtype_fields(DESCRIPTOR_ITEM_DTYPE, at)
    return out


# ------------------------------------------------------------------------------ store


def _one_segment_store(name: str) -> tuple[str, str]:
    """A fresh scratch data directory holding the seed segment of three entries: (its root,
    the segment's path)."""
    root = os.path.join(SCRATCH.root, name)
    shutil.rmtree(root, ignore_errors=True)
    segment = os.path.join(root, SEGMENT_PATH)
    os.makedirs(os.path.dirname(segment))
    with open(segment, "wb") as file:
        file.write(SEGMENT_SEEDS[1])
    return root, segment


def run_store_log(data: bytes) -> None:
    """A store log (`data`) beside the intact seed segment of three entries, read by the
    scan and by recovery: whatever it holds, the store opens (or refuses a record of another
    version by name), no more entries are delivered than the segment holds, and a completion
    never names an offset where no entry starts."""
    root, segment = _one_segment_store("store-log-store")
    with open(os.path.join(root, STORE_LOG_FILE), "wb") as file:
        file.write(data)
    report = scan_segment(segment)
    assert report.entry_count == 3 and report.live_count + report.tombstone_count == 3, report.problems()
    tier = DiskTier.open(root)
    try:
        assert tier.recovery.live_entries == report.live_count, tier.recovery.summary()
    finally:
        tier.close()


_LOG_KEY = log_key(SEGMENT_KEYS)
_OTHER_KEYS = [SegmentKeys(0, 0x5EED, 1, 2), SegmentKeys(3, 0x77, 0, 0), SegmentKeys(1, 0x1, 2, 5)]
STORE_LOG_SEEDS = [
    b"".join(records.tobytes() for records in [
        encode_log(LOG_BOUNDARY, _LOG_KEY, np.array([[3, len(SEGMENT_SEEDS[1]) - 256, 0, 0]], dtype=np.uint64)),
        encode_completed(_LOG_KEY, SEGMENT_OFFSETS[1][:2])]),
    encode_completed(_LOG_KEY, SEGMENT_OFFSETS[1][2:]).tobytes()
    + bytes(SYNC_ALIGN_BYTES - 64)
    + encode_log(LOG_SEALED, _LOG_KEY, np.array([[3, 0, 0, 0]], dtype=np.uint64)).tobytes(),
    # Lives: the seed segment created; another created, sealed and deleted; a third
    # quarantined; and one the disk lacks (a MISSING segment).
    b"".join(records.tobytes() for records in [
        encode_lifecycle(LOG_CREATED, SEGMENT_KEYS),
        encode_lifecycle(LOG_CREATED, _OTHER_KEYS[0]),
        encode_log(LOG_SEALED, log_key(_OTHER_KEYS[0]), np.array([[9, 0, 0, 0]], dtype=np.uint64)),
        encode_lifecycle(LOG_DELETED, _OTHER_KEYS[0]),
        encode_lifecycle(LOG_QUARANTINED, _OTHER_KEYS[1]),
        encode_lifecycle(LOG_CREATED, _OTHER_KEYS[2])]),
]


def _store_log_fields(data: bytes) -> list[tuple[int, int]]:
    out = []
    for at in range(0, len(data) - LOG_RECORD_SIZE_BYTES + 1, LOG_RECORD_SIZE_BYTES):
        if any(data[at:at + LOG_RECORD_SIZE_BYTES]):
            out += dtype_fields(STORE_LOG_DTYPE, at)
    return out


# ------------------------------------------------------------------------------ results


def result_line(item_id: int, status: str = "ok", **extra: object) -> dict:
    row = {"item_id": item_id, "batch_id": 4, "dispatch_ns": 10, "submit_ns": 5, "done_ns": 20,
           "pad_to_tokens": 16, "status": status, "prompt_tokens": 12, "cached_tokens": 3, "output_tokens": 2,
           "output": [7, 8], "finish_reason": "length", "payload": base64.b64encode(b"job-1").decode()}
    row.update(extra)
    return row


def _lines(*rows: dict) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


RESULTS_SEEDS = [
    _lines(result_line(make_item_id(7, 0)), result_line(make_item_id(7, 1), "too_long", output=[])),
    _lines(result_line(make_item_id(3, 9), "error", error="engine failed")) + b'{"item_id": 1, "sta',
]


def run_results(data: bytes) -> None:
    """A results file as `pipeline status`, the launcher's accounting and a batch job read
    it: every line a row or a counted bad line, and the rows' ids fit the uint64 arrays
    the stock-taking builds of them."""
    path = SCRATCH.write(os.path.join("results", "c0.jsonl"), data)
    rows = list(result_rows(path))
    summary = summarize_results(os.path.dirname(path))
    assert summary.lines == len(rows), (summary.lines, len(rows))
    np.fromiter(summary.item_ids, dtype=np.uint64, count=len(summary.item_ids))
    assert summary.bad_lines <= data.count(b"\n") + 1


# ----------------------------------------------------------------------------- workloads

# The most items of a loaded workload whose tokens a run makes (a Mooncake item's prompt is
# made from its line when it is submitted): bounds a fuzz run, not the product.
WORKLOAD_ITEMS_BUILT = 8


def run_workload(data: bytes) -> None:
    """A workload file loaded as `pipeline launch` loads it, then its first items made as a
    producer makes them before submitting (tokens, signature, length)."""
    path = SCRATCH.write("workload.jsonl", data)
    workload = load_workload(path)
    for k, item in enumerate(workload):
        if k == WORKLOAD_ITEMS_BUILT:
            break
        tokens = item.tokens
        assert tokens.dtype == np.int32 and tokens.shape[0] == item.length >= 1
        assert 0 <= item.signature < 1 << 64


WORKLOAD_SEEDS = [
    _lines({"model": 0, "components": [[1, 2, 3], [4, 5]], "suffix": [6, 7], "payload": "job-1", "timestamp_ms": 12.5},
           {"suffix": [9], "payload": ""}),
    _lines({"timestamp": 40, "input_length": 700, "output_length": 3, "hash_ids": [151, 152]},
           {"timestamp": 41, "input_length": 20, "hash_ids": [151]}),
]


# ---------------------------------------------------------------------------- batch files


def load_batch(path: str, served: str) -> list[BatchRequest]:
    """A batch file's requests as `pipeline run-batch` reads them: the scan's file rules
    (BatchFileError), then each line's body as its producer parses it."""
    scan_input(path, os.path.join(os.path.dirname(path), "scan-work"),
               os.path.join(os.path.dirname(path), "lines.bin"))
    with open(path, "rb") as f:
        lines = [(number, line.rstrip(b"\n")) for number, line in enumerate(f, 1) if line.strip()]
    return [parse_line(raw, index, number, served) for index, (number, raw) in enumerate(lines)]


def run_batch(data: bytes) -> None:
    """A batch request file loaded as `pipeline run-batch` loads it, then each request's
    parameters put in the envelope a producer writes (a request refused keeps its error)."""
    path = SCRATCH.write("batch.jsonl", data)
    for request in load_batch(path, SERVED_MODEL):
        asks = request.messages or request.prompt or (request.embedding.inputs if request.embedding else None)
        assert (request.error is None) == (request.kind is not None and asks is not None), request
        if request.error is None:
            assert decode_payload(encode_payload(request.params, b"id"))[1] == b"id"


def chat_request(custom_id: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}}


BATCH_SEEDS = [
    _lines(chat_request("req-1", max_completion_tokens=64, temperature=0),
           {"custom_id": "req-2", "method": "POST", "url": "/v1/completions",
            "body": {"model": SERVED_MODEL, "prompt": [1, 2, 3], "max_tokens": 5, "stop": ["\n"], "seed": 3}}),
    _lines(chat_request("req-3", messages=[{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                                           {"role": "user", "content": "x", "name": "ann"}], top_p=0.5, n=1)),
    _lines({"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": SERVED_MODEL, "input": ["a", [1, 2]], "encoding_format": "base64"}}),
]


# --------------------------------------------------------------------------- generation


def run_generation(data: bytes) -> None:
    """A stored payload as the consumer splits it; parameters that decode encode again to
    the same parameters (the envelope is read as it was written)."""
    params, own = decode_payload(data)
    if params is not None:
        again, own_again = decode_payload(encode_payload(params, own))
        assert again == params and own_again == own, (again, params)


GENERATION_SEEDS = [
    encode_payload(GenerationParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=-3, stop=("END", "\n")), b"x"),
    encode_payload(GenerationParams(max_tokens=1), b""),
    encode_payload(None, b"SBGP looks like an envelope"),
    encode_payload(GenerationParams(embed=True, input_lengths=(3, 1, 9), dimensions=32), b"job"),
]


# ------------------------------------------------------------------------------ registry


TARGETS: dict[str, Target] = {
    "frame": Target("frame", run_frame, FRAME_SEEDS, (FrameError, BadInputError),
                    [_frame_fields(s) for s in FRAME_SEEDS]),
    # Recovery of a one-segment store holds its bookkeeping and a compacted log: a fixed cost.
    "store_log": Target("store_log", run_store_log, STORE_LOG_SEEDS, (SegmentFormatError,),
                        [_store_log_fields(s) for s in STORE_LOG_SEEDS], fixed_bytes=4 << 20),
    "control": Target("control", run_control, CONTROL_SEEDS, (ProtocolError, BadInputError),
                      [_length_prefix_fields(s) for s in CONTROL_SEEDS], per_input_byte=64, text=True),
    "segment_scan": Target("segment_scan", run_segment_scan, SEGMENT_SEEDS, (SegmentFormatError,),
                           [_segment_fields(k) for k in range(len(SEGMENT_SEEDS))]),
    "segment_read": Target("segment_read", run_segment_read, SEGMENT_SEEDS, (SegmentReadError,),
                           [_segment_fields(k) for k in range(len(SEGMENT_SEEDS))]),
    "descriptor": Target("descriptor", run_descriptor, DESCRIPTOR_SEEDS, (FrameError, SegmentNameError),
                         [_descriptor_fields(s) for s in DESCRIPTOR_SEEDS]),
    "results": Target("results", run_results, RESULTS_SEEDS, (), [[] for _ in RESULTS_SEEDS],
                      per_input_byte=64, text=True),
    # A Mooncake line makes its prompt from input_length alone: up to the producer's
    # max_item_tokens (262,144) int32 tokens and its 512-token blocks, a few MiB per item.
    "workload": Target("workload", run_workload, WORKLOAD_SEEDS, (WorkloadError,), [[] for _ in WORKLOAD_SEEDS],
                       per_input_byte=64, fixed_bytes=16 << 20, text=True),
    "batch": Target("batch", run_batch, BATCH_SEEDS, (BatchFileError,), [[] for _ in BATCH_SEEDS],
                    per_input_byte=64, text=True),
    "generation": Target("generation", run_generation, GENERATION_SEEDS, (GenerationParamsError,),
                         [dtype_fields(GENERATION_HEADER_DTYPE) if s.startswith(b"SBGP") else []
                          for s in GENERATION_SEEDS]),
}


def close_all() -> None:
    """Close the stores and readers the targets opened and remove the scratch directory."""
    FRAME_STORE.close()
    READERS.close()
    SCRATCH.cleanup()
