"""A model directory's small files, read with bounds: a file linked to a device, a torn
multi-GB file or one that is not text fails with ModelDirError naming its path, never fills
memory or hangs; and the fields of tokenizer_config.json the chat tokenizer takes."""

from __future__ import annotations

import stat
from pathlib import Path

from pipeline.batchjob.scan import show
from pipeline.batchjob.template import read_text_file
from pipeline.wire.errors import ModelDirError

# The template taken from the list-of-named-templates form (transformers' default name).
DEFAULT_TEMPLATE_NAME = "default"


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


def config_template(config: dict, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or the named-templates list's
    "default"; None where there is none."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        named = {t.get("name"): t.get("template") for t in template}
        chosen = named.get(DEFAULT_TEMPLATE_NAME)
        if chosen is None:
            return None
        if not isinstance(chosen, str):
            raise ModelDirError(f"{path}: chat_template {DEFAULT_TEMPLATE_NAME!r} must be a string, got {show(chosen)}")
        return chosen
    raise ModelDirError(f"{path}: chat_template must be a string or a list of {{name, template}} objects, "
                        f"got {show(template)}")


def config_token_text(config: dict, key: str, path: Path) -> str | None:
    """A special token of the config: a string, {"content": ...} (as transformers writes an
    AddedToken), or null."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelDirError(f"{path}: {key} must be a string or an object with a string content, "
                            f"got {show(config.get(key))}")
    return value
