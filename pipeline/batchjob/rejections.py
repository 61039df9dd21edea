"""Requests answered before they reach the broker: a producer's log of what it refused.

    DATA_DIR/job/rejected/NAME.jsonl   one line per refused request:
        {"index", "offset", "length", "line_xxh3", "status", "message", "param", "code"}

A producer refuses a request whose body the job cannot serve (`requests.py`), whose prompt
cannot be made (the chat template raised, the tokenizer failed) or is longer than the model
takes, and the job's supervisor refuses one whose prompt ran past the time or memory limit
(the producer was stopped on it). The collector turns each line into the request's error
line (`collect.py`), with the request's custom_id read back from the input by offset.

Owner: one process per file (a producer, or the job's supervisor, each naming its own);
each refusal is one O_APPEND write of one whole line, so a kill leaves whole lines (a torn
last one is skipped by the collector, and that request is simply made again next run).
"""

from __future__ import annotations

import json
import os

from pipeline.batchjob.manifest import JOB_DIR
from pipeline.wire.dirpin import DirPin

REJECTED_DIR = "rejected"
# The logs' names (NAME.jsonl): a producer's p{index}-{pid}, the job's supervisor's, a Ray
# driver's driver-{pid}.
REJECTED_NAMES = r"(p\d+-\d+|supervisor|driver-\d+)\.jsonl"
# A message is a sentence or two; one that runs longer (a template's exception text) is cut.
MAX_MESSAGE_CHARS = 4096
FILE_MODE = 0o600


class RejectionLog:
    """See the module's doc. `close()` is explicit."""

    def __init__(self, data_dir: str, name: str, pin: DirPin | None = None) -> None:
        """`pin`: the data directory as the job checked it (DataDirMovedError, nothing made,
        when its path leads elsewhere now)."""
        if pin is not None:
            pin.check()
        folder = os.path.join(data_dir, JOB_DIR, REJECTED_DIR)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.path = os.path.join(folder, f"{name}.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                           FILE_MODE)

    def reject(self, where: tuple[int, int, int, int], status: int, message: str, param: str | None = None,
               code: str | None = None) -> None:
        """Refuse the request at `where` (index, offset, length, line_xxh3) with HTTP `status`."""
        index, offset, length, digest = where
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS - 3] + "..."
        line = json.dumps({"index": index, "offset": offset, "length": length, "line_xxh3": digest, "status": status,
                           "message": message, "param": param, "code": code}, ensure_ascii=True)
        os.write(self._fd, line.encode() + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
