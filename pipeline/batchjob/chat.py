"""A model directory's tokenizer and chat template: requests in, token ids and shapes out.

    tokenizer = ChatTokenizer.load("models/llama")         # tokenizer.json + tokenizer_config.json
    prompt = tokenizer.chat_prompt(request["messages"])      # ChatPrompt(tokens, components)
    prompt = tokenizer.completion_prompt("Once upon a time")  # components: none

A chat prompt is rendered the way transformers' `apply_chat_template` renders it (Jinja in an
immutable sandbox: `template.py`) and tokenized without adding special tokens again: the
template writes bos itself, as vLLM's chat endpoint does. Nothing here imports transformers.

Components (SPEC §1: the cacheable prefix parts, back to back a prefix of the tokens): one
per message before the last user message (the system prompt, a tool schema or few-shot
turns, earlier turns of a conversation), at most MAX_COMPONENTS (`prefixes.py`). The boundary
after message j is where the template rendered with messages[:j+1] and no generation prompt
ends, as tokens: the longest common token prefix of that render's tokens and the whole
prompt's. Where the tokenizer merges across the message boundary the boundary so moves back
to the last token both share; a boundary that does not advance past the previous one is
dropped (components are never empty). Turn k+1 of a conversation then starts with turn k's
components, so the broker's shape chains see the conversation grow.

Prefix renders and their tokens are kept in a bounded memo (`prefixes.py`), so a shape's
prefix is rendered and tokenized by its first two requests in a producer, not by every one
(a prefix is kept from its second sight). A request renders
its whole prompt; where that starts with its last prefix render P and the tokenizer cuts
there before anything else (beside an added token such as ChatML's <|im_start|> or Llama 3's
<|eot_id|>: `splits.py`), only the rest is tokenized, and the prompt's tokens are P's and the
rest's: exactly those of tokenizing the whole prompt. Elsewhere (templates that delimit
messages with plain text, where the tokenizer may merge across the boundary) the whole prompt
is tokenized. tests/batchjob/test_chat.py checks both against the plain way on several
tokenizer families.

The template is foreign code, compiled so that nothing of it runs at load and rendered per
request: whatever it raises, like whatever the tokenizer raises (a lone surrogate, which JSON
allows and UTF-8 does not, among them), is that request's ChatRequestError. Bounds on its
time and memory are the producer supervisor's.

NOTE: reading every boundary off the prompt's token offsets (a token boundary at the cut) was
rejected: it is wrong where a prefix render ends in whitespace that merges alone but is split
inside the prompt (" \n" before a letter: the pre-tokenizer's whitespace rule looks ahead),
and the property test finds that case.
A rest is tokenized without offsets (`encode_batch_fast` of one text: the same ids) where the
process runs the tokenizer on its own thread (`one_thread`, a producer): 23 us against 33 us
for `encode` on the 43-token rests of `pipeline bench job-scale`'s requests.
NOTE: tokenizing the rests of a group of requests in one `encode_batch` was rejected: two
processes at once on this machine's 2 cores made 0.87-1.02 M tokens per CPU second that way,
0.90-1.05 M one `encode` at a time (`encode_batch_fast`, no offsets: 0.95-1.09 M; bench_tokenize).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.batchjob.messages import check_messages, check_tools, last_user_index
from pipeline.batchjob.modelfiles import check_model_file, config_template, config_token_text, read_model_text
from pipeline.batchjob.prefixes import MEMO_BYTES, PrefixEntry, PrefixMemo
from pipeline.batchjob.splits import AddedTokenSplits, Spans
from pipeline.batchjob.scan import show
from pipeline.batchjob.template import compile_chat_template
from pipeline.producer.signature import signature as shape_signature
from pipeline.wire.errors import (
    BadInputError,
    ChatRequestError,
    ModelDirError,
    NoChatTemplateError,
    TokenArrayError,
)

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Encoding, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Newer transformers saves the template beside the config; when present it wins over the
# config's `chat_template`, as transformers loads it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Largest tokenizer.json read: real ones are 2-35 MB (Gemma's is the largest seen); the cap
# only stops a file linked to a device or a torn multi-GB file from filling memory.
MAX_TOKENIZER_BYTES = 256 << 20
# Largest tokenizer_config.json or chat_template.jinja read (real configs are < 1 MB, with
# their added_tokens_decoder tables).
MAX_CONFIG_BYTES = 16 << 20
_NEEDS = f"a model directory needs {TOKENIZER_FILE} and {TOKENIZER_CONFIG_FILE}"
# A Rust panic inside the tokenizer reaches Python as pyo3's PanicException, a BaseException
# (not an Exception) that no module exports: it is known by its name.
RUST_PANIC = "PanicException"

# The Rust tokenizer's peak memory per byte of text (1.88 GiB for 12 MiB, the tiny model's
# BPE): past a memory limit it aborts (SIGABRT), so a text needing more is refused first.
TOKENIZE_BYTES_PER_TEXT_BYTE = 160

# Builds the typed error of a tokenizer failure: (the exception, the text tokenized).
OnTokenizerError = Callable[[BaseException, str], BadInputError]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """One request's prompt: `tokens` (int32, read-only) and its `components`, read-only
    views of `tokens` that back to back are its first `prefix_len` tokens; `signature`,
    their shape signature where its prefix already knew it (None: not computed here)."""

    tokens: np.ndarray
    components: list[np.ndarray]
    signature: int | None = None

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
    memo of prefix renders; make one per thread. `load` reads files; everything else is pure
    computation.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool | None = None, source: str = "<memory>",
                 memo_bytes: int = MEMO_BYTES) -> None:
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
        self._splits = AddedTokenSplits(tokenizer)
        self._memo = PrefixMemo(memo_bytes)
        # Chat prompts whose rest alone was tokenized after a kept prefix, and those tokenized whole.
        self.rests_tokenized = self.prompts_tokenized = 0
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        self._bos_fix = self._bos_rule(add_bos_token)
        self.max_text_bytes: int | None = None  # longest text tokenized; a producer's from its memory limit
        self._without_offsets = False  # (`one_thread`)

    @classmethod
    def load(cls, model_dir: str | Path, *, memo_bytes: int = MEMO_BYTES,
             chat_template: str | None = None) -> ChatTokenizer:
        """MODEL_DIR/tokenizer.json and tokenizer_config.json (its chat template, or `chat_template`
        over it as vLLM's --chat-template; bos and eos tokens, add_bos_token), or ModelDirError naming
        the path. Without a chat template it loads: chat requests are refused (NoChatTemplateError)."""
        from tokenizers import Tokenizer

        root = Path(model_dir)
        if not root.is_dir():
            raise ModelDirError(f"{root}: not a model directory (expected {TOKENIZER_FILE} and "
                                f"{TOKENIZER_CONFIG_FILE} in it)")
        tokenizer_path = root / TOKENIZER_FILE
        check_model_file(tokenizer_path, MAX_TOKENIZER_BYTES, _NEEDS)
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises plain Exception for every parse error
            raise ModelDirError(f"{tokenizer_path}: not a tokenizer file ({_one_line(exc)})") from exc
        config_path = root / TOKENIZER_CONFIG_FILE
        try:
            config = json.loads(read_model_text(config_path, MAX_CONFIG_BYTES, _NEEDS))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelDirError(f"{config_path}: not valid JSON ({_one_line(exc)})") from exc
        if not isinstance(config, dict):
            raise ModelDirError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        template_file = root / CHAT_TEMPLATE_FILE
        if chat_template is not None:
            template, template_source = chat_template, "--chat-template"
        elif template_file.exists():
            template = read_model_text(template_file, MAX_CONFIG_BYTES, _NEEDS)
            template_source = str(template_file)
        else:
            template, template_source = config_template(config, config_path), str(config_path)
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ModelDirError(f"{config_path}: add_bos_token must be true or false, got {add_bos!r}")
        return cls(tokenizer, template, bos_token=config_token_text(config, "bos_token", config_path),
                   eos_token=config_token_text(config, "eos_token", config_path), add_bos_token=add_bos,
                   source=template_source if template is not None else str(root), memo_bytes=memo_bytes)

    # -- the tokenizer ------------------------------------------------------------------

    def one_thread(self) -> None:
        """This process tokenizes on its own thread, as a producer among a job's processes
        does (the tokenizer's thread pool would take the cores the others use): rests are
        then tokenized without offsets, which the library does only through its batch call,
        whose pool this turns off for the process (TOKENIZERS_PARALLELISM, read at each call)."""
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self._without_offsets = True

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
        plain prompt (its post-processor, and add_bos_token as transformers applies it).
        TokenArrayError where the tokenizer fails on it (a lone surrogate, named)."""
        encoding = self._tokenize(text, _text_error, add_special_tokens=add_special_tokens)
        return self._fix_bos(encoding.ids, add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """`encode` of each text, in one call of the Rust tokenizer (its threads)."""
        for text in texts:
            self._check_size(text)
        try:
            encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except BaseException as exc:
            if not foreign_failure(exc):
                raise
            return [self.encode(text, add_special_tokens) for text in texts]  # the failing one's own error
        return [self._fix_bos(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens skipped (what a completion answers with)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text, a special token's too (a logprob's token, as vLLM decodes it)."""
        return self._tokenizer.decode([token], skip_special_tokens=False)

    # -- prompts ------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None, template_kwargs: Mapping[str, Any] | None = None
               ) -> str:
        """The chat template applied to (already checked) messages: the prompt's text;
        `template_kwargs` are variables beneath the renderer's own, as vLLM merges them."""
        if self._template is None:
            raise NoChatTemplateError(
                f"{self._source}: the model has no chat template (no chat_template in "
                f"{TOKENIZER_CONFIG_FILE}, no {CHAT_TEMPLATE_FILE}); chat requests are refused, "
                f"completions (/v1/completions) still work")
        variables: dict[str, Any] = dict(template_kwargs or {})
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
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
                                   f"{_describe(exc)}") from exc

    def chat_prompt(self, messages: object, tools: object = None, template_kwargs: object = None) -> ChatPrompt:
        """A chat request's prompt (`messages` as the request's JSON has them: role and
        content, the content a string or a list of text parts; tools and chat_template_kwargs
        for the template) and its components (the module's doc). ChatRequestError for
        anything about the request that makes no prompt."""
        checked, checked_tools = check_messages(messages), check_tools(tools)
        kwargs = dict(template_kwargs) if isinstance(template_kwargs, dict) and template_kwargs else None
        text = self.render(checked, add_generation_prompt=True, tools=checked_tools, template_kwargs=kwargs)
        fail = partial(_chat_text_error, checked, checked_tools, text)
        render_prefix = partial(self.render, add_generation_prompt=False, tools=checked_tools, template_kwargs=kwargs)
        # The memo keys a prefix by what the template saw: the tools, and the kwargs where given.
        seen = checked_tools if kwargs is None else {"tools": checked_tools, "chat_template_kwargs": kwargs}
        ladder = self._memo.ladder(checked, seen, last_user_index(checked), render_prefix)
        tokens = self._after_prefix(text, ladder[-1], fail) if ladder else None
        exact_rest = tokens is not None
        ids: list[int] | None = None
        encoding: Encoding | None = None
        if tokens is None:
            self.prompts_tokenized += 1
            encoding = self._tokenize(text, fail)
            ids = encoding.ids  # each read builds a list: once
            tokens = np.array(ids, dtype=np.int32)
        if not len(tokens):
            raise ChatRequestError(f"the chat template of {self._source} rendered an empty prompt")
        tokens.flags.writeable = False
        if ladder:
            self._learn(ladder, text, tokens, ids, encoding, fail)
        components = self._components(tokens, ladder, exact_rest)
        return ChatPrompt(tokens, components, self._known_signature(ladder, exact_rest, components))

    def completion_prompt(self, prompt: object, what: str = "the completion prompt",
                          param: str = "prompt") -> ChatPrompt:
        """A /v1/completions prompt (or another plain text, an embeddings input: `what` it is,
        the request's `param` holding it, for messages): a string is encoded with the special
        tokens a plain prompt gets (as vLLM does for a completion); a list of token ids is taken
        as it is, each id checked to be an int in [0, vocab_size). No components: a plain prompt
        declares no template structure to cut it at, so its shape is the empty one (SPEC §1)."""
        if isinstance(prompt, str):
            fail = partial(_text_error, what=what)
            encoding = self._tokenize(prompt, fail, add_special_tokens=True)
            ids = self._fix_bos(encoding.ids, True)
        elif isinstance(prompt, list):
            ids = _check_ids(prompt, self.vocab_size, param)
        else:
            raise TokenArrayError(f"{param} is a string or a list of token ids, got {show(prompt)}")
        if not ids:
            raise TokenArrayError(f"{what} has no tokens, got {show(prompt)}")
        tokens = np.array(ids, dtype=np.int32)
        tokens.flags.writeable = False
        return ChatPrompt(tokens, [])

    # -- inside -------------------------------------------------------------------------

    def _learn(self, ladder: list[PrefixEntry], text: str, tokens: np.ndarray, ids: list[int] | None,
               spans: Spans | None, fail: OnTokenizerError) -> None:
        """Fill in what the ladder's entries do not know yet: their token ids, and the last
        one's split where the memo keeps it (only a later prompt reads a split, and an entry
        the memo does not keep serves this prompt alone). Read off the whole prompt's encoding
        (`ids`, `spans`, when it was tokenized whole) where its first pass cuts at the entry's
        end, else tokenized alone: once per entry while it stays in the memo."""
        last = ladder[-1]
        learned = []
        for entry in ladder:
            wants_split = entry is last and entry.key is not None and not entry.split_known
            if entry.ids is not None and not wants_split:
                continue
            n = None if ids is None or spans is None else self._splits.read_off(text, entry.text, ids, spans)
            if n is None:
                encoding = self._tokenize(entry.text, fail)
                own_ids, own_spans, n = encoding.ids, encoding, len(encoding)
                entry.ids = entry.ids if entry.ids is not None else _frozen(own_ids)
            else:
                own_ids, own_spans = ids, spans  # type: ignore[assignment]
                if entry.ids is None:  # a kept entry holds a copy: no other prompt's memory
                    entry.ids = tokens[:n] if entry.key is None else tokens[:n].copy()
                    entry.ids.flags.writeable = False
            if wants_split:
                entry.split = self._splits.prefix_split(entry.text, n, own_ids, own_spans)
                entry.split_known = True
            if entry.key is not None:
                learned.append(entry)
        self._memo.resize(learned)

    def _after_prefix(self, text: str, last: PrefixEntry, fail: OnTokenizerError) -> np.ndarray | None:
        """The prompt's tokens from its last prefix's and its rest's alone, where that is
        exact (`splits.py`); None where the whole prompt must be tokenized."""
        if last.split is None or not text.startswith(last.text):
            return None
        assert last.ids is not None
        rest = text[len(last.text):]
        if not self._splits.rest_is_exact(last.split, rest):
            return None
        tail = self._splits.drop_lead(self._rest_ids(self._splits.lead + rest, fail))
        if tail is None:
            return None
        self.rests_tokenized += 1
        return np.concatenate((last.ids, np.array(tail, dtype=np.int32)))

    def _components(self, tokens: np.ndarray, ladder: list[PrefixEntry], exact_rest: bool) -> list[np.ndarray]:
        """The advancing prefix ends as views of `tokens`. With an exact rest every prompt of
        the last prefix starts with its tokens, so its ends are kept with it (each entry's
        tokens are no longer than the last's: else they would reach into the rest)."""
        if not ladder:
            return []
        last = ladder[-1]
        ends = last.ends if exact_rest else None
        if ends is None:
            ends = _advancing_ends(tokens, ladder)
            if exact_rest and all(len(e.ids) <= len(last.ids) for e in ladder):  # type: ignore[arg-type]
                last.ends = ends
                self._memo.resize([last])
        return [tokens[a:b] for a, b in zip((0, *ends), ends)]

    def _known_signature(self, ladder: list[PrefixEntry], exact_rest: bool, components: list[np.ndarray]
                         ) -> int | None:
        """The components' shape signature, kept with the last prefix where every prompt of
        it has these components (an exact rest and the ends kept with it): hashed once per
        prefix rather than once per request."""
        if not exact_rest or not ladder or ladder[-1].ends is None:
            return None
        last = ladder[-1]
        if last.signature is None:
            last.signature = int(shape_signature(components))
        return last.signature

    def _check_size(self, text: str) -> None:
        """BadInputError for a text past `max_text_bytes` (its memory to tokenize, stated)."""
        limit = self.max_text_bytes
        size = 0 if limit is None or len(text) <= limit // 4 else len(text.encode("utf-8", "surrogatepass"))
        if limit is not None and size > limit:  # (4 bytes a character at most: short texts are not counted)
            need = size * TOKENIZE_BYTES_PER_TEXT_BYTE
            raise BadInputError(f"the prompt's text is {size:,} bytes: tokenizing it takes about {need >> 20:,} MiB, "
                                f"more than the {limit * TOKENIZE_BYTES_PER_TEXT_BYTE >> 20:,} MiB memory limit of "
                                f"the chat template and tokenizer (--prompt-memory-limit-mb); no context holds a "
                                f"prompt this long")

    def _tokenize(self, text: str, fail: OnTokenizerError, *, add_special_tokens: bool = False,
                  offsets: bool = True) -> Encoding:
        """The tokenizer's encoding of `text` (without offsets: `encode_batch_fast` of it alone,
        the same ids); whatever it raises is `fail`'s typed error."""
        self._check_size(text)
        try:
            if offsets:
                return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        except BaseException as exc:
            if not foreign_failure(exc):
                raise
            raise fail(exc, text) from exc

    def _rest_ids(self, text: str, fail: OnTokenizerError) -> list[int]:
        """`text`'s token ids (special tokens not added), without offsets where `one_thread`."""
        return self._tokenize(text, fail, offsets=not self._without_offsets).ids

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


def _advancing_ends(tokens: np.ndarray, ladder: list[PrefixEntry]) -> tuple[int, ...]:
    """Each prefix's end in `tokens` (its longest common token prefix with them), those that
    do not advance past the previous one dropped."""
    ends: list[int] = []
    prompt = tokens.tobytes()
    for entry in ladder:
        assert entry.ids is not None
        if prompt.startswith(entry.ids.tobytes()):  # the usual case, in a memcmp
            end = len(entry.ids)
        else:
            n = min(len(entry.ids), len(tokens))
            differ = np.flatnonzero(entry.ids[:n] != tokens[:n])
            end = int(differ[0]) if len(differ) else n
        if end > (ends[-1] if ends else 0):
            ends.append(end)
    return tuple(ends)


def _frozen(ids: Sequence[int]) -> np.ndarray:
    array = np.array(ids, dtype=np.int32)
    array.flags.writeable = False
    return array


def foreign_failure(exc: BaseException) -> bool:
    """A failure of foreign code (every Exception, and a Rust panic), not an interrupt or exit."""
    return isinstance(exc, Exception) or type(exc).__name__ == RUST_PANIC


def _chat_text_error(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: str,
                     exc: BaseException, text: str) -> ChatRequestError:
    """A tokenizer failure on a chat request: the field holding a lone surrogate where one
    does, else where the rendered text does, else the tokenizer's own message."""
    try:
        found = _surrogate_in(messages, "messages") or _surrogate_in(tools, "tools")
    except RecursionError:  # nested deeper than Python walks: the rendered text is named
        found = None
    found = found or _surrogate_in(prompt, "the rendered prompt") or _surrogate_in(text, "a prefix render")
    return ChatRequestError(found or f"the tokenizer failed on this request's prompt: {_describe(exc)}")


def _text_error(exc: BaseException, text: str, what: str = "the text") -> TokenArrayError:
    """A tokenizer failure on a plain text (a completion prompt)."""
    return TokenArrayError(_surrogate_in(text, what) or f"the tokenizer failed on {what}: {_describe(exc)}")


def _surrogate_in(value: object, path: str) -> str | None:
    """Where a request's JSON value holds a lone surrogate (the one thing a str holds that
    UTF-8 cannot), as an error message. For errors only: it walks the whole value."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{path} has a lone surrogate U+{ord(value[exc.start]):04X} at character {exc.start}: "
                    f"not Unicode text (JSON allows the escape, UTF-8 and the tokenizer do not)")
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = (_surrogate_in(key, f"{path} (a key)") if isinstance(key, str) else None) or \
            _surrogate_in(item, f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]")
        if found:
            return found
    return None


def _check_ids(prompt: list, vocab_size: int, param: str) -> list[int]:
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
    raise TokenArrayError(f"{param}[{index}] is {show(token)}: a token id is an integer in [0, {vocab_size}) "
                          f"(the model's vocabulary)")


def _compile(template: str, source: str) -> Template:
    """`template.py`'s compiled template, or ModelDirError."""
    from jinja2 import TemplateSyntaxError

    try:
        return compile_chat_template(template)
    except TemplateSyntaxError as exc:
        raise ModelDirError(f"{source}: the chat template does not compile: line {exc.lineno}: {exc.message}") from exc
    except Exception as exc:  # foreign text: the parser's RecursionError, MemoryError...
        raise ModelDirError(f"{source}: the chat template does not compile: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    """An exception's type and one-line message (MemoryError and the like carry none)."""
    message = _one_line(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
