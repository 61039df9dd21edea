"""A batch's output and error files, from what its run answered (`runner.Answers`).

    sizes = write_batch_files(answers, input_path, tag, stop_code, output_path, error_path)

The output file is the run's output log up to its last recorded answer; the error file its
error log likewise, then, for a batch stopped before every request ran (cancelled, expired),
one line per request without an answer (`output.unrun_line`: OpenAI's batch_cancelled or
batch_expired), found by reading the input once, a line at a time, against the run's bit per
request. So every request of the input has exactly one line in the two files, whatever
stopped the run. Each file is written whole or not at all (`ReplacingFile`), so writing it
again after a kill writes the same bytes.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

from pipeline.batchjob.output import unrun_line
from pipeline.batchjob.paths import ReplacingFile
from pipeline.batchjob.scan import MAX_REQUEST_LINE_BYTES, envelope, read_lines
from pipeline.service.runner import Answers

# Bytes of a log copied at a time.
COPY_CHUNK_BYTES = 1 << 20


def write_batch_files(answers: Answers, input_path: str, tag: str, stop_code: str | None, output_path: str,
                      error_path: str) -> tuple[int, int]:
    """Write the output and error files (the module's doc); their sizes in bytes (a file of
    no lines is not written: 0)."""
    output_size = _write(output_path, _prefix(answers.output_path, answers.output_bytes))
    unrun = _unrun(answers, input_path, tag, stop_code) if stop_code is not None else iter(())
    error_size = _write(error_path, itertools.chain(_prefix(answers.error_path, answers.error_bytes), unrun))
    return output_size, error_size


def _write(path: str, chunks: Iterator[bytes]) -> int:
    out = ReplacingFile(path)
    size = 0
    try:
        for chunk in chunks:
            out.write(chunk)
            size += len(chunk)
        if size:
            out.commit()
    finally:
        out.abandon()
    return size


def _prefix(path: str | None, size: int) -> Iterator[bytes]:
    """The first `size` bytes of the file at `path`, a chunk at a time."""
    if path is None or not size:
        return
    with open(path, "rb") as f:
        left = size
        while left:
            chunk = f.read(min(COPY_CHUNK_BYTES, left))
            if not chunk:
                raise OSError(f"{path} is {size - left:,} bytes, and its answers' records reach {size:,}")
            left -= len(chunk)
            yield chunk


def _unrun(answers: Answers, input_path: str, tag: str, code: str) -> Iterator[bytes]:
    """A line per request of the input without an answer (requests counted as the job's
    scan counts them: every line that is not blank)."""
    index = 0
    with open(input_path, "rb") as f:
        for _offset, _line, raw in read_lines(f, MAX_REQUEST_LINE_BYTES):
            if raw is None or not raw.strip():
                continue
            if not answers.is_answered(index):
                yield unrun_line(envelope(raw).custom_id, index, tag, code).encode() + b"\n"
            index += 1


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
