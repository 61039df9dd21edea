"""Batch files for the batchjob tests: request lines and files made of them, the output lines
a job writes for them; a file system without O_TMPFILE."""

from __future__ import annotations

import base64
import errno
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

from pipeline.batchjob.embeddings import embedding_inputs
from pipeline.batchjob.output import RequestRef, embedding_line, error_line, response_line
from pipeline.batchjob.requests import CHAT_URL, COMPLETIONS_URL, ENDPOINTS, KIND_CHAT, KIND_EMBEDDING

MODEL = "tiny"
# What the output lines made here say of their job: its id tag and start.
TAG = "0123456789ab"
CREATED = 1_760_000_000


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


def answer(request: dict, index: int, status: int = 200, tokens: tuple[int, int, int] = (12, 3, 4)) -> dict:
    """The output line a job writes for `request` (its index among the file's requests): with
    status 200 an answer of made-up text, as many choices as its n (`tokens`: its prompt,
    completion and cached tokens), else OpenAI's error object."""
    ref = RequestRef(request["custom_id"], ENDPOINTS.get(request["url"]), index)
    if status != 200:
        return json.loads(error_line(ref, status, "made up", "model", tag=TAG))
    prompt, completion, cached = tokens
    row = {"status": "ok", "prompt_tokens": prompt, "output_tokens": completion, "cached_tokens": cached,
           "finish_reason": "stop", "embeddings": [base64.b64encode(np.zeros(4, "<f4").tobytes()).decode()]}
    model = request["body"]["model"]
    if ref.kind == KIND_EMBEDDING:
        row["embeddings"] *= len(embedding_inputs(request["body"]).inputs)
        return json.loads(embedding_line(ref, row, "float", model, CREATED, TAG))
    n = request["body"].get("n") or 1
    key = "message" if ref.kind == KIND_CHAT else "text"
    choices = [{"index": k, key: {"role": "assistant", "content": "hi"} if key == "message" else "hi",
                "logprobs": None, "finish_reason": "stop"} for k in range(n)]
    return json.loads(response_line(ref, row, None, model, CREATED, TAG, choices))
