"""A chat request's messages and tools as a chat template gets them, checked.

    checked = check_messages(request["messages"])    # ChatRequestError naming the field
    k = last_user_index(checked)                     # where the request's own part starts
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.batchjob.scan import show
from pipeline.wire.errors import ChatRequestError

# How a message's list of text parts becomes the string a template expects: vLLM's "string"
# content format joins the parts' texts with a newline.
CONTENT_PART_SEPARATOR = "\n"


def check_messages(messages: object) -> list[dict[str, Any]]:
    """A request's messages as the template gets them: a non-empty list of objects with a
    string role and a content that is a string, null, or a list of text parts (joined into
    one string); other fields (name, tool_calls...) pass through. ChatRequestError names the
    message and field."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError(f"messages must be a non-empty list of messages, got {show(messages)}")
    checked = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatRequestError(f"messages[{k}] must be an object with role and content, got {show(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatRequestError(f"messages[{k}].role must be a non-empty string, got {show(role)}")
        content = message.get("content")
        if isinstance(content, list):
            content = _join_parts(content, k)
        elif content is not None and not isinstance(content, str):
            raise ChatRequestError(f"messages[{k}].content must be a string, a list of text parts or "
                                   f"null, got {show(content)}")
        checked.append({**message, "content": content})
    return checked


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the last message whose role is "user"; -1 where there is none (no components:
    without a user turn there is no request part to tell from a shared prefix)."""
    for k in range(len(messages) - 1, -1, -1):
        if messages[k].get("role") == "user":
            return k
    return -1


def _join_parts(parts: list, k: int) -> str:
    texts = []
    for n, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatRequestError(f"messages[{k}].content[{n}] must be a text part "
                                   f'{{"type": "text", "text": ...}}, got {show(part)} (only text is supported)')
        texts.append(part["text"])
    return CONTENT_PART_SEPARATOR.join(texts)


def check_tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ChatRequestError(f"tools must be a list of tool objects, got {show(tools)}")
    return tools
