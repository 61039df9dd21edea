"""The batch job's binary records: what its items carry, its input's index, its answers.

Four layouts, each declared once here with its table and checked at import:

- JOB_PAYLOAD_DTYPE: the opaque payload of every item a job submits (behind the generation
  envelope, `pipeline/wire/generation.py`). It names the job (a random 64-bit id drawn
  when the job is created) and the request (its index, and where its line is in the input
  file with a digest of the line's bytes), so an answer is matched to its own request of
  its own job and nothing else: an item of another job, of `pipeline launch` or of
  `pipeline produce` on the same data directory never matches (`decode_job_payload`).
- INDEX_ENTRY_DTYPE: the input's sparse index (`job/input.idx`), one entry every
  INDEX_STRIDE requests: the byte offset and line number of that request's line, so a
  producer starts its share anywhere in the file without reading what comes before it.
- LINE_DIGEST_DTYPE: one per request (`job/lines.bin`), the xxh3-64 of its line's bytes as
  the scan read them: a producer reads each line back by offset and makes nothing of a line
  that is not that one (the input edited in place while the job runs).
- ANSWER_RECORD_DTYPE: one record per answered request (`job/answers.bin`), written after
  its output line: which request, where its line is, its status and usage. The records are
  the job's ledger of answers: a resume reads them (not the lines) to know what is done and
  the usage so far, and the input-order merge reads them to place each line.
"""

from __future__ import annotations

import numpy as np

from pipeline.wire.owners import OWNED_PAYLOAD_MAGIC, OWNER_OFFSET_BYTES, OWNER_SIZE_BYTES
from shm.layout import checked_dtype, struct_for

JOB_PAYLOAD_MAGIC = OWNED_PAYLOAD_MAGIC  # b"SBJR": a job's items are owned payloads
# Bump when a field below moves or changes meaning: an item of another version is no answer.
JOB_PAYLOAD_VERSION = 1

# A job item's payload.
#   off  size  field        meaning
#     0     4  magic        b"SBJR"
#     4     2  version      JOB_PAYLOAD_VERSION
#     6     2  flags        JOB_FLAG_* bits (zero in items of older versions: none set)
#     8     8  job_id       the job's random id (its manifest): whose item this is
#    16     8  index        the request's index among the input's requests (0-based)
#    24     8  offset       byte offset of the request's line in the input file
#    32     4  length       bytes of that line, without its newline
#    36     4  reserved     zero
#    40     8  line_xxh3    xxh3-64 of the line's bytes: the line read back is that line
#    48     8  made_ns      when the producer made the item (CLOCK_MONOTONIC, the machine's
#                           one clock): the job's latency from submit to answer
JOB_PAYLOAD_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBJR'"),
        ("version", 4, "<u2", "JOB_PAYLOAD_VERSION"),
        ("flags", 6, "<u2", "JOB_FLAG_* bits"),
        ("job_id", 8, "<u8", "the job's id"),
        ("index", 16, "<u8", "request index"),
        ("offset", 24, "<u8", "line's byte offset"),
        ("length", 32, "<u4", "line's bytes"),
        ("line_xxh3", 40, "<u8", "xxh3 of the line"),
        ("made_ns", 48, "<u8", "when the item was made"),
    ],
    itemsize=56,
)
JOB_PAYLOAD_SIZE_BYTES = JOB_PAYLOAD_DTYPE.itemsize
# A job's items are owned payloads (`wire/owners.py`): a consumer answers those of an ended
# batch without running them.
assert JOB_PAYLOAD_DTYPE.fields["job_id"][1] == OWNER_OFFSET_BYTES
assert JOB_PAYLOAD_DTYPE.fields["job_id"][0].itemsize == OWNER_SIZE_BYTES
_PAYLOAD = struct_for(JOB_PAYLOAD_DTYPE)
_MADE_NS_OFFSET = int(JOB_PAYLOAD_DTYPE.fields["made_ns"][1])
# The request's answer is made with more than its results row (logprobs, an echo, tool calls):
# the collector reads the request's body again (`requests.BatchRequest.answer_reads_body`).
JOB_FLAG_READS_BODY = 1
_FLAGS = struct_for(JOB_PAYLOAD_DTYPE, ["flags"])
_FLAGS_OFFSET = JOB_PAYLOAD_DTYPE.fields["flags"][1]

# Requests between two entries of the input's sparse index: a producer starting its share
# reads at most this many lines it does not take (about 2 MB of a typical batch file),
# and the index of a 100-million-request file is 24,415 entries (390 KB).
INDEX_STRIDE = 4096

INDEX_MAGIC = b"SBJI"
INDEX_VERSION = 1
# The sparse index file's header.
#   off  size  field          meaning
#     0     4  magic          b"SBJI"
#     4     2  version        INDEX_VERSION
#     6     2  reserved       zero
#     8     8  stride         requests between entries (INDEX_STRIDE when written)
#    16     8  requests       requests in the input
#    24     8  input_bytes    the input file's size
#    32    16  input_xxh3     xxh3-128 of the input's bytes (big-endian digest bytes)
#    48     8  entries        index entries after the header
#    56     8  header_xxh3    xxh3-64 of bytes 0..56
INDEX_HEADER_DTYPE = checked_dtype(
    [
        ("magic", 0, "|S4", "b'SBJI'"),
        ("version", 4, "<u2", "INDEX_VERSION"),
        ("stride", 8, "<u8", "requests between entries"),
        ("requests", 16, "<u8", "requests in the input"),
        ("input_bytes", 24, "<u8", "input size"),
        # NOTE: raw bytes (V), not a string (S): numpy strips an S field's trailing NULs, and
        # one digest in 256 ends in a zero byte.
        ("input_xxh3", 32, "|V16", "xxh3-128 of the input"),
        ("entries", 48, "<u8", "entries that follow"),
        ("header_xxh3", 56, "<u8", "xxh3 of bytes 0..56"),
    ],
    itemsize=64,
)
# One entry: request k * stride starts at `offset`, on line `line`.
#   off  size  field   meaning
#     0     8  offset  byte offset of the request's line
#     8     8  line    its 1-based line number (blank lines are not requests)
INDEX_ENTRY_DTYPE = checked_dtype(
    [
        ("offset", 0, "<u8", "line's byte offset"),
        ("line", 8, "<u8", "1-based line number"),
    ],
    itemsize=16,
)

# One per request, in request order, nothing else in the file (its size is 8 x requests).
#   off  size  field      meaning
#     0     8  line_xxh3  xxh3-64 of the request's line, without its newline
LINE_DIGEST_DTYPE = checked_dtype([("line_xxh3", 0, "<u8", "xxh3 of the line")], itemsize=8)

# Which file an answer's line went to.
LOG_OUTPUT = 0
LOG_ERRORS = 1

# One answered request.
#   off  size  field              meaning
#     0     8  index              the request's index
#     8     8  log_offset         byte offset of its output line in its log
#    16     4  line_bytes         bytes of that line, its newline included
#    20     2  status_code        the response's HTTP status (200, 400, 500)
#    22     1  log                LOG_OUTPUT or LOG_ERRORS: which file holds the line
#    23     1  reserved           zero
#    24     4  prompt_tokens      usage of a completed request (0 for a failed one)
#    28     4  completion_tokens
#    32     4  cached_tokens
#    36     4  check              `record_check` of the 9 words before it: a torn or
#                                 zero-filled record (a power cut) is never read as one
ANSWER_RECORD_DTYPE = checked_dtype(
    [
        ("index", 0, "<u8", "request index"),
        ("log_offset", 8, "<u8", "line's offset in its log"),
        ("line_bytes", 16, "<u4", "line's bytes"),
        ("status_code", 20, "<u2", "HTTP status"),
        ("log", 22, "|u1", "which log"),
        ("prompt_tokens", 24, "<u4", "prompt tokens"),
        ("completion_tokens", 28, "<u4", "completion tokens"),
        ("cached_tokens", 32, "<u4", "cached prompt tokens"),
        ("check", 36, "<u4", "record_check of words 0..9"),
    ],
    itemsize=40,
)
ANSWER_RECORD_SIZE_BYTES = ANSWER_RECORD_DTYPE.itemsize
_CHECKED_WORDS = 9
# record_check's constants: a 32-bit FNV-style mix, odd multiplier, nonzero start (so a
# record of zeros does not check).
_CHECK_START = np.uint32(0x811C_9DC5)
_CHECK_PRIME = np.uint32(0x0100_0193)
_RECORD = struct_for(ANSWER_RECORD_DTYPE, [n for n in ANSWER_RECORD_DTYPE.names if n != "check"])
# Counts in a record are u4: a request's tokens are far below (a prompt is at most the
# broker's item cap, 262,144 tokens; n choices of the longest context stay under 2**32).
MAX_RECORD_COUNT = (1 << 32) - 1


def encode_job_payload(job_id: int, index: int, offset: int, length: int, line_xxh3: int, made_ns: int = 0,
                       flags: int = 0) -> bytes:
    return _PAYLOAD.pack(JOB_PAYLOAD_MAGIC, JOB_PAYLOAD_VERSION, flags, job_id, index, offset, length, line_xxh3,
                         made_ns)


def decode_job_payload(payload: bytes, job_id: int) -> tuple[int, int, int, int, int] | None:
    """(index, offset, length, line_xxh3, made_ns) of an item of job `job_id`; None for any
    other payload (another job's, another version, not a job item at all)."""
    if len(payload) != JOB_PAYLOAD_SIZE_BYTES or not payload.startswith(JOB_PAYLOAD_MAGIC):
        return None
    _magic, version, _flags, owner, index, offset, length, digest, made_ns = _PAYLOAD.unpack(payload)
    if version != JOB_PAYLOAD_VERSION or owner != job_id:
        return None
    return index, offset, length, digest, made_ns


def job_request_indices(tails: np.ndarray, job_id: int, requests: int) -> np.ndarray:
    """The request indices (int64) of the rows of `tails` (uint8, JOB_PAYLOAD_SIZE_BYTES
    wide: the last bytes of stored payloads, where a job item's own payload sits behind its
    generation envelope) that are items of job `job_id` by `decode_job_payload`'s rules, and
    of one of its `requests`: every row checked at once."""
    assert tails.ndim == 2 and tails.shape[1] == JOB_PAYLOAD_SIZE_BYTES, tails.shape
    rows = np.ascontiguousarray(tails).view(JOB_PAYLOAD_DTYPE).reshape(-1)
    mine = ((rows["magic"] == JOB_PAYLOAD_MAGIC) & (rows["version"] == JOB_PAYLOAD_VERSION)
            & (rows["job_id"] == np.uint64(job_id)) & (rows["index"] < np.uint64(requests)))
    return rows["index"][mine].astype(np.int64)


def job_payload_flags(payload: bytes) -> int:
    """The JOB_FLAG_* bits of a job item's payload (one `decode_job_payload` accepted)."""
    return _FLAGS.unpack_from(payload, _FLAGS_OFFSET)[0]


def record_check(words: np.ndarray) -> np.ndarray:
    """The check of records given as rows of their first 9 little-endian u32 words.
    NOTE: a mix numpy computes over every record at once, rather than xxh3 per record: a
    resume checks millions of records, and a Python call per record was 1 us each."""
    check = np.full(words.shape[0], _CHECK_START, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for k in range(_CHECKED_WORDS):
            check = (check ^ words[:, k]) * _CHECK_PRIME
            check ^= check >> np.uint32(15)
    return check


def make_records(columns: dict[str, list[int]]) -> bytes:
    """Records from their columns (every field but `check`, equal lengths), checks computed
    over all of them at once; their bytes."""
    records = np.zeros(len(columns["index"]), dtype=ANSWER_RECORD_DTYPE)
    for name, values in columns.items():
        if name in ("prompt_tokens", "completion_tokens", "cached_tokens") and values:
            assert 0 <= min(values) and max(values) <= MAX_RECORD_COUNT, (name, min(values), max(values))
        records[name] = values
    words = records.view("<u4").reshape(records.size, -1)
    records["check"] = record_check(words[:, :_CHECKED_WORDS])
    return records.tobytes()


def item_key(payload: bytes) -> bytes:
    """What names an item for a checker: its payload, with a job item's `made_ns` zeroed (the
    same request made again, in a resumed run, is the same item)."""
    if len(payload) != JOB_PAYLOAD_SIZE_BYTES or not payload.startswith(JOB_PAYLOAD_MAGIC):
        return payload
    return payload[:_MADE_NS_OFFSET] + bytes(8)


def answer_record(index: int, log_offset: int, line_bytes: int, status_code: int, log: int,
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
    """One record's bytes, its check computed."""
    if not 0 <= min(prompt_tokens, completion_tokens, cached_tokens) or max(
            prompt_tokens, completion_tokens, cached_tokens) > MAX_RECORD_COUNT:
        _RECORD.pack(index, log_offset, line_bytes, status_code, log, prompt_tokens, completion_tokens,
                     cached_tokens)  # raises struct.error, as it always did for an out-of-range count
    return make_records({"index": [index], "log_offset": [log_offset], "line_bytes": [line_bytes],
                         "status_code": [status_code], "log": [log], "prompt_tokens": [prompt_tokens],
                         "completion_tokens": [completion_tokens], "cached_tokens": [cached_tokens]})


def valid_records(raw: bytes) -> np.ndarray:
    """The leading records of `raw` whose checks hold, as an ANSWER_RECORD_DTYPE array; the
    first bad one (torn, zero-filled) and everything after it are left out."""
    whole = len(raw) // ANSWER_RECORD_SIZE_BYTES
    records = np.frombuffer(raw, dtype=ANSWER_RECORD_DTYPE, count=whole)
    words = np.frombuffer(raw, dtype="<u4", count=whole * ANSWER_RECORD_SIZE_BYTES // 4)
    words = words.reshape(whole, ANSWER_RECORD_SIZE_BYTES // 4)
    bad = np.flatnonzero(record_check(words[:, :_CHECKED_WORDS]) != records["check"])
    return records[:bad[0]] if bad.size else records
