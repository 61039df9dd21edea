"""A chat request's prefix renders: which of them bound its components, and a bounded memo
so that a producer renders and tokenizes each shared one at most twice, not once a request.

A request's components end where the chat template rendered with messages[:j+1] and no
generation prompt ends, for messages j before its last user message (chat.py). Only
MAX_COMPONENTS of them are used: the first MAX_COMPONENTS - 1 messages' and the last one's.
The work of a request is then linear in its length, and turn k+1 of a long conversation
still starts with turn k's first components.

The memo holds prefix renders keyed by exactly what the template saw: an entry is found by
its parent entry (the previous boundary's) and the JSON text of the messages between the
two (the first also holds the tools), so a request finds all its prefixes with one
dictionary look-up each, and two requests share an entry exactly when they share those
messages and tools. Requests of one shape (a system prompt and a few-shot block) find the
same entries; a conversation's turn k+1 finds turn k's. Least recently used entries go
first, and an entry is always used no later than its parent, so a parent outlives its
children (an entry whose parent is gone could never be found again).

A prefix is kept from its second sight: the first only records a hash of the messages up to
it (SEEN_PREFIXES of them), so a prefix no other request shares (a request's own system
prompt, a conversation's history) is never kept, and the first two requests of a shape
render and tokenize its prefix, the others none. NOTE: keeping every prefix from its first
sight was rejected: on conversations that share nothing (tools/bench_tokenize.py's
14-message ones) the churn of kept and evicted renders made the tokenizer and the template
10-15% slower (encode 0.92 ms a prompt against 0.84 with nothing kept), for one prefix
render and tokenization saved per shape.

    memo = PrefixMemo()
    ladder = memo.ladder(messages, tools, last_user, render=lambda prefix: template(prefix))
    ladder[-1].text  # the render of messages[:last_user]
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from pipeline.batchjob.splits import PrefixSplit
from pipeline.wire.layouts.frames import MAX_CHAIN_DEPTH

# Components a chat prompt is cut into at most: a shape's chain of prefix signatures has one
# level per component, and the broker keeps MAX_CHAIN_DEPTH levels (a deeper chain loses its
# middle levels in the producer); more components would cost prefix renders and nothing else.
MAX_COMPONENTS = MAX_CHAIN_DEPTH
# Bytes of prefix renders (their text, token ids and keys) one memo keeps: a producer's shared
# system prompts, tool schemas and few-shot blocks (tens of KB each) fit by the thousand.
MEMO_BYTES = 64 << 20
# What an entry costs beyond its text, ids, key text and ends: the entry, its dictionary
# slot, the key tuple, the ids array's header and its split (tracemalloc: about 400 bytes).
ENTRY_OVERHEAD_BYTES = 400
# Prefixes seen once that the memo remembers, as hashes, to keep them when seen again (about
# 140 bytes each, 2.3 MB in all): a shape whose requests come within 16,384 new prefixes of
# each other is kept; one spread wider is rendered and tokenized once more.
SEEN_PREFIXES = 1 << 14
# The parent of a request's first prefix.
ROOT_UID = 0

Key = tuple[int, bytes]
# A key's JSON text: msgspec's where it reads back as the value (1.9 us with the read for a
# system prompt of 500 characters, json's 4.2 us); json's otherwise, after a byte msgspec
# never starts with (msgspec writes NaN as null, a set as an array, bytes as base64 text).
_KEY_JSON = msgspec.json.Encoder()
_KEY_READ = msgspec.json.Decoder()
_JSON = json.JSONEncoder(ensure_ascii=False)
_JSON_MARK = b"\x00"


@dataclass(slots=True, eq=False)
class PrefixEntry:
    """One prefix render: its text, and what chat.py learns about it (filled in once)."""

    uid: int
    key: Key | None  # None: not in the memo (seen once, too big, or messages with no JSON text)
    text: str
    chain: int  # a hash of the messages up to it: its identity whatever its parent's uid
    ids: np.ndarray | None = None  # tokenize(text), int32, read-only
    split_known: bool = False  # `split` is set (it is used when the entry is a request's last prefix)
    split: PrefixSplit | None = None  # where what follows it may be tokenized alone (`splits.py`)
    ends: tuple[int, ...] | None = None  # component ends when it is a request's last prefix and the rest is exact
    signature: int | None = None  # the shape signature of those components, once known (`chat.py`)
    size_bytes: int = 0

    def measure(self) -> int:
        key = sys.getsizeof(self.key[1]) if self.key is not None else 0
        ids = self.ids.nbytes if self.ids is not None else 0
        ends = sys.getsizeof(self.ends) if self.ends is not None else 0
        return sys.getsizeof(self.text) + key + ids + ends + ENTRY_OVERHEAD_BYTES


def boundary_indices(last_user: int) -> list[int]:
    """The messages j whose prefix render may end a component, for a request whose last user
    message is `last_user` (-1: none, so no components)."""
    if last_user <= MAX_COMPONENTS:
        return list(range(max(last_user, 0)))
    return [*range(MAX_COMPONENTS - 1), last_user - 1]


class PrefixMemo:
    """Prefix renders by parent and messages, least recently used evicted past `limit_bytes`.

    Owner: one ChatTokenizer (one producer process). Pure: `render` is the only foreign code."""

    def __init__(self, limit_bytes: int = MEMO_BYTES) -> None:
        self._entries: OrderedDict[Key, PrefixEntry] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()  # chains seen once, oldest first
        self._limit = limit_bytes
        self._bytes = 0
        self._last_uid = ROOT_UID
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def ladder(self, messages: Sequence[Any], tools: Any, last_user: int,
               render: Callable[[Sequence[Any]], str]) -> list[PrefixEntry]:
        """The entries of the request's boundaries (`boundary_indices`), rendering
        messages[:j+1] with `render` for those not kept; [] without a user message."""
        ladder: list[PrefixEntry] = []
        parent, start, chain, kept = ROOT_UID, 0, 0, True
        for j in boundary_indices(last_user):
            key = _key(parent, messages, start, j + 1, tools) if chain is not None else None
            entry = self._entries.get(key) if key is not None and kept else None
            if entry is None:
                self.misses += 1
                self._last_uid += 1
                chain = None if key is None else hash((chain, key[1]))
                entry = PrefixEntry(self._last_uid, None, render(messages[:j + 1]), chain or 0)
                entry.size_bytes = entry.measure()
                if self._admit(chain, kept) and entry.size_bytes <= self._limit:
                    entry.key = key
                kept = entry.key is not None  # the children of an entry not kept cannot be
            else:
                self.hits += 1
                chain = entry.chain
            ladder.append(entry)
            parent, start = entry.uid, j + 1
        for entry in reversed(ladder):  # kept, parents last: more recent than their children
            if entry.key is None:
                continue
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
            else:
                self._entries[entry.key] = entry
                self._bytes += entry.size_bytes
        self._evict()  # only now: evicting while walking could drop a parent of this walk
        return ladder

    def resize(self, entries: Sequence[PrefixEntry]) -> None:
        """Account for what was filled into `entries` since they were added."""
        for entry in entries:
            size = entry.measure()
            if entry.key is not None and self._entries.get(entry.key) is entry:
                self._bytes += size - entry.size_bytes
            entry.size_bytes = size
        self._evict()

    def check_invariants(self) -> None:
        assert self._bytes == sum(e.size_bytes for e in self._entries.values()), self._bytes
        assert self._bytes <= self._limit, (self._bytes, self._limit)
        assert all(key == entry.key for key, entry in self._entries.items())
        assert len({e.uid for e in self._entries.values()}) == len(self._entries)
        assert all(ROOT_UID < e.uid <= self._last_uid for e in self._entries.values())
        assert len(self._seen) <= SEEN_PREFIXES

    def _admit(self, chain: int | None, parent_kept: bool) -> bool:
        """Whether a prefix not in the memo is kept now: at its second sight, under a kept
        parent (and its messages have a JSON text). The first sight is recorded."""
        if chain is None:
            return False
        if chain in self._seen:
            if parent_kept:
                del self._seen[chain]
            return parent_kept
        self._seen[chain] = None
        if len(self._seen) > SEEN_PREFIXES:
            self._seen.popitem(last=False)
        return False

    def _evict(self) -> None:
        while self._bytes > self._limit:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size_bytes


def _key(parent: int, messages: Sequence[Any], start: int, end: int, tools: Any) -> Key | None:
    """(parent uid, the JSON text of messages[start:end], with the tools for a first prefix):
    exact for JSON values, which is what a request holds. None for values JSON cannot write."""
    # One message (an object) or several (a list) after a parent: never the same text.
    value = [tools, messages[start:end]] if parent == ROOT_UID else \
        messages[start] if end == start + 1 else messages[start:end]
    try:
        return parent, _json_text(value)
    except (TypeError, ValueError, RecursionError):
        return None


def _json_text(value: Any) -> bytes:
    """`value`'s JSON text (the module's _KEY_JSON); TypeError or ValueError where JSON
    cannot write it."""
    try:
        text = _KEY_JSON.encode(value)
        if _KEY_READ.decode(text) == value:
            return text
    except (msgspec.MsgspecError, ValueError):  # a lone surrogate: json writes it
        pass
    return _JSON_MARK + _JSON.encode(value).encode("utf-8", "surrogatepass")
