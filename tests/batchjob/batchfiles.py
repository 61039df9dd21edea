"""Batch files for the batchjob tests: request lines and files made of them; a file system
without O_TMPFILE."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from pipeline.batchjob.requests import CHAT_URL, COMPLETIONS_URL

MODEL = "tiny"


def chat(custom_id: str = "req-1", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}}


def completion(custom_id: str = "req-1", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL,
            "body": {"model": MODEL, "prompt": "Once upon a time", **body}}


def encode(line: object) -> bytes:
    """A line's bytes: a dict as JSON, a str or bytes as it is (no newline)."""
    if isinstance(line, bytes):
        return line
    return (line if isinstance(line, str) else json.dumps(line)).encode()


def write(path: Path, *lines: object, last_newline: bool = True) -> Path:
    """A batch file of `lines` (each as `encode` makes it), one a line."""
    data = b"\n".join(encode(line) for line in lines)
    path.write_bytes(data + b"\n" if last_newline and lines else data)
    return path


def line_of(size: int) -> bytes:
    """A chat request line of exactly `size` bytes (without its newline)."""
    line = chat("big")
    line["body"]["messages"][0]["content"] = ""
    line["body"]["messages"][0]["content"] = "a" * (size - len(json.dumps(line).encode()))
    raw = json.dumps(line).encode()
    assert len(raw) == size
    return raw


@contextmanager
def without_tmpfile() -> Iterator[None]:
    """os.open as on a file system without O_TMPFILE (EOPNOTSUPP), for the block."""
    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if (flags & os.O_TMPFILE) == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return real(path, flags, *args, **kwargs)

    with mock.patch.object(os, "open", refusing):
        yield
