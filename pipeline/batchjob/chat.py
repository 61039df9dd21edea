"""A model directory's tokenizer and chat template: requests in, token ids and shapes out.

    tokenizer = ChatTokenizer.load("models/llama")         # tokenizer.json + tokenizer_config.json
    prompt = tokenizer.chat_prompt(request["messages"])      # ChatPrompt(tokens, components)
    prompt = tokenizer.completion_prompt("Once upon a time")  # components: none

A chat prompt is rendered the way transformers' `apply_chat_template` renders it (Jinja in an
immutable sandbox, trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that does
not escape HTML, loop controls) and tokenized without adding special tokens again: the
template writes bos itself, as vLLM's chat endpoint does. Nothing here imports transformers.

Components (SPEC §1: the cacheable prefix parts, back to back a prefix of the tokens): one
per message before the last user message (the system prompt, a tool schema or few-shot
turns, earlier turns of a conversation). The boundary after message j is where the template
rendered with messages[:j+1] and no generation prompt ends, as tokens: the longest common
token prefix of that render's tokens and the whole prompt's. Where the tokenizer merges
across the message boundary the boundary so moves back to the last token both share; a
boundary that does not advance past the previous one is dropped (components are never
empty). Turn k+1 of a conversation then starts with turn k's components, so the broker's
shape chains see the conversation grow.

Finding the boundaries the plain way tokenizes every prefix render: quadratic in turns. The
fast path (`_fast_boundary`) reads the boundary off the whole prompt's own token offsets
where it falls beside a special token (ChatML's <|im_start|>, Llama 3's <|eot_id|>, ...):
tokenizers split the text at added tokens before anything else, so the text before one is
tokenized alone and the prefix render's tokens are exactly the prompt's first tokens.
Elsewhere (templates that delimit messages with plain text) the prefix render is tokenized,
through a bounded memo keyed by its text (shared system prompts and few-shot blocks are
tokenized once per producer). tests/batchjob/test_chat.py checks both against the plain way.

NOTE: reading every boundary off the prompt's token offsets (a token boundary at the cut) was
rejected: it is wrong where a prefix render ends in whitespace that merges alone but is split
inside the prompt (" \n" before a letter: the pre-tokenizer's whitespace rule looks ahead),
and the property test finds that case. Measured (tools/bench_tokenize.py, tiny model, 2
shared cores): the plain way 205k tokens/s for system + few-shot + user, 133k for 13-message
conversations; with the memo 779k and 136k; with special-token markers (fast path) 752k and
701k; a plain `encode` of a completion 1.0M. `encode_batch` (1.0-1.3M tokens/s in chunks of
16-256) is no faster than `encode` one at a time on 2 cores, so chat_prompt encodes one by one.
"""

from __future__ import annotations

import json
import stat
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.wire.errors import ChatRequestError, ModelDirError, NoChatTemplateError, TokenArrayError

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Newer transformers saves the template beside the config; when present it wins over the
# config's `chat_template`, as transformers loads it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The template taken from the list-of-named-templates form (transformers' default name).
DEFAULT_TEMPLATE_NAME = "default"
# Largest tokenizer.json read: real ones are 2-35 MB (Gemma's is the largest seen); the cap
# only stops a file linked to a device or a torn multi-GB file from filling memory.
MAX_TOKENIZER_BYTES = 256 << 20
# Largest tokenizer_config.json or chat_template.jinja read (real configs are < 1 MB, with
# their added_tokens_decoder tables).
MAX_CONFIG_BYTES = 16 << 20
# Characters of prefix renders whose tokens the memo keeps (about 4 bytes of ids per 3-4
# characters plus the key: ~100 MB at most); a producer's shared system prompts and few-shot
# blocks fit many times over, so each is tokenized once.
MEMO_CHARS = 16 << 20
# How a message's list of text parts becomes the string a template expects: vLLM's "string"
# content format joins the parts' texts with a newline.
CONTENT_PART_SEPARATOR = "\n"


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """One request's prompt: `tokens` (int32, read-only) and its `components`, read-only
    views of `tokens` that back to back are its first `prefix_len` tokens."""

    tokens: np.ndarray
    components: list[np.ndarray]

    @property
    def prefix_len(self) -> int:
        return sum(len(c) for c in self.components)

    @property
    def suffix(self) -> np.ndarray:
        """The tokens after the components (a read-only view)."""
        return self.tokens[self.prefix_len:]


class ChatTokenizer:
    """A model's tokenizer (tokenizers' Rust one) and its chat template (Jinja).

    Owner: one producer process (or one command). Not thread-safe: `chat_prompt` updates the
    memo of prefix tokenizations; make one per thread. `load` reads files; everything else
    is pure computation.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool | None = None, source: str = "<memory>",
                 memo_chars: int = MEMO_CHARS) -> None:
        """`source` names the model directory in messages. A template that does not compile
        raises ModelDirError."""
        # NOTE: a tokenizer.json saved with truncation or padding on would cut or pad every
        # prompt silently; a batch job sends prompts whole (the consumer refuses long ones).
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._source = source
        self._bos_token, self._eos_token = bos_token, eos_token
        self._template = _compile(chat_template, source) if chat_template is not None else None
        self._special_ids = _clean_special_tokens(tokenizer)
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_chars = 0
        self._memo_limit = memo_chars
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        self._bos_fix = self._bos_rule(add_bos_token)

    @classmethod
    def load(cls, model_dir: str | Path, *, memo_chars: int = MEMO_CHARS) -> ChatTokenizer:
        """MODEL_DIR/tokenizer.json and tokenizer_config.json (its chat template, bos and eos
        tokens, add_bos_token), or ModelDirError naming the path. A directory without a chat
        template loads: its chat requests are refused (NoChatTemplateError)."""
        from tokenizers import Tokenizer

        root = Path(model_dir)
        if not root.is_dir():
            raise ModelDirError(f"{root}: not a model directory (expected {TOKENIZER_FILE} and "
                                f"{TOKENIZER_CONFIG_FILE} in it)")
        tokenizer_path = root / TOKENIZER_FILE
        _check_regular(tokenizer_path, MAX_TOKENIZER_BYTES)
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises plain Exception for every parse error
            raise ModelDirError(f"{tokenizer_path}: not a tokenizer file ({_one_line(exc)})") from exc
        config_path = root / TOKENIZER_CONFIG_FILE
        try:
            config = json.loads(_read_text(config_path, MAX_CONFIG_BYTES))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelDirError(f"{config_path}: not valid JSON ({_one_line(exc)})") from exc
        if not isinstance(config, dict):
            raise ModelDirError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        template_file = root / CHAT_TEMPLATE_FILE
        if template_file.exists():
            template: str | None = _read_text(template_file, MAX_CONFIG_BYTES)
            template_source = str(template_file)
        else:
            template, template_source = _config_template(config, config_path), str(config_path)
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ModelDirError(f"{config_path}: add_bos_token must be true or false, got {add_bos!r}")
        return cls(tokenizer, template, bos_token=_token_text(config, "bos_token", config_path),
                   eos_token=_token_text(config, "eos_token", config_path), add_bos_token=add_bos,
                   source=template_source if template is not None else str(root), memo_chars=memo_chars)

    # -- the tokenizer ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids are below this (the added tokens included)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The config's eos token's id; None where it names none (or one not in the vocab)."""
        return self._tokenizer.token_to_id(self._eos_token) if self._eos_token is not None else None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids; with add_special_tokens, as the model's tokenizer adds them for a
        plain prompt (its post-processor, and add_bos_token as transformers applies it)."""
        return self._fix_bos(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids,
                             add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """`encode` of each text, in one call of the Rust tokenizer (its threads)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [self._fix_bos(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens skipped (what a completion answers with)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- prompts ------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template applied to (already checked) messages: the prompt's text."""
        if self._template is None:
            raise NoChatTemplateError(
                f"{self._source}: the model has no chat template (no chat_template in "
                f"{TOKENIZER_CONFIG_FILE}, no {CHAT_TEMPLATE_FILE}); chat requests are refused, "
                f"completions (/v1/completions) still work")
        variables: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            variables["tools"] = tools
        if self._bos_token is not None:
            variables["bos_token"] = self._bos_token
        if self._eos_token is not None:
            variables["eos_token"] = self._eos_token
        try:
            return self._template.render(**variables)
        except Exception as exc:  # a template is foreign code: any failure is this request's
            raise ChatRequestError(f"the chat template of {self._source} failed on this request: "
                                   f"{type(exc).__name__}: {_one_line(exc)}") from exc

    def chat_prompt(self, messages: object, tools: object = None) -> ChatPrompt:
        """A chat request's prompt (`messages` as the request has them: role and content, the
        content a string or a list of text parts) and its components (the module's doc)."""
        checked = check_messages(messages)
        checked_tools = _check_tools(tools)
        text = self.render(checked, add_generation_prompt=True, tools=checked_tools)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        tokens = np.array(encoding.ids, dtype=np.int32)
        if not len(tokens):
            raise ChatRequestError(f"the chat template of {self._source} rendered an empty prompt")
        tokens.flags.writeable = False
        components: list[np.ndarray] = []
        start, ids, offsets = 0, encoding.ids, encoding.offsets if self._special_ids else []
        for j in range(last_user_index(checked)):
            prefix_text = self.render(checked[:j + 1], add_generation_prompt=False, tools=checked_tools)
            end = _fast_boundary(text, prefix_text, ids, offsets, self._special_ids)
            if end is None:
                end = _common_prefix(self._prefix_tokens(prefix_text), tokens)
            if end > start:
                components.append(tokens[start:end])
                start = end
        return ChatPrompt(tokens, components)

    def completion_prompt(self, prompt: object) -> ChatPrompt:
        """A /v1/completions prompt: a string is encoded with the special tokens a plain prompt
        gets (as vLLM does for a completion); a list of token ids is taken as it is, each id
        checked to be an int in [0, vocab_size). No components: a plain prompt declares no
        template structure to cut it at, so its shape is the empty one (SPEC §1)."""
        if isinstance(prompt, str):
            ids = self.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list):
            ids = _check_ids(prompt, self.vocab_size)
        else:
            raise TokenArrayError(f"a completion prompt is a string or a list of token ids, got {_show(prompt)}")
        if not ids:
            raise TokenArrayError(f"the completion prompt {_show(prompt)} has no tokens")
        tokens = np.array(ids, dtype=np.int32)
        tokens.flags.writeable = False
        return ChatPrompt(tokens, [])

    # -- inside -------------------------------------------------------------------------

    def _prefix_tokens(self, text: str) -> np.ndarray:
        """tokenize(text) without special tokens, through the bounded memo (LRU by characters)."""
        hit = self._memo.get(text)
        if hit is not None:
            self._memo.move_to_end(text)
            return hit
        ids = np.array(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        if len(text) <= self._memo_limit:
            self._memo[text] = ids
            self._memo_chars += len(text)
            while self._memo_chars > self._memo_limit:
                evicted, _ = self._memo.popitem(last=False)
                self._memo_chars -= len(evicted)
        return ids

    def _bos_rule(self, add_bos_token: bool | None) -> int:
        """+1: prepend bos to a plain prompt; -1: drop the bos the post-processor put first;
        0: the post-processor's output as it is.

        transformers' Llama-style fast tokenizers rebuild the post-processor from
        add_bos_token, so the config's flag wins over tokenizer.json's post-processor."""
        if add_bos_token is None or self._bos_id is None:
            return 0
        probe = "a"  # any text of one ordinary token: only its first special token is looked at
        plain = self._tokenizer.encode(probe, add_special_tokens=False).ids
        special = self._tokenizer.encode(probe, add_special_tokens=True).ids
        adds_bos = len(special) > len(plain) and special[0] == self._bos_id
        if add_bos_token and not adds_bos:
            return 1
        return -1 if adds_bos and not add_bos_token else 0

    def _fix_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens or not self._bos_fix:
            return ids
        if self._bos_fix > 0:
            return [self._bos_id, *ids]  # type: ignore[list-item]
        return ids[1:] if ids and ids[0] == self._bos_id else ids


def check_messages(messages: object) -> list[dict[str, Any]]:
    """A request's messages as the template gets them: a non-empty list of objects with a
    string role and a content that is a string, null, or a list of text parts (joined into
    one string); other fields (name, tool_calls...) pass through. ChatRequestError names the
    message and field."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError(f"messages must be a non-empty list of messages, got {_show(messages)}")
    checked = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatRequestError(f"messages[{k}] must be an object with role and content, got {_show(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatRequestError(f"messages[{k}].role must be a non-empty string, got {_show(role)}")
        content = message.get("content")
        if isinstance(content, list):
            content = _join_parts(content, k)
        elif content is not None and not isinstance(content, str):
            raise ChatRequestError(f"messages[{k}].content must be a string, a list of text parts or "
                                   f"null, got {_show(content)}")
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
                                   f'{{"type": "text", "text": ...}}, got {_show(part)} (only text is supported)')
        texts.append(part["text"])
    return CONTENT_PART_SEPARATOR.join(texts)


def _check_tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ChatRequestError(f"tools must be a list of tool objects, got {_show(tools)}")
    return tools


def _fast_boundary(text: str, prefix_text: str, ids: list[int], offsets: list[tuple[int, int]],
                   special_ids: dict[int, str]) -> int | None:
    """The token count of `prefix_text` read off the whole prompt's tokens, or None where
    that cannot be known without tokenizing it.

    Known when prefix_text is a character prefix of text and ends where a clean special
    token (`_clean_special_tokens`) of the prompt starts or ends: tokenizers split the text
    at added tokens first and tokenize each piece between them alone, so the prefix's
    tokens are then exactly the prompt's tokens before that point."""
    cut = len(prefix_text)
    if cut == len(text):
        return len(ids) if prefix_text == text else None
    if not special_ids or not text.startswith(prefix_text):
        return None
    # Starts do not decrease, and (start, end) >= (cut,) exactly when start >= cut: bisection
    # finds the first token at or after the cut. The index is right even if they did not:
    # what is checked below is that token n itself sits at the cut.
    n = bisect_left(offsets, (cut,))
    if n < len(ids) and offsets[n][0] == cut and _is_special_at(ids[n], offsets[n], text, special_ids):
        return n
    if n > 0 and offsets[n - 1][1] == cut and _is_special_at(ids[n - 1], offsets[n - 1], text, special_ids):
        return n
    return None


def _is_special_at(token: int, span: tuple[int, int], text: str, special_ids: dict[int, str]) -> bool:
    """`token` is a clean special token and its span is its own text (so the offsets are true)."""
    content = special_ids.get(token)
    return content is not None and text[span[0]:span[1]] == content


def _clean_special_tokens(tokenizer: Tokenizer) -> dict[int, str]:
    """id -> text of the added tokens the fast path may cut beside: matched before
    normalization (normalized=False) and eating no whitespace around them (no lstrip, rstrip,
    single_word), so the text on either side is tokenized exactly as it would be alone."""
    return {token_id: added.content for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if not (added.normalized or added.lstrip or added.rstrip or added.single_word)}


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _check_ids(prompt: list, vocab_size: int) -> list[int]:
    """A list of token ids (ints, not bools) in [0, vocab_size), or TokenArrayError naming the
    first bad one."""
    if not prompt:
        return prompt
    # Types checked in C and the range in numpy; only a bad list is walked for its first bad id
    # (an int beyond int64 makes an object array, and is walked too).
    if set(map(type, prompt)) == {int}:
        array = np.array(prompt)
        if array.dtype == np.int64 and array.min() >= 0 and array.max() < vocab_size:
            return prompt
    index, token = next((k, t) for k, t in enumerate(prompt)
                        if type(t) is not int or not 0 <= t < vocab_size)
    raise TokenArrayError(f"prompt[{index}]: token id {_show(token)} is not an integer in [0, {vocab_size}) "
                          f"(the model's vocabulary)")


def _compile(template: str, source: str) -> Template:
    """The template compiled as transformers compiles chat templates, or ModelDirError."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML: a prompt wants the JSON as it is.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # NOTE: transformers also defines strftime_now (today's date). Left out on purpose: a
    # prompt must be a function of its request alone, or a job resumed tomorrow makes other
    # tokens and shapes for the same requests; templates that use it test `is defined`.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelDirError(f"{source}: the chat template does not compile: line {exc.lineno}: {exc.message}") from exc


def _config_template(config: dict, path: Path) -> str | None:
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
            raise ModelDirError(f"{path}: chat_template {DEFAULT_TEMPLATE_NAME!r} must be a string, got {_show(chosen)}")
        return chosen
    raise ModelDirError(f"{path}: chat_template must be a string or a list of {{name, template}} objects, "
                        f"got {_show(template)}")


def _token_text(config: dict, key: str, path: Path) -> str | None:
    """A special token of the config: a string, {"content": ...} (as transformers writes an
    AddedToken), or null."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelDirError(f"{path}: {key} must be a string or an object with a string content, "
                            f"got {_show(config.get(key))}")
    return value


def _check_regular(path: Path, limit_bytes: int) -> None:
    """`path` is a readable regular file of at most `limit_bytes`, or ModelDirError."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ModelDirError(f"{path}: missing (a model directory needs {TOKENIZER_FILE} and "
                            f"{TOKENIZER_CONFIG_FILE})") from None
    except OSError as exc:
        raise ModelDirError(f"{path}: cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ModelDirError(f"{path}: not a regular file")
    if info.st_size > limit_bytes:
        raise ModelDirError(f"{path}: {info.st_size:,} bytes, more than the {limit_bytes:,} a model file may have")


def _read_text(path: Path, limit_bytes: int) -> str:
    """A small UTF-8 file's text (bounded: read at most limit+1 bytes), or ModelDirError."""
    _check_regular(path, limit_bytes)
    try:
        with open(path, "rb") as file:
            data = file.read(limit_bytes + 1)
    except OSError as exc:
        raise ModelDirError(f"{path}: cannot be read ({exc.strerror})") from exc
    if len(data) > limit_bytes:
        raise ModelDirError(f"{path}: more than the {limit_bytes:,} bytes a model file may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"{path}: not UTF-8 text (byte {exc.start})") from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _show(value: object) -> str:
    """A value for an error message: its type and a bounded repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
