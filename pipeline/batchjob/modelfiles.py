"""A model directory's small files, read with bounds: a file linked to a device, a torn
multi-GB file or one that is not text fails with ModelDirError naming its path, never fills
memory or hangs."""

from __future__ import annotations

import stat
from pathlib import Path

from pipeline.batchjob.template import read_text_file
from pipeline.wire.errors import ModelDirError


def check_model_file(path: Path, limit_bytes: int, missing: str) -> None:
    """`path` is a readable regular file of at most `limit_bytes`, or ModelDirError (with
    `missing`, what the directory needs, where it does not exist)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ModelDirError(f"{path}: missing ({missing})") from None
    except OSError as exc:
        raise ModelDirError(f"{path}: cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ModelDirError(f"{path}: not a regular file")
    if info.st_size > limit_bytes:
        raise ModelDirError(f"{path}: {info.st_size:,} bytes, more than the {limit_bytes:,} a model file may have")


def read_model_text(path: Path, limit_bytes: int, missing: str) -> str:
    """A small UTF-8 file's text (bounded: read at most limit+1 bytes), or ModelDirError."""
    check_model_file(path, limit_bytes, missing)
    return read_text_file(path, limit_bytes, str(path))
