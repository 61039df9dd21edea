"""One pass over a batch file: every file-level rule checked, in memory that does not grow
with the file, and the little the job keeps of it.

    scan = scan_input("requests.jsonl", "DATA/job/scan", "DATA/job/lines.bin", on_progress=show)
    scan.requests, scan.input_xxh3, scan.index   # count, digest, sparse index entries

A line is a request when it is UTF-8 JSON, an object with exactly custom_id, method, url and
body, a non-empty string custom_id used by no other line, method "POST", a string url and
an object body, within MAX_REQUEST_LINE_BYTES and MAX_JSON_NESTING (blank lines are skipped). Anything else is the
file's problem: the job refuses to start, naming the first MAX_LISTED_ERRORS lines as
`path:line: why` and the total (BatchFileError). What a body asks for is a request's own
problem, answered 400 by the producer that makes its prompt (`requests.py`); the scan does
not parse bodies beyond checking they are JSON objects.

What the scan keeps: the request count, the input's size and xxh3-128, a sparse index
(every INDEX_STRIDE-th request's byte offset and line number, `layout.py`), from which a
producer reads its share of the file by offset, and each line's digest (`lines.bin`, 8 bytes
a request, written as it reads), against which a producer checks each line it reads back. Duplicate custom_ids are found by spilling
(digest, offset, line) records into SPILL_PARTITIONS files by the digest's top bits and
sorting each partition alone, so memory stays bounded whatever the file's size; two
custom_ids with the same digest are told apart by reading both lines, never assumed equal.
NOTE: a set of every custom_id (the first design) held 1 to 2 GB at a million requests.

The envelope is decoded with msgspec, which skips the body's JSON while validating it (0.6 us a
line against 3.2 us for json.loads, a 560-byte chat request); a line msgspec refuses is
decoded again with the json module, which decides and words the error (msgspec refuses a
lone surrogate escape that JSON allows, and that is a request's problem, not the file's).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import xxhash

from pipeline.batchjob.layout import (
    INDEX_ENTRY_DTYPE,
    INDEX_HEADER_DTYPE,
    INDEX_MAGIC,
    INDEX_STRIDE,
    INDEX_VERSION,
    LINE_DIGEST_DTYPE,
)
from pipeline.runtime.madefiles import Made, matching, remove_made
from pipeline.wire.errors import BatchFileError
from pipeline.wire.textfiles import file_kind, listed
from shm.layout import checked_dtype

# The longest request line read (bytes before its newline): a prompt at the broker's largest
# item (262,144 tokens, ~4 characters each) is ~1 MiB of text, ~6 MiB if every character
# were a \u escape; 16 MiB leaves room and bounds what a file of one endless line costs.
MAX_REQUEST_LINE_BYTES = 16 << 20
# How deep a request line's JSON may nest (objects and arrays, the line's own object
# counted): serde_json's default recursion limit. A real request, a tool's JSON Schema
# included, nests a few dozen deep; the decoders (msgspec, json, the chat template) recurse
# once a level on a stack shared with their caller, within the interpreter's 1,000 frames,
# so a line nested deeper than this would fail by where it is parsed, not by what it is.
MAX_JSON_NESTING = 128
# Bytes of a line whose nesting is counted at a time (the counts are 4 bytes a bracket).
_NESTING_BLOCK_BYTES = 1 << 20
# A JSON string (its escapes included): brackets in it do not nest.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPENERS, _CLOSERS = frozenset(b"[{"), frozenset(b"]}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _OPENERS | _CLOSERS)
# The most requests in one file. The job keeps one bit per request in memory (which are
# answered), shared by its producers: 32 MiB at this limit; everything else it keeps per
# request is on disk.
MAX_BATCH_REQUESTS = 1 << 28
# How many bad lines the error lists before the total: enough to show the pattern, few
# enough that a file of nothing but bad lines does not bury the message.
MAX_LISTED_ERRORS = 10
# Bytes read at a time: large enough that a read and a digest update per block cost nothing
# beside the lines, small enough to be a rounding error of the job's memory.
READ_BLOCK_BYTES = 4 << 20
# Partitions of the custom_id digests, by their top bits: at MAX_BATCH_REQUESTS a
# partition is ~1 million records (32 MiB) sorted at a time.
SPILL_PARTITIONS = 256
# Records gathered before they are spilled (2 MiB); a file of fewer requests never spills.
SPILL_BUFFER_RECORDS = 1 << 16
# The spilled partitions' files in the scan's work folder, and what it holds: nothing else.
SPILL_PREFIX = "ids-"
SCAN_MADE = Made(files=matching(SPILL_PREFIX + r"\d{3}\.bin"))
# The keys of a request line, all required, nothing else (OpenAI's request input object).
LINE_KEYS = ("custom_id", "method", "url", "body")
# The Batch API's one method (OpenAI: "Currently only POST is supported").
METHOD = "POST"
# The index file's header check covers the bytes before it.
_HEADER_CHECKED_BYTES = 56
# What progress is reported every so often: bytes read (the caller turns it into a line).
PROGRESS_EVERY_BYTES = 64 << 20

# A custom_id's digest and where its line is (spilled to the scan's work directory).
#   off  size  field    meaning
#     0     8  digest   xxh3-64 of the custom_id's UTF-8 (surrogates passed through)
#     8     8  offset   byte offset of the line
#    16     8  line     1-based line number
DIGEST_RECORD_DTYPE = checked_dtype(
    [
        ("digest", 0, "<u8", "xxh3 of the custom_id"),
        ("offset", 8, "<u8", "line's byte offset"),
        ("line", 16, "<u8", "1-based line number"),
    ],
    itemsize=24,
)


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """A request line's keys as msgspec decodes them; the body stays raw JSON."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


_ENVELOPE = msgspec.json.Decoder(Envelope)


@dataclass(slots=True)
class InputScan:
    """What the job keeps of its input file."""

    path: str
    input_bytes: int
    input_xxh3: str  # xxh3-128, hex
    requests: int
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=INDEX_ENTRY_DTYPE))


def envelope(raw: bytes) -> Envelope:
    """A request line's envelope, or BatchFileError saying why the line is not a request."""
    try:
        env = _ENVELOPE.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _slow_envelope(raw)
    if env.method != METHOD or not env.custom_id or memoryview(env.body)[:1] != b"{" or not _utf8(raw):
        return _slow_envelope(raw)
    _check_nesting(raw)
    return env


def _check_nesting(raw: bytes) -> None:
    """BatchFileError for a line nested deeper than MAX_JSON_NESTING. A line with no more
    brackets than the limit cannot nest deeper (two counts at memory speed); the rest have
    their strings blanked and their brackets' running depth counted a block at a time."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_NESTING:
        return
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for start in range(0, len(brackets), _NESTING_BLOCK_BYTES):
        block = np.frombuffer(brackets, dtype=np.uint8, count=min(_NESTING_BLOCK_BYTES, len(brackets) - start),
                              offset=start)
        steps = np.where((block == ord("[")) | (block == ord("{")), 1, -1).astype(np.int32)
        running = depth + np.cumsum(steps)
        if running.max() > MAX_JSON_NESTING:
            raise BatchFileError(f"nested deeper than {MAX_JSON_NESTING} levels of objects and arrays (a request "
                                 f"nests a few dozen at most)")
        depth = int(running[-1])


def _utf8(raw: bytes) -> bool:
    """Whether the line is UTF-8: msgspec checks the strings it decodes, not the body's bytes
    it skips (most lines are ASCII, which costs one scan of the bytes)."""
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _slow_envelope(raw: bytes) -> Envelope:
    """The json module's verdict on a line msgspec refused, with the reason in words."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchFileError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    _check_nesting(raw)
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BatchFileError(f"not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise BatchFileError(f"a request must be a JSON object, got {show(record)}")
    missing = [key for key in LINE_KEYS if key not in record]
    if missing:
        raise BatchFileError(f"missing {', '.join(map(repr, missing))}: a request line has custom_id, method, "
                             f"url and body")
    unknown = sorted(set(record) - set(LINE_KEYS))
    if unknown:
        raise BatchFileError(f"unknown key{'s' if len(unknown) > 1 else ''} {listed(unknown)}: a request line has "
                             f"custom_id, method, url and body only")
    custom_id, method, url, body = (record[key] for key in LINE_KEYS)
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchFileError(f"custom_id must be a non-empty string, got {show(custom_id)}")
    if method != METHOD:
        raise BatchFileError(f"method must be {METHOD!r} (the Batch API's only method), got {show(method)}")
    if not isinstance(url, str):
        raise BatchFileError(f"url must be a string (an endpoint such as '/v1/chat/completions'), got {show(url)}")
    if not isinstance(body, dict):
        raise BatchFileError(f"body must be a JSON object (the endpoint's request), got {show(body)}")
    # Valid JSON msgspec would not take (a lone surrogate): the body's problem, not the file's.
    return Envelope(custom_id, method, url, msgspec.Raw(json.dumps(body).encode()))


def custom_id_digest(custom_id: str) -> int:
    return xxhash.xxh3_64_intdigest(custom_id.encode("utf-8", "surrogatepass"))


class _Errors:
    """The file's bad lines: the first MAX_LISTED_ERRORS kept (by line), all counted."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[tuple[int, str]] = []
        self.count = 0

    def add(self, line: int, why: str) -> None:
        self.count += 1
        self.found.append((line, why))
        if len(self.found) > 4 * MAX_LISTED_ERRORS:  # keep the earliest lines, bounded
            self.found = sorted(self.found)[:MAX_LISTED_ERRORS]

    def raise_if_any(self, stopped_at: int) -> None:
        if not self.count:
            return
        shown = sorted(self.found)[:MAX_LISTED_ERRORS]
        plural = "s" if self.count != 1 else ""
        upto = f" up to line {stopped_at}, where reading stopped" if stopped_at else ""
        first = f", the first {len(shown)}" if self.count > len(shown) else ""
        raise BatchFileError(f"{self.path}: {self.count:,} bad line{plural}{upto}; nothing was submitted and the job "
                             f"does not start{first}:\n  " + "\n  ".join(f"{self.path}:{n}: {why}" for n, why in shown))


def partition_of(digests: np.ndarray) -> np.ndarray:
    """Each digest's partition (of SPILL_PARTITIONS), by its top bits."""
    return (digests >> np.uint64(56)).astype(np.intp) * SPILL_PARTITIONS >> 8


def _by_partition(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(an order of `records` by partition, where each partition starts in it, then the end)."""
    part = partition_of(records["digest"])
    order = np.argsort(part, kind="stable")
    return order, np.searchsorted(part[order], np.arange(SPILL_PARTITIONS + 1))


class DigestSpill:
    """Digest records (DIGEST_RECORD_DTYPE), spilled by partition to `work_dir` once there
    are more than SPILL_BUFFER_RECORDS of them. Two spills' k-th parts hold the records of the
    same digests, so they are compared a part at a time."""

    def __init__(self, work_dir: str) -> None:
        self.work_dir = work_dir
        # Grown by doubling up to SPILL_BUFFER_RECORDS: a small file never holds the whole buffer.
        self.buffer = np.zeros(min(SPILL_BUFFER_RECORDS, 64), dtype=DIGEST_RECORD_DTYPE)
        self.filled = 0
        self.spilled = False

    def add(self, digest: int, offset: int, line: int) -> None:
        if self.filled == len(self.buffer):
            grown = np.zeros(min(2 * len(self.buffer), SPILL_BUFFER_RECORDS), dtype=DIGEST_RECORD_DTYPE)
            grown[:self.filled] = self.buffer
            self.buffer = grown
        self.buffer[self.filled] = (digest, offset, line)
        self.filled += 1
        if self.filled == SPILL_BUFFER_RECORDS:
            self._spill()

    def _spill(self) -> None:
        if not self.spilled:  # what a killed scan spilled there is of another pass
            remove_made(self.work_dir, SCAN_MADE)
            os.makedirs(self.work_dir, mode=0o700, exist_ok=True)
            self.spilled = True
        records = self.buffer[:self.filled]
        order, cuts = _by_partition(records)
        for k in range(SPILL_PARTITIONS):
            if cuts[k] < cuts[k + 1]:
                with open(self._part_path(k), "ab") as f:
                    f.write(records[order[cuts[k]:cuts[k + 1]]].tobytes())
        self.filled = 0

    def _part_path(self, k: int) -> str:
        return os.path.join(self.work_dir, f"{SPILL_PREFIX}{k:03d}.bin")

    def parts(self) -> Iterator[np.ndarray]:
        """Each partition's records, k = 0 to SPILL_PARTITIONS - 1, one at a time (empty
        where it has none)."""
        if not self.spilled:
            records = self.buffer[:self.filled]
            order, cuts = _by_partition(records)
            for k in range(SPILL_PARTITIONS):
                yield records[order[cuts[k]:cuts[k + 1]]]
            return
        self._spill()
        for k in range(SPILL_PARTITIONS):
            path = self._part_path(k)
            yield np.fromfile(path, dtype=DIGEST_RECORD_DTYPE) if os.path.exists(path) else \
                np.zeros(0, dtype=DIGEST_RECORD_DTYPE)

    def close(self) -> None:
        if self.spilled:
            remove_made(self.work_dir, SCAN_MADE)


# What the pass hands each request line to, as it reads it (`scan_input`'s on_request):
# (request index, 1-based line number, byte offset, the line without its newline).
OnRequest = Callable[[int, int, int, bytes], None]


def scan_input(path: str, work_dir: str, lines_path: str | None,
               on_progress: Callable[[int, int], None] | None = None,
               on_request: OnRequest | None = None) -> InputScan:
    """Check the batch file at `path` (the module's doc) and return what the job keeps;
    BatchFileError naming its bad lines. `on_progress(bytes_read, requests)` is called every
    PROGRESS_EVERY_BYTES. `work_dir` holds the spilled digests while it runs; the lines'
    digests are at `lines_path` once it returns (whole or not at all; None: not kept).
    `on_request` is given each request line in the same pass, until the first bad line (a
    file with one does not run, so the rest is only checked)."""
    digests = DigestSpill(work_dir)
    lines = _LineDigests(lines_path)
    errors = _Errors(path)
    try:
        with _open_input(path) as f:
            scan, stopped_at = _read(f, path, digests, lines, errors, on_progress, on_request)
        _duplicates(path, digests, errors)
        errors.raise_if_any(stopped_at)
        if not scan.requests:
            raise BatchFileError(f"{path}: no requests (the file is empty or blank)")
        lines.commit()
    finally:
        digests.close()
        lines.abandon()
    return scan


class _LineDigests:
    """Each request's line digest, written to `path` (LINE_DIGEST_DTYPE) in parts of
    SPILL_BUFFER_RECORDS, whole or not at all; none kept without a path."""

    def __init__(self, path: str | None) -> None:
        from pipeline.batchjob.paths import ReplacingFile

        self.out = ReplacingFile(path) if path is not None else None
        self.buffer = np.zeros(SPILL_BUFFER_RECORDS if path is not None else 0, dtype=LINE_DIGEST_DTYPE)
        self.filled = 0

    def add(self, digest: int) -> None:
        if self.out is None:
            return
        self.buffer[self.filled] = digest
        self.filled += 1
        if self.filled == SPILL_BUFFER_RECORDS:
            self._flush()

    def _flush(self) -> None:
        if self.out is not None:
            self.out.write(self.buffer[:self.filled].tobytes())
        self.filled = 0

    def commit(self) -> None:
        self._flush()
        if self.out is not None:
            self.out.commit()

    def abandon(self) -> None:
        if self.out is not None:
            self.out.abandon()


def _open_input(path: str):
    try:  # O_NONBLOCK: a FIFO without a writer is refused below, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BatchFileError(f"{path}: cannot read the batch file ({exc.strerror or exc})") from exc
    kind = file_kind(fd)
    if kind != "file":
        os.close(fd)
        raise BatchFileError(f"{path}: a batch file must be a regular file (it is read twice: checked, then run), "
                             f"not a {kind}")
    return open(fd, "rb")


def read_lines(f, max_line_bytes: int, on_block: Callable[[bytes], None] | None = None
               ) -> Iterator[tuple[int, int, bytes | None]]:
    """Every line of the binary file `f`, read READ_BLOCK_BYTES at a time: (its byte offset,
    its 1-based number, its bytes without the newline), or None for the bytes of a line
    longer than `max_line_bytes` (skipped a block at a time, never held whole). The last line
    may lack its newline. `on_block(block)` sees each block as it is read."""
    line, offset, carry, skipping = 0, 0, b"", False
    size = os.fstat(f.fileno()).st_size
    while True:
        # No more than the file holds (and a byte, to see its end): read(n) allocates n first.
        block = f.read(max(1, min(READ_BLOCK_BYTES, size - offset + 1)))
        if on_block is not None:
            on_block(block)
        pieces = (carry + block).split(b"\n") if block else [carry] if carry else []
        carry = pieces.pop() if block else b""
        for raw in pieces:
            start = offset
            offset += len(raw) + bool(block)  # at the end, the last line has no newline
            line += 1
            if skipping:  # the tail of an over-long line
                skipping = False
                continue
            yield start, line, raw if len(raw) <= max_line_bytes else None
        if len(carry) > max_line_bytes and not skipping:
            yield offset, line + 1, None
            offset += len(carry)
            carry, skipping = b"", True
        elif skipping and len(carry) > READ_BLOCK_BYTES:
            offset += len(carry)
            carry = b""
        if not block:
            return


def _read(f, path: str, digests: DigestSpill, lines: _LineDigests, errors: _Errors,
          on_progress: Callable[[int, int], None] | None, on_request: OnRequest | None) -> tuple[InputScan, int]:
    """The pass itself: each line checked; (what is kept, the line where reading stopped at
    the request limit or 0)."""
    hasher = xxhash.xxh3_128()
    index: list[tuple[int, int]] = []
    requests, read = 0, 0
    next_progress = PROGRESS_EVERY_BYTES

    def block_read(block: bytes) -> None:
        nonlocal read
        hasher.update(block)
        read += len(block)

    for start, line, raw in read_lines(f, MAX_REQUEST_LINE_BYTES, block_read):
        if on_progress is not None and start >= next_progress:
            on_progress(start, requests)
            next_progress = start + PROGRESS_EVERY_BYTES
        if raw is None:
            errors.add(line, f"longer than {MAX_REQUEST_LINE_BYTES:,} bytes (the longest prompt fits in far less)")
            continue
        if not raw.strip():
            continue
        try:
            env = envelope(raw)
        except BatchFileError as exc:
            errors.add(line, str(exc))
            continue
        if requests == MAX_BATCH_REQUESTS:
            errors.add(line, f"more than {MAX_BATCH_REQUESTS:,} requests in one file; split it into several jobs")
            return InputScan(path, start, hasher.hexdigest(), requests, _index(index)), line
        if requests % INDEX_STRIDE == 0:
            index.append((start, line))
        digests.add(custom_id_digest(env.custom_id), start, line)
        lines.add(xxhash.xxh3_64_intdigest(raw))
        if on_request is not None and not errors.count:
            on_request(requests, line, start, raw)
        requests += 1
    return InputScan(path, read, hasher.hexdigest(), requests, _index(index)), 0


def _index(entries: list[tuple[int, int]]) -> np.ndarray:
    return np.array(entries, dtype=INDEX_ENTRY_DTYPE) if entries else np.zeros(0, dtype=INDEX_ENTRY_DTYPE)


def _duplicates(path: str, digests: DigestSpill, errors: _Errors) -> None:
    """Every line whose custom_id an earlier line uses, named with that earlier line."""
    with open(path, "rb") as f:
        for records in digests.parts():
            if records.size < 2:
                continue
            records = np.sort(records, order=["digest", "line"])
            starts = np.flatnonzero(np.r_[True, records["digest"][1:] != records["digest"][:-1]])
            ends = np.r_[starts[1:], records.size]
            for start, end in zip(starts.tolist(), ends.tolist()):
                if end - start > 1:
                    _resolve(f, records[start:end], errors)


def _resolve(f, group: np.ndarray, errors: _Errors) -> None:
    """Records sharing a digest, in line order: each line whose custom_id (read back from
    the file) a line before it has is a duplicate. Distinct custom_ids of one 64-bit digest
    are a handful at most, so `first` stays small however large the group."""
    first: dict[str, int] = {}
    for offset, line in zip(group["offset"].tolist(), group["line"].tolist()):
        custom_id = _custom_id_at(f, offset)
        seen = first.setdefault(custom_id, line)
        if seen != line:
            errors.add(line, f"custom_id {custom_id!r:.80} is used by line {seen} too (each request needs its "
                             f"own: the output is matched to the input by it)")


def _custom_id_at(f, offset: int) -> str:
    f.seek(offset)
    return envelope(f.readline(MAX_REQUEST_LINE_BYTES + 1).rstrip(b"\n")).custom_id


def json_kind(value: object) -> str:
    """A JSON value's type as OpenAI's errors name it ("an integer", "an object")."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def show(value: object) -> str:
    """A JSON value after "got": its JSON type and a bounded rendering."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=True)
    return f"{json_kind(value)} {text if len(text) <= 60 else text[:57] + '...'}"


def snippet(text: str) -> str:
    """A string from a request for a message: escaped as JSON (a control character shows as
    \\n), cut to 60 characters."""
    escaped = json.dumps(text, ensure_ascii=True)[1:-1]
    return escaped if len(escaped) <= 60 else escaped[:57] + "..."


def invalid_type(where: str, expected: str, value: object) -> str:
    """OpenAI's message for a parameter of the wrong JSON type."""
    return f"Invalid type for '{where}': expected {expected}, but got {json_kind(value)} instead."


def invalid_value(value: str, supported: Sequence[str]) -> str:
    """OpenAI's message for a string parameter outside its values (the parameter is the
    error's `param`), the values listed as OpenAI lists them ("'a', 'b', and 'c'")."""
    names = [f"'{name}'" for name in supported]
    last = f"{',' if len(names) > 2 else ''} and {names[-1]}" if len(names) > 1 else names[-1]
    choices = ", ".join(names[:-1]) + last
    return f"Invalid value: '{snippet(value)}'. Supported values are: {choices}."


def input_digest(path: str) -> tuple[int, str]:
    """(size, xxh3-128 hex) of the input's bytes: a resumed job's check that its input is
    the one it scanned (a read at memory speed; no line is parsed)."""
    hasher = xxhash.xxh3_128()
    size = 0
    with _open_input(path) as f:
        while block := f.read(READ_BLOCK_BYTES):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


def write_index(path: str, scan: InputScan) -> None:
    """The sparse index as a file (`layout.INDEX_HEADER_DTYPE` then its entries)."""
    from pipeline.batchjob.paths import replace_file

    header = np.zeros(1, dtype=INDEX_HEADER_DTYPE)
    header[0] = (INDEX_MAGIC, INDEX_VERSION, INDEX_STRIDE, scan.requests, scan.input_bytes,
                 bytes.fromhex(scan.input_xxh3), len(scan.index), 0)
    raw = header.tobytes()
    header["header_xxh3"] = xxhash.xxh3_64_intdigest(raw[:_HEADER_CHECKED_BYTES])
    replace_file(path, [header.tobytes(), scan.index.astype(INDEX_ENTRY_DTYPE).tobytes()])


def parse_index(raw: bytes) -> InputScan | None:
    """An index file's bytes (`write_index`) as the scan it keeps, its path empty; None for
    bytes that are not one (damaged, another version)."""
    size = INDEX_HEADER_DTYPE.itemsize
    if len(raw) < size:
        return None
    header = np.frombuffer(raw[:size], dtype=INDEX_HEADER_DTYPE)[0]
    requests, entries = int(header["requests"]), int(header["entries"])
    if (header["magic"] != INDEX_MAGIC or int(header["version"]) != INDEX_VERSION
            or int(header["header_xxh3"]) != xxhash.xxh3_64_intdigest(raw[:_HEADER_CHECKED_BYTES])
            or int(header["stride"]) != INDEX_STRIDE or entries != -(-requests // INDEX_STRIDE)
            or len(raw) != size + entries * INDEX_ENTRY_DTYPE.itemsize):
        return None
    return InputScan("", int(header["input_bytes"]), bytes(header["input_xxh3"]).hex(), requests,
                     np.frombuffer(raw, dtype=INDEX_ENTRY_DTYPE, offset=size).copy())


def read_index(path: str, manifest) -> np.ndarray:
    """The sparse index of the job `manifest` describes; JobMismatchError for a file that is
    not it (damaged, or of another input)."""
    from pipeline.wire.errors import JobMismatchError

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise JobMismatchError(f"{path}: cannot read the job's input index ({exc.strerror}); use another "
                               f"--data-dir") from exc
    scan = parse_index(raw)
    if scan is None or scan.requests != manifest.requests or scan.input_xxh3 != manifest.input_xxh3:
        raise JobMismatchError(f"{path}: not the input index of this job (damaged?); use another --data-dir")
    return scan.index
