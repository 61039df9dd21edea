"""A consumer's results file: each engine run's result lines appended at once, all or nothing
(a batch's, or a slice of a batch asking for much answer: consumer/slices.py).

    results_dir/{name}.jsonl     one JSON object per item, one line each:
    {"item_id", "batch_id", "dispatch_ns", "submit_ns", "done_ns", "pad_to_tokens", "status",
     "prompt_tokens", "prompt_xxh3", "cached_tokens", "output_tokens", "output": [token ids],
     "finish_reason": "length" or "stop" (null where nothing ran), ["text": the generated
     text, where the engine has a tokenizer,] ["samples": every output of an item that asked
     for several (n) or for logprobs, each {"output", "finish_reason", ["text",] ["logprobs":
     per token, [[token id, logprob, token text or null], ...], the sampled token first]},]
     ["embeddings": an item to embed's embeddings, one per input, each the base64 of its
     little-endian float32 values (exact, and a third of the digits of JSON floats),]
     "payload": base64 of the producer's opaque payload (without the generation envelope:
     pipeline/wire/generation.py)}

in that key order, written by `result_lines` alone. With "samples", "output", "finish_reason"
and "text" are the first sample's (for readers of one output) and "output_tokens" counts
every sample's tokens (the usage of all n completions). `prompt_xxh3` is
pipeline.wire.layouts.prompt_digest of the token ids the consumer read (taken from the
mapped entry as it is read: the engine is handed views of those same bytes, which the broker
never rewrites), null where nothing could be read (STATUS_CORRUPT): the end-to-end check of a checker
(lab.reliability). The *_ns fields are time.monotonic_ns():
one clock for every process of the machine; done_ns is taken once per call, as a batch's
lines are formatted, just before they are written. `status` is STATUS_OK, STATUS_TOO_LONG
(longer than the contract's max input length: no output), STATUS_CANCELLED (its owner
ended, `pipeline/wire/owners.py`: not run, no output), STATUS_CORRUPT (the entry failed
its checks: no output, no payload) or STATUS_ERROR (the engine failed that item: no output,
and one more key, "error", with the engine's message; `error_lines`). Readers: `pipeline.reporting.accounting`.

Writes go straight to the file with os.write on an O_APPEND descriptor, without Python's
buffering: once `write` returns, the batch's lines are in the page cache (they survive a
kill -9 of the consumer; with `fsync`, a power cut too), so the consumer may report the batch
complete, and nothing is left to flush at close. (A buffered writer's flush at close hit
ENOSPC a second time and crashed a consumer with a traceback.)

All or nothing: a write that fails (ENOSPC in the middle of a batch, say) is undone with
ftruncate back to the size the file had before it. ftruncate frees blocks, so it works on a
full disk. No partial line is left for the next batch's lines to be glued to, and no byte
written before is touched.

A torn tail (a process killed in the middle of a write, or a write cut short by an older
version) is terminated with a newline when the file is opened: the torn line stays as the
evidence, and readers count it as a bad line (`pipeline.reporting.accounting`). Bytes a previous run
wrote are never truncated. If even that one newline does not fit (the disk is full), it goes
in front of the next write, which is all or nothing as any other.

One writer process per file: the consumer of that name (the launcher names its consumers
apart, and `consumer start` refuses a second consumer of a name on a data directory). Cutting
back a failed write relies on it: the file must be exactly as long as this writer left it
plus what the failed write wrote, else a second writer exists, and then nothing is cut and
the error (fatal) says so.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import time
from collections.abc import Sequence
from itertools import chain

import numpy as np

from pipeline.consumer.engines.base import Sample
from pipeline.wire import fileops
from pipeline.wire.errors import ResultsDiskFullError, ResultsFileError, ResultsWriteError
from pipeline.wire.fileops import errno_text
from pipeline.wire.layouts.descriptors import Descriptor

# Every results file is owner-only, whatever the umask (SPEC §7, §12).
RESULTS_FILE_MODE = 0o600
RESULTS_DIR_MODE = 0o700
# A results file that is a symlink is refused (O_NOFOLLOW): results go to the file the data
# directory names, never to wherever a link placed there points.
_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
# errno values that mean "no space for this write": wait for space, do not give up.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
STATUS_OK = "ok"
STATUS_TOO_LONG = "too_long"
STATUS_CANCELLED = "cancelled"  # its owner ended (`wire/owners.py`): not run, no output
STATUS_CORRUPT = "corrupt"
STATUS_ERROR = "error"


def result_lines(d: Descriptor, status: str, item_ids: Sequence[int], submit_ns: Sequence[int],
                 prompt_tokens: Sequence[int], cached_tokens: Sequence[int], outputs: Sequence[Sequence[int]],
                 payloads: Sequence[bytes], finish_reasons: Sequence[str] | None = None,
                 texts: Sequence[str | None] | None = None, digests: Sequence[int] | None = None,
                 samples: Sequence[list[Sample] | None] | None = None,
                 embeddings: Sequence[list[np.ndarray] | None] | None = None) -> str:
    """The result lines of items of one batch and one status, as one string (lines joined by
    "\n", no trailing one; "" for no items): the batch's fields are written into the format
    once, done_ns is taken once, and when every output is as long and every finish reason
    the same (the sim engine's, or nothing ran) with no text, the whole call is one `%`
    format over all its values. `finish_reasons` None: null for every item (nothing ran).
    `digests` (prompt_digest of each prompt) None: null for every item (nothing was read).

    Example, 2 items with outputs [7, 8] and [9, 10]: the format is the line's format with
    "%d,%d" for the output, repeated twice, and its values are (id0, submit0, prompt0,
    cached0, 7, 8, id1, ...).
    NOTE: formatted by hand rather than with json.dumps (5x the cost per item): every value
    is an int, a list of ints, a fixed word or base64 text, none of which needs escaping;
    only a text goes through json.dumps (ensure_ascii: the file stays ASCII). tests/consumer
    checks that the lines parse as JSON. One % over the batch rather than one per line: a
    quarter less time (no tuple and no string per item).
    """
    if not item_ids:
        return ""
    if embeddings is not None and any(e is not None for e in embeddings):
        samples = samples if samples is not None else [None] * len(item_ids)
    else:
        embeddings = None
    if samples is not None and any(m is not None for m in samples) or embeddings is not None:
        return _with_samples(d, status, item_ids, submit_ns, prompt_tokens, cached_tokens, outputs, payloads,
                             finish_reasons, texts, digests, samples, embeddings)
    head = (f'{{"item_id":%d,"batch_id":{d.batch_id},"dispatch_ns":{d.dispatch_ns},"submit_ns":%d,'
            f'"done_ns":{time.monotonic_ns()},"pad_to_tokens":{d.pad_to_tokens},"status":"{status}",'
            f'"prompt_tokens":%d,"prompt_xxh3":{"%d" if digests is not None else "null"},"cached_tokens":%d,'
            f'"output_tokens":')
    columns: list = [item_ids, submit_ns, prompt_tokens] + ([digests] if digests is not None else []) + [cached_tokens]
    at = len(columns)  # where the output columns go
    payload = '"payload":""}'
    if any(payloads):
        columns.append([base64.b64encode(p).decode() if p else "" for p in payloads])
        payload = '"payload":"%s"}'
    reasons = set(finish_reasons) if finish_reasons is not None else {None}
    widths = set(map(len, outputs))
    if len(widths) == 1 and len(reasons) == 1 and texts is None:  # output ids and reason go in the format
        width = widths.pop()
        reason = _finish_json(reasons.pop())
        form = f'{head}{width},"output":[{",".join(["%d"] * width)}],"finish_reason":{reason},{payload}'
        columns[at:at] = zip(*outputs)
        return "\n".join([form] * len(item_ids)) % tuple(chain.from_iterable(zip(*columns)))
    form = f'{head}%d,"output":[%s],"finish_reason":%s,{payload}'
    reason_column = [_finish_json(r) for r in finish_reasons] if finish_reasons is not None else ["null"] * len(outputs)
    if texts is not None:
        reason_column = [f'{r},"text":{json.dumps(t, ensure_ascii=True)}' for r, t in zip(reason_column, texts)]
    columns[at:at] = [list(map(len, outputs)), [",".join(map(str, o)) for o in outputs], reason_column]
    return "\n".join([form % row for row in zip(*columns)])


def _with_samples(d: Descriptor, status: str, item_ids: Sequence[int], submit_ns: Sequence[int],
                  prompt_tokens: Sequence[int], cached_tokens: Sequence[int], outputs: Sequence[Sequence[int]],
                  payloads: Sequence[bytes], finish_reasons: Sequence[str] | None, texts: Sequence[str | None] | None,
                  digests: Sequence[int] | None, samples: Sequence[list[Sample] | None],
                  embeddings: Sequence[list[np.ndarray] | None] | None = None) -> str:
    """`result_lines` of a batch where some items have samples or embeddings: the others
    through `result_lines` itself, these with json.dumps (they are few, and their texts and
    logprobs need escaping anyway)."""
    mine_of = [m is not None or (embeddings is not None and embeddings[i] is not None) for i, m in enumerate(samples)]
    plain = [i for i, special in enumerate(mine_of) if not special]
    lines = []
    if plain:
        def pick(column):
            return [column[i] for i in plain] if column is not None else None

        lines.append(result_lines(d, status, pick(item_ids), pick(submit_ns), pick(prompt_tokens),
                                  pick(cached_tokens), pick(outputs), pick(payloads), pick(finish_reasons),
                                  pick(texts), pick(digests)))
    done_ns = time.monotonic_ns()
    for i, mine in enumerate(samples):
        if not mine_of[i]:
            continue
        row = {"item_id": item_ids[i], "batch_id": d.batch_id, "dispatch_ns": d.dispatch_ns, "submit_ns": submit_ns[i],
               "done_ns": done_ns, "pad_to_tokens": d.pad_to_tokens, "status": status,
               "prompt_tokens": prompt_tokens[i], "prompt_xxh3": digests[i] if digests is not None else None,
               "cached_tokens": cached_tokens[i],
               "output_tokens": sum(len(s.token_ids) for s in mine) if mine is not None else len(outputs[i]),
               "output": list(outputs[i]), "finish_reason": finish_reasons[i] if finish_reasons is not None else None}
        if texts is not None and texts[i] is not None:
            row["text"] = texts[i]
        if mine is not None:
            row["samples"] = [_sample_json(s) for s in mine]
        if embeddings is not None and embeddings[i] is not None:
            row["embeddings"] = [base64.b64encode(np.asarray(e, dtype="<f4").tobytes()).decode()
                                 for e in embeddings[i]]  # type: ignore[union-attr]
        row["payload"] = base64.b64encode(payloads[i]).decode() if payloads[i] else ""
        lines.append(json.dumps(row, separators=(",", ":"), ensure_ascii=True))
    return "\n".join(lines)


def _sample_json(sample: Sample) -> dict:
    out: dict = {"output": list(sample.token_ids), "finish_reason": sample.finish_reason}
    if sample.text is not None:
        out["text"] = sample.text
    if sample.logprobs is not None:
        out["logprobs"] = [[list(entry) for entry in token] for token in sample.logprobs]
    return out


def _finish_json(reason: str | None) -> str:
    """A finish reason as JSON: an engine's word (letters and underscores, as written), or
    null; anything else an engine might say goes through json.dumps (ASCII)."""
    if reason is None:
        return "null"
    if reason.replace("_", "").isalnum() and reason.isascii():
        return f'"{reason}"'
    return json.dumps(reason, ensure_ascii=True)


def error_lines(d: Descriptor, item_ids: Sequence[int], submit_ns: Sequence[int], prompt_tokens: Sequence[int],
                messages: Sequence[str], payloads: Sequence[bytes], digests: Sequence[int | None]) -> str:
    """The result lines of items the engine failed (STATUS_ERROR), as `result_lines` makes
    them (the same keys in the same order, no output, 0 cached) with "error": the engine's
    message last. json.dumps with ensure_ascii: a message is arbitrary text, and the file
    stays ASCII; errors are rare, so the per-line cost that `result_lines` avoids is moot."""
    done_ns = time.monotonic_ns()
    return "\n".join(json.dumps({
        "item_id": item, "batch_id": d.batch_id, "dispatch_ns": d.dispatch_ns, "submit_ns": submitted,
        "done_ns": done_ns, "pad_to_tokens": d.pad_to_tokens, "status": STATUS_ERROR, "prompt_tokens": tokens,
        "prompt_xxh3": digest, "cached_tokens": 0, "output_tokens": 0, "output": [], "finish_reason": None,
        "payload": base64.b64encode(payload).decode() if payload else "", "error": message,
    }, separators=(",", ":"), ensure_ascii=True) for item, submitted, tokens, message, payload, digest
        in zip(item_ids, submit_ns, prompt_tokens, messages, payloads, digests))


class ResultsFile:
    """One consumer's results file, open for appending.

    Owner: the consumer process, its main thread. Not thread-safe, and one writer process per
    file (see the module docstring). `close()` is explicit and idempotent.

    Example: `f = ResultsFile("results/gpu0.jsonl")` on a file that ends in
    `{"item_id":7,"sta` appends "\\n" (so `f.torn_tail_found` is true and the torn line
    reads as one bad line); `f.write(b'{...}\\n{...}\\n')` then appends both lines or, on
    ENOSPC, nothing, raising ResultsDiskFullError.
    """

    def __init__(self, path: str, fsync: bool = False) -> None:
        self.path = path
        self._fsync = fsync
        directory = os.path.dirname(path) or "."
        try:
            os.makedirs(directory, mode=RESULTS_DIR_MODE, exist_ok=True)
            existed = os.path.lexists(path)
            self._fd = fileops.open_fd(path, _OPEN_FLAGS, RESULTS_FILE_MODE)
        except OSError as exc:
            if exc.errno in DISK_FULL_ERRNOS:  # no inode, no directory block left: back off, retry
                raise ResultsDiskFullError(f"{path}: cannot create the results file: {errno_text(exc)}", path, 0,
                                           exc.errno) from exc
            raise ResultsFileError(f"{path}: cannot open the results file: {errno_text(exc)}") from exc
        try:
            os.fchmod(self._fd, RESULTS_FILE_MODE)  # the umask may have taken bits off, or an
            self._size = os.fstat(self._fd).st_size  # older run left the file 0644
            self._torn_tail = self._size > 0 and self._last_byte() != b"\n"
            if fsync and not existed:
                fileops.fsync_directory(directory)  # the new file's name survives a power cut
        except OSError as exc:
            os.close(self._fd)
            raise ResultsFileError(f"{path}: cannot open the results file: {errno_text(exc)}") from exc
        self._closed = False
        # The file ended in a torn line (terminated before anything new is appended), and
        # the file's size then, for the consumer's log.
        self.torn_tail_found = self._torn_tail
        self.size_at_open_bytes = self._size
        if self._torn_tail:
            try:
                self.write(b"")  # the newline alone; all or nothing like any write
            except ResultsDiskFullError:
                pass  # it goes in front of the next batch's lines
            except ResultsWriteError:
                self.close()
                raise

    def sync_writes(self, on: bool) -> None:
        """fsync every write from now on (`on`) or not. Turned on, what the file already
        holds is fsynced at once, with its directory (lines written for a broker at
        `process` become durable before a broker at `power` counts on them). A failed fsync
        raises ResultsWriteError, fatal even for ENOSPC: it is never retried as if nothing
        happened (the kernel may have dropped the pages it could not write)."""
        if on and not self._fsync:
            try:
                fileops.fsync(self._fd)
                fileops.fsync_directory(os.path.dirname(self.path) or ".")
            except OSError as exc:
                raise ResultsWriteError(f"{self.path}: fsync of the results file failed: {errno_text(exc)}",
                                        self.path, self._size, exc.errno or 0) from exc
        self._fsync = on

    @property
    def size_bytes(self) -> int:
        """The file's length as this writer left it (every write whole)."""
        return self._size

    def _last_byte(self) -> bytes:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            return os.pread(fd, 1, self._size - 1)
        finally:
            os.close(fd)

    def write(self, data: bytes) -> None:
        """Append `data` (whole lines, each ending in "\\n"), all or nothing: on any error the
        file is cut back to its size before this call and ResultsWriteError (or its
        ResultsDiskFullError) is raised. With `fsync`, the data is on disk when this returns."""
        start = self._size
        if self._torn_tail:
            data = b"\n" + data  # terminate the torn line first (see the module docstring)
        written = 0
        try:
            # NOTE: one os.write per batch (a regular file takes it whole unless the disk
            # fills); the loop is for the short write a full disk or a signal can make.
            # Measured against the buffered text write + flush it replaced: 6.2 against
            # 6.4 us per 64-line (13 KiB) batch; tools/bench_consumer.py 7.1-7.2 against
            # 7.0-7.2 us per item (noise).
            written = fileops.write(self._fd, data)
            while written < len(data):
                more = fileops.write(self._fd, memoryview(data)[written:])
                if more <= 0:
                    raise OSError(errno.EIO, f"write() wrote nothing of {len(data) - written} bytes")
                written += more
            if self._fsync:
                fileops.fsync(self._fd)
        except OSError as exc:
            raise self._undo(start, written, len(data), exc) from exc
        self._size = start + written
        self._torn_tail = False

    def _undo(self, start: int, written: int, length: int, exc: OSError) -> ResultsWriteError:
        """Cut the file back to `start` after a failed write of `length` bytes, of which
        `written` landed; the error to raise, naming what was and was not undone."""
        what = f"{self.path}: writing {length} bytes of results at byte {start}: {errno_text(exc)}"
        kind = ResultsDiskFullError if exc.errno in DISK_FULL_ERRNOS else ResultsWriteError
        try:
            found = os.fstat(self._fd).st_size
            if found != start + written:
                # Someone else appends to this file: cutting it could destroy their lines.
                return ResultsWriteError(
                    f"{what}; the file is {found} bytes, not the {start + written} this consumer wrote: another "
                    f"process writes to it, so the {written} partial bytes were left", self.path, start, exc.errno or 0)
            if written:
                fileops.ftruncate(self._fd, start)
        except OSError as cut:
            return ResultsWriteError(f"{what}; cutting the {written} partial bytes off failed too: "
                                     f"{errno_text(cut)}", self.path, start, exc.errno or 0)
        return kind(f"{what}; nothing of it was kept", self.path, start, exc.errno or 0)

    def close(self) -> None:
        """Close the file. Nothing is buffered, so nothing is lost by closing; an error from
        close(2) itself (which a network file system may report) is a ResultsFileError."""
        if self._closed:
            return
        self._closed = True
        try:
            os.close(self._fd)
        except OSError as exc:
            raise ResultsFileError(f"{self.path}: closing the results file: {errno_text(exc)}") from exc
