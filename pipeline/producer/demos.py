"""Generated workloads by name: "demo" (`demo_workload`: DEMO_SHAPES templates), "demo-chat", the
multi-turn one defined here, "demo-template", the many-template one defined here, and
`named_workload`, which resolves a name or a file path the way `pipeline launch` and
`pipeline tools analyze` take them.

demo-chat: conversations of one to DEMO_CHAT_MAX_TURNS turns under DEMO_CHAT_SYSTEMS system
prompts. Turn 1's prompt is the system prompt plus a user message; turn k+1's is turn k's
prompt plus the reply to it plus a new user message, so each turn's prompt extends the one
before, token for token. Components (the cacheable prefix that names the shape): the system
prompt, then one component per earlier turn (its user message and reply), so turn k+1's
components are turn k's plus one: shapes chain. The suffix is the new user message.

Items are in arrival order: conversations start as Poisson arrivals and each waits a
log-normal think time between turns, so turns of many conversations interleave, as real
chat traffic does, and a conversation's turn k+1 always arrives after its turn k. Each item
carries its arrival time (timestamp_ms, from 0) and the payload "chat-C-T" (conversation C,
turn T from 1). Pure code; everything follows from (items, seed, vocab_size).

demo-template: DEMO_TEMPLATE_SHAPES templates with Zipf popularity, each two components of
1,000 to 8,000 tokens (log-uniform): a system prompt shared by the DEMO_TEMPLATE_GROUP
templates of its group, then a document of the template's own; the suffix is a log-normal
user part. Templates of one group share their first component, so the order in which shapes
are drained decides how often the long system prompts are recomputed. Poisson arrivals
(timestamp_ms), payload "template-T-K" (template T, item K).

NOTE: this lives beside workload.py, not in it, because workload.py is already past the
house limit of ~600 lines; it uses workload.py's token streams and Workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.producer.signature import signature as shape_signature
from pipeline.producer.workload import VOCAB_SIZE, WorkItem, Workload, check_vocab_size, hashed_tokens, load_workload

# Seeds of the demo's token streams (beside workload.py's BLOCK_STREAM and FILL_STREAM, one per
# use, so that equal numeric ids still get unrelated tokens).
DEMO_PREFIX_STREAM = 0x6465_6D6F_7072_6566  # "demopref"
DEMO_SUFFIX_STREAM = 0x6465_6D6F_7375_6666  # "demosuff"
# Largest demo seed: it is mixed into 64-bit token streams.
MAX_DEMO_SEED = (1 << 63) - 1
# The embedded demo workload. 16 shapes: several per consumer, so shape selection and sticky
# draining have work to do, yet each shape gets many items in a short demo.
DEMO_SHAPES = 16
# System prompts, log-uniform from a one-line instruction to a long policy prompt.
DEMO_SYSTEM_MIN_TOKENS = 32
DEMO_SYSTEM_MAX_TOKENS = 1024
# Half the templates add a few-shot block of a few examples.
DEMO_FEWSHOT_SHARE = 0.5
DEMO_FEWSHOT_MIN_TOKENS = 64
DEMO_FEWSHOT_MAX_TOKENS = 1024
# Shape popularity ~ 1 / rank^1.1 (Zipf): a few hot templates and a long tail, as in real
# jobs; with 16 shapes the top one gets a third of the items and the rarest 1.6%.
DEMO_ZIPF_EXPONENT = 1.1
# User parts: log-normal, median 200 tokens (a chat turn), sigma 0.8 (90% of them between
# ~55 and ~750 tokens), so lanes see a realistic spread of lengths.
DEMO_SUFFIX_MEDIAN_TOKENS = 200
DEMO_SUFFIX_SIGMA = 0.8
# Cap on a user part: the log-normal's far tail would otherwise add rare very long prompts
# that dominate a short demo's padding figures.
DEMO_SUFFIX_MAX_TOKENS = 4096

# The names a workload argument may give instead of a file.
DEMO = "demo"
DEMO_CHAT = "demo-chat"
DEMO_TEMPLATE = "demo-template"
GENERATED = (DEMO, DEMO_CHAT, DEMO_TEMPLATE)

# A few system prompts (assistants): the one prefix every conversation under it shares.
DEMO_CHAT_SYSTEMS = 4
# Turns per conversation, uniform in [1, 8]: most chat sessions are short, a few long
# enough that a prompt carries several earlier turns (mean 4.5).
DEMO_CHAT_MAX_TURNS = 8
# User messages: log-normal, median 64 tokens (a question), sigma 0.8 (90% ~17 to ~240).
DEMO_CHAT_USER_MEDIAN_TOKENS = 64
DEMO_CHAT_USER_SIGMA = 0.8
# Replies: log-normal, median 256 tokens (an answer of a few paragraphs), sigma 0.6.
DEMO_CHAT_REPLY_MEDIAN_TOKENS = 256
DEMO_CHAT_REPLY_SIGMA = 0.6
# Cap on one message or reply: with 8 turns a prompt stays under 1 Ki + 8 * 4 Ki tokens,
# far below the producer's item limit (256 Ki).
DEMO_CHAT_MAX_MESSAGE_TOKENS = 2048
# A new conversation every 200 ms on average (Poisson), and a median think time of 5 s
# between turns (log-normal, sigma 0.8): ~25 conversations are open at once, so the turns of
# one conversation arrive far apart, with other conversations' turns between them.
DEMO_CHAT_START_GAP_MS = 200.0
DEMO_CHAT_THINK_MEDIAN_MS = 5000.0
DEMO_CHAT_THINK_SIGMA = 0.8

# Token streams of the three kinds of text (arbitrary constants spelled in ASCII, distinct
# from workload.py's, so equal numeric ids give unrelated tokens).
CHAT_SYSTEM_STREAM = 0x6368_6174_7379_7374  # "chatsyst"
CHAT_USER_STREAM = 0x6368_6174_7573_6572  # "chatuser"
CHAT_REPLY_STREAM = 0x6368_6174_7265_706C  # "chatrepl"

# demo-template: 64 templates, enough that a consumer's cache holds only a few of them at the
# smaller cache sizes of the evaluation suite (whose prefix comparison asks for at least 64).
DEMO_TEMPLATE_SHAPES = 64
# Templates per shared system prompt: 8 groups of 8, so a prefix-aware order has a shared
# first component to stay on, and a shape-blind one recomputes it.
DEMO_TEMPLATE_GROUP = 8
# Each component (system prompt, template document): log-uniform 1,000 to 8,000 tokens, long
# retrieval-style prompts whose recomputation dominates a batch's cost.
DEMO_TEMPLATE_COMPONENT_MIN_TOKENS = 1000
DEMO_TEMPLATE_COMPONENT_MAX_TOKENS = 8000
# Template popularity ~ 1 / rank^1.1 (Zipf, as the demo's): with 64 templates the top one gets
# about a fifth of the items, the rarest a fraction of a percent.
DEMO_TEMPLATE_ZIPF_EXPONENT = 1.1
# User parts: log-normal, median 128 tokens, sigma 1 (90% ~25 to ~660), capped (the tail
# would otherwise add rare prompts far longer than the templates).
DEMO_TEMPLATE_USER_MEDIAN_TOKENS = 128
DEMO_TEMPLATE_USER_SIGMA = 1.0
DEMO_TEMPLATE_USER_MAX_TOKENS = 4096
# A new item every 2 ms on average (Poisson): arrival times only matter under --replay-speed.
DEMO_TEMPLATE_GAP_MS = 2.0
TEMPLATE_SYSTEM_STREAM = 0x7465_6D70_7379_7374  # "tempsyst"
TEMPLATE_DOC_STREAM = 0x7465_6D70_646F_6373  # "tempdocs"
TEMPLATE_USER_STREAM = 0x7465_6D70_7573_6572  # "tempuser"


def named_workload(name: str, items: int | None = None, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                   default_items: int = 20_000) -> Workload:
    """"demo", "demo-chat" or "demo-template" generated with `items` items (`default_items` if None), or the
    workload file at path `name` (its first `items` if given). Raises WorkloadError for a
    file that cannot be used, ValueError for bad generator arguments."""
    if name == DEMO:
        return demo_workload(items or default_items, seed=seed, vocab_size=vocab_size)
    if name == DEMO_CHAT:
        return demo_chat_workload(items or default_items, seed=seed, vocab_size=vocab_size)
    if name == DEMO_TEMPLATE:
        return demo_template_workload(items or default_items, seed=seed, vocab_size=vocab_size)
    workload = load_workload(name, vocab_size=vocab_size)
    return workload.head(items) if items else workload


def demo_chat_workload(items: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> Workload:
    """`items` chat turns in arrival order (see the module docstring); model 0."""
    _check_arguments(DEMO_CHAT, items, seed, vocab_size)
    rng = np.random.default_rng(seed)
    system_lengths = np.array([round(math.exp(rng.uniform(math.log(DEMO_SYSTEM_MIN_TOKENS),
                                                          math.log(DEMO_SYSTEM_MAX_TOKENS))))
                               for _ in range(DEMO_CHAT_SYSTEMS)])
    # Every conversation has at least one turn, so `items` conversations are always enough.
    turns = rng.integers(1, DEMO_CHAT_MAX_TURNS + 1, size=items)
    conversations = int(np.searchsorted(np.cumsum(turns), items)) + 1
    turns = turns[:conversations]
    turns[-1] -= int(turns.sum()) - items  # the last one is cut to make `items` turns exactly
    shape = (conversations, DEMO_CHAT_MAX_TURNS)
    chat = _ChatItems(
        seed, vocab_size, system_lengths,
        systems=rng.integers(0, DEMO_CHAT_SYSTEMS, size=conversations),
        users=_lognormal(rng, DEMO_CHAT_USER_MEDIAN_TOKENS, DEMO_CHAT_USER_SIGMA, shape),
        replies=_lognormal(rng, DEMO_CHAT_REPLY_MEDIAN_TOKENS, DEMO_CHAT_REPLY_SIGMA, shape))
    starts = np.cumsum(rng.exponential(DEMO_CHAT_START_GAP_MS, size=conversations))
    think = rng.lognormal(math.log(DEMO_CHAT_THINK_MEDIAN_MS), DEMO_CHAT_THINK_SIGMA, size=shape)
    think[:, 0] = 0.0
    times = starts[:, None] + np.cumsum(think, axis=1)
    conv = np.repeat(np.arange(conversations), turns)
    turn = np.concatenate([np.arange(n) for n in turns.tolist()])
    arrival = times[conv, turn]
    # By time; ties (none in practice) by conversation then turn, so turn order always holds.
    order = np.lexsort((turn, conv, arrival))
    chat.schedule(conv[order], turn[order], arrival[order] - arrival[order[0]])
    return Workload(f"demo-chat(items={items}, seed={seed}"
                    f"{f', vocab_size={vocab_size}' if vocab_size != VOCAB_SIZE else ''})", items, chat,
                    total_tokens=chat.total_tokens(), models=(0,))


def _check_arguments(name: str, items: int, seed: int, vocab_size: int) -> None:
    """ValueError for a generator argument out of range."""
    if items < 1:
        raise ValueError(f"{name} workload of {items} items: need at least one")
    if not 0 <= seed <= MAX_DEMO_SEED:
        raise ValueError(f"{name} seed {seed}: must be in [0, {MAX_DEMO_SEED}]")
    check_vocab_size(vocab_size)


def _lognormal(rng: np.random.Generator, median: int, sigma: float, shape: tuple[int, int]) -> np.ndarray:
    values = rng.lognormal(math.log(median), sigma, size=shape).astype(np.int64)
    return np.clip(values, 1, DEMO_CHAT_MAX_MESSAGE_TOKENS)


class _ChatItems:
    """Makes demo-chat items on demand. Owner: one Workload; immutable once scheduled."""

    def __init__(self, seed: int, vocab_size: int, system_lengths: np.ndarray, systems: np.ndarray,
                 users: np.ndarray, replies: np.ndarray) -> None:
        self._vocab_size = vocab_size
        self._streams = (CHAT_SYSTEM_STREAM ^ seed, CHAT_USER_STREAM ^ seed, CHAT_REPLY_STREAM ^ seed)
        self._system_lengths = system_lengths
        self._systems = systems
        self._users = users
        self._replies = replies

    def schedule(self, conv: np.ndarray, turn: np.ndarray, arrival_ms: np.ndarray) -> None:
        """Item k is turn `turn[k]` (from 0) of conversation `conv[k]`, arriving at
        `arrival_ms[k]`."""
        self._conv, self._turn, self._arrival = conv, turn, arrival_ms

    def total_tokens(self) -> int:
        per_turn = self._users + np.pad(np.cumsum(self._users + self._replies, axis=1)[:, :-1], ((0, 0), (1, 0)))
        system = self._system_lengths[self._systems[self._conv]]
        return int(system.sum() + per_turn[self._conv, self._turn].sum())

    def _text(self, stream: int, conv: int, turn: int, length: int) -> np.ndarray:
        block_id = conv * DEMO_CHAT_MAX_TURNS + turn
        return hashed_tokens(stream, [block_id], length, self._vocab_size)[0]

    def __call__(self, k: int) -> WorkItem:
        conv, turn = int(self._conv[k]), int(self._turn[k])
        system_stream, user_stream, reply_stream = self._streams
        system = int(self._systems[conv])
        components = [hashed_tokens(system_stream, [system], int(self._system_lengths[system]), self._vocab_size)[0]]
        for earlier in range(turn):
            components.append(np.concatenate([
                self._text(user_stream, conv, earlier, int(self._users[conv, earlier])),
                self._text(reply_stream, conv, earlier, int(self._replies[conv, earlier]))]))
        suffix = self._text(user_stream, conv, turn, int(self._users[conv, turn]))
        return WorkItem(0, components, suffix, f"chat-{conv}-{turn + 1}".encode(), float(self._arrival[k]), 0)


@dataclass(slots=True, frozen=True)
class TemplateScale:
    """The sizes of demo-template: its templates, their groups, the components' and user
    parts' lengths. The default is the workload `--workload demo-template` runs; a smaller
    one fits a model of a short context (`pipeline bench prefix`'s vLLM side)."""

    shapes: int = DEMO_TEMPLATE_SHAPES
    group: int = DEMO_TEMPLATE_GROUP
    component_min_tokens: int = DEMO_TEMPLATE_COMPONENT_MIN_TOKENS
    component_max_tokens: int = DEMO_TEMPLATE_COMPONENT_MAX_TOKENS
    user_median_tokens: int = DEMO_TEMPLATE_USER_MEDIAN_TOKENS
    user_max_tokens: int = DEMO_TEMPLATE_USER_MAX_TOKENS

    def problems(self) -> list[str]:
        """What is wrong with these sizes (nothing: [])."""
        wrong = [f"{name} must be a positive integer, got {getattr(self, name)!r}" for name in (
            "shapes", "group", "component_min_tokens", "component_max_tokens", "user_median_tokens",
            "user_max_tokens") if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int)
            or getattr(self, name) < 1]
        if not wrong and self.shapes % self.group:
            wrong.append(f"shapes ({self.shapes}) must be a multiple of group ({self.group})")
        if not wrong and self.component_min_tokens > self.component_max_tokens:
            wrong.append(f"component_min_tokens {self.component_min_tokens} > component_max_tokens "
                         f"{self.component_max_tokens}")
        return wrong

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt these sizes can make: two longest components and the longest user part."""
        return 2 * self.component_max_tokens + self.user_max_tokens


def demo_template_workload(items: int, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                           scale: TemplateScale = TemplateScale()) -> Workload:
    """`items` prompts over `scale.shapes` templates (see the module docstring); model 0.
    ValueError for a bad argument or scale."""
    _check_arguments(DEMO_TEMPLATE, items, seed, vocab_size)
    if scale.problems():
        raise ValueError(f"{DEMO_TEMPLATE} scale: {'; '.join(scale.problems())}")
    rng = np.random.default_rng(seed)
    groups = scale.shapes // scale.group
    low, high = math.log(scale.component_min_tokens), math.log(scale.component_max_tokens)
    system_lengths = np.rint(np.exp(rng.uniform(low, high, size=groups))).astype(np.int64)
    doc_lengths = np.rint(np.exp(rng.uniform(low, high, size=scale.shapes))).astype(np.int64)
    systems = [hashed_tokens(TEMPLATE_SYSTEM_STREAM ^ seed, [g], int(n), vocab_size)[0]
               for g, n in enumerate(system_lengths)]
    shapes = []
    for t, n in enumerate(doc_lengths.tolist()):
        doc = hashed_tokens(TEMPLATE_DOC_STREAM ^ seed, [t], n, vocab_size)[0]
        doc.flags.writeable = False
        shapes.append([systems[t // scale.group], doc])
    for system in systems:
        system.flags.writeable = False
    # Popularity by rank, the ranks dealt to templates at random so the hot ones are spread
    # over the groups rather than all in the first.
    popularity = 1.0 / np.arange(1, scale.shapes + 1) ** DEMO_TEMPLATE_ZIPF_EXPONENT
    popularity = popularity[rng.permutation(scale.shapes)]
    item_shapes = rng.choice(scale.shapes, size=items, p=popularity / popularity.sum())
    users = rng.lognormal(math.log(scale.user_median_tokens), DEMO_TEMPLATE_USER_SIGMA, size=items)
    user_lengths = np.clip(users.astype(np.int64), 1, scale.user_max_tokens)
    arrival = np.cumsum(rng.exponential(DEMO_TEMPLATE_GAP_MS, size=items))
    prefix_lengths = system_lengths[np.arange(scale.shapes) // scale.group] + doc_lengths
    build = _TemplateItems(seed, vocab_size, shapes, item_shapes, user_lengths, arrival - arrival[0])
    scaled = "" if scale == TemplateScale() else f", {scale}"
    return Workload(f"demo-template(items={items}, seed={seed}"
                    f"{f', vocab_size={vocab_size}' if vocab_size != VOCAB_SIZE else ''}{scaled})", items, build,
                    total_tokens=int(prefix_lengths[item_shapes].sum() + user_lengths.sum()), models=(0,))


class _TemplateItems:
    """Makes demo-template items on demand. Owner: one Workload; holds nothing mutable but
    its signature cache (an idempotent insert)."""

    def __init__(self, seed: int, vocab_size: int, shapes: list[list[np.ndarray]], item_shapes: np.ndarray,
                 user_lengths: np.ndarray, arrival_ms: np.ndarray) -> None:
        self._user_stream = TEMPLATE_USER_STREAM ^ seed
        self._vocab_size = vocab_size
        self._shapes = shapes
        self._signatures: dict[int, int] = {}
        self._item_shapes = item_shapes
        self._user_lengths = user_lengths
        self._arrival = arrival_ms

    def __call__(self, k: int) -> WorkItem:
        shape = int(self._item_shapes[k])
        suffix = hashed_tokens(self._user_stream, [k], int(self._user_lengths[k]), self._vocab_size)[0]
        item = WorkItem(0, list(self._shapes[shape]), suffix, f"template-{shape}-{k}".encode(),
                        float(self._arrival[k]), 0, self._signatures.get(shape))
        self._signatures.setdefault(shape, item.signature)
        return item


def demo_workload(items: int, seed: int = 0, models: int = 1, vocab_size: int = VOCAB_SIZE) -> Workload:
    """The embedded default workload: `items` prompts over DEMO_SHAPES template shapes.

    Each shape is a system prompt, plus a few-shot block for about half of them; shape s
    belongs to model s % models; popularity is Zipf-like; user parts are log-normal (see the
    DEMO_ constants); token ids are below `vocab_size`. Everything follows from (items,
    seed, models, vocab_size), and the default vocab_size gives the same prompts as before
    it was a parameter; item k's payload is "demo-k".
    """
    if items < 1:
        raise ValueError(f"demo workload of {items} items: need at least one")
    if not 0 <= seed <= MAX_DEMO_SEED:
        raise ValueError(f"demo seed {seed}: must be in [0, {MAX_DEMO_SEED}]")
    if not 1 <= models <= DEMO_SHAPES:
        raise ValueError(f"demo with {models} models: need 1 to {DEMO_SHAPES} (one model per shape at most)")
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)
    shapes = [_demo_shape(rng, seed, s, vocab_size) for s in range(DEMO_SHAPES)]
    popularity = 1.0 / np.arange(1, DEMO_SHAPES + 1) ** DEMO_ZIPF_EXPONENT
    item_shapes = rng.choice(DEMO_SHAPES, size=items, p=popularity / popularity.sum())
    lognormal = rng.lognormal(math.log(DEMO_SUFFIX_MEDIAN_TOKENS), DEMO_SUFFIX_SIGMA, size=items)
    suffix_lengths = np.clip(lognormal.astype(np.int64), 1, DEMO_SUFFIX_MAX_TOKENS)
    prefix_lengths = np.array([sum(len(c) for c in shape) for shape in shapes])
    shape_models = np.arange(DEMO_SHAPES) % models
    build = _DemoItems(seed, shapes, shape_models, item_shapes, suffix_lengths, vocab_size)
    vocab = f", vocab_size={vocab_size}" if vocab_size != VOCAB_SIZE else ""  # the default's name as before
    return Workload(f"demo(items={items}, seed={seed}, models={models}{vocab})", items, build,
                    total_tokens=int(prefix_lengths[item_shapes].sum() + suffix_lengths.sum()),
                    models=tuple(int(m) for m in np.unique(shape_models[item_shapes])))


def _demo_shape(rng: np.random.Generator, seed: int, shape: int, vocab_size: int) -> list[np.ndarray]:
    """Shape `shape`'s components: a system prompt and maybe a few-shot block (read-only)."""
    stream = DEMO_PREFIX_STREAM ^ seed
    system_tokens = _log_uniform(rng, DEMO_SYSTEM_MIN_TOKENS, DEMO_SYSTEM_MAX_TOKENS)
    components = [hashed_tokens(stream, [2 * shape], system_tokens, vocab_size)[0]]
    if rng.random() < DEMO_FEWSHOT_SHARE:
        fewshot_tokens = _log_uniform(rng, DEMO_FEWSHOT_MIN_TOKENS, DEMO_FEWSHOT_MAX_TOKENS)
        components.append(hashed_tokens(stream, [2 * shape + 1], fewshot_tokens, vocab_size)[0])
    for component in components:
        component.flags.writeable = False
    return components


def _log_uniform(rng: np.random.Generator, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


class _DemoItems:
    """Makes demo items on demand. Owner: one Workload; holds nothing mutable."""

    def __init__(self, seed: int, shapes: list[list[np.ndarray]], shape_models: np.ndarray,
                 item_shapes: np.ndarray, suffix_lengths: np.ndarray, vocab_size: int) -> None:
        self._suffix_stream = DEMO_SUFFIX_STREAM ^ seed
        self._vocab_size = vocab_size
        self._shapes = shapes
        self._signatures = [int(shape_signature(components)) for components in shapes]
        self._shape_models = shape_models
        self._item_shapes = item_shapes
        self._suffix_lengths = suffix_lengths

    def __call__(self, k: int) -> WorkItem:
        shape = int(self._item_shapes[k])
        suffix = hashed_tokens(self._suffix_stream, [k], int(self._suffix_lengths[k]), self._vocab_size)[0]
        return WorkItem(int(self._shape_models[shape]), list(self._shapes[shape]), suffix,
                        f"demo-{k}".encode(), None, 0, self._signatures[shape])
