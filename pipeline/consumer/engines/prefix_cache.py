"""An LRU cache of block hashes in flat numpy arrays, updated a whole batch at a time.

The sim engine's prefix cache (see `sim.py` for what a block hash is). Exact LRU semantics,
defined prompt by prompt: a prompt's hits are its leading blocks found in the cache; then
every block of the prompt is touched, tail first (so its head ends most recent, as vLLM
frees a request's blocks in reverse order); then the least recently touched blocks are
evicted until at most `capacity_blocks` remain. A batch gives exactly what its prompts give
one by one, in order.

Layout, all proportional to the capacity:
- pool: one slot per cached block (`_key`, `_stamp`: the block's hash and the clock value
  of its last touch; slots 0..`_used`-1 are all cached blocks, so size == `_used`).
- index: an open-addressing table from block hash to pool slot, in buckets of
  BUCKET_WAYS ways read as one row (a full bucket spills into the next: linear probing by
  bucket). Entries are never deleted one by one: an evicted block's entry goes stale (its
  slot holds another block, or no block), and the table is rebuilt from the live blocks
  when half full. An entry also carries `_ref`, whether the block was ever referenced as
  cacheable (for compulsory misses), and survives rebuilds while that is set.
- log: (slot, stamp) of the last touch of each block a batch touched, in stamp order; an
  entry is current while its stamp is its slot's stamp. Eviction takes the first current
  entries from the head: the least recently used blocks, with no per-block Python and no
  sort.

A batch's lookups, inserts, stamp updates and evictions are each a few numpy operations.
With the sim engine's hashing, a 64-prompt batch of 16 blocks each takes ~220 us of engine
time against ~340 us with the OrderedDict this replaced (tools/bench_consumer.py
--engine-only: 3.4-3.6 against 5.2-5.6 us per prompt).
NOTE: a plain dict from hash to slot beside numpy stamps was rejected: it keeps a dictionary
call per block, and those calls' cache misses (~200 ns each with five processes on two
cores) were the cost to remove. NOTE: placing an insert's keys that claim one free way by
their rank among its claimants (a sort instead of write-and-read-back rounds) measured no
faster (3.59 against 3.49 us per prompt).
"""

from __future__ import annotations

import numpy as np

# Index ways per cached block, at least (a power of two above it): the index is rebuilt
# when MAX_LOAD full, so with 4 a rebuild follows at least a capacity's worth of new blocks
# (with the default capacity, every 128 batches of 64 new 256-token prompts, ~3 ms each).
# 8 and 16 measured the same in tools/bench_consumer.py (3.4-3.5 us per item for the
# engine), so the smallest: 4 ways of 13 bytes per block, ~3.4 MB for 1 Mi tokens of
# 16-token blocks, which leaves more of the shared CPU cache to the other processes.
INDEX_WAYS_PER_BLOCK = 4
MAX_LOAD = 0.5
# Blocks remembered as referenced once evicted (for compulsory misses, `run`): past it, at a
# rebuild, they are forgotten: one referenced again misses as "first" again, so the
# compulsory count is then an upper bound (`forgotten_references` says it happened). The
# index then stays within about 2**20 ways (13 MiB) beside the cache's own, where every
# distinct block ever referenced stayed (~26 bytes each, growing with a job whose requests
# each have their own system prompt).
MAX_REMEMBERED_BLOCKS = 1 << 18
# Ways per index bucket, read as one row (16 uint64 keys: two 64-byte cache lines). With 8,
# about 1% of lookups found their bucket full and read the next one, so nearly every batch
# of ~500 lookups took a second, ~10 us round; with 16 that is rare.
BUCKET_WAYS = 16
# Log entries per cached block before compaction: compaction copies at most the capacity
# (the current entries), so with 2 it copies at most one entry per entry appended.
LOG_ENTRIES_PER_BLOCK = 2
# Log entries looked at first when searching for n victims: at least this many, and 2n
# (touches of still-cached blocks leave stale entries between current ones).
SCAN_MIN_ENTRIES = 256
# Batch layouts remembered (a batch's shape: blocks per prompt); a consumer's batches have
# a handful of shapes, and the cache restarts when full.
LAYOUT_CACHE_MAX = 256
# Blocks of the remembered layouts together (five int64 a block: 2.5 MiB): 64 layouts of
# 64 prompts of 16 blocks fit, a handful of 64-block prompts' too, while batches of long
# prompts that never repeat (an analysis's, of every length) restart the cache instead of
# holding hundreds of MB of layouts.
LAYOUT_CACHE_MAX_BLOCKS = 1 << 16

_NO_SLOT = -1
_U64 = np.uint64


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 1).bit_length()


class PrefixCache:
    """LRU set of block hashes with the batch semantics above. Owner: one engine; not
    thread-safe.

    Example, capacity 2 blocks, block hashes as letters: prompt [a, b] -> 0 hits, the cache
    holds b, a (least recent first: b was touched first). Prompt [c] -> 0 hits, 1 eviction
    (b), the cache holds a, c. Prompt [a, d] in the same batch as [a, e]: [a, d] hits a,
    evicts c; [a, e] hits a, evicts d: hits [1, 1], the cache holds e, a.
    """

    def __init__(self, capacity_blocks: int, max_remembered_blocks: int = MAX_REMEMBERED_BLOCKS) -> None:
        if not 0 < capacity_blocks < 1 << 31:
            raise ValueError(f"prefix cache: capacity of {capacity_blocks} blocks")
        assert max_remembered_blocks >= 0, max_remembered_blocks
        self.capacity_blocks = capacity_blocks
        self.max_remembered_blocks = max_remembered_blocks
        self.evicted_blocks = 0
        self.forgotten_references = 0  # times the evicted blocks' references were forgotten
        # One extra slot, never used by a block: the slot of index entries that only carry
        # the referenced flag (`_ref_only`), and what a stale -1 reads.
        self._key = np.zeros(capacity_blocks + 1, dtype=np.uint64)
        self._stamp = np.full(capacity_blocks + 1, -1, dtype=np.int64)
        self._used = 0
        self._clock = 0
        self._new_index(_pow2_at_least(INDEX_WAYS_PER_BLOCK * capacity_blocks // BUCKET_WAYS) * BUCKET_WAYS)
        self._log_slot = np.zeros(LOG_ENTRIES_PER_BLOCK * capacity_blocks, dtype=np.int32)
        self._log_stamp = np.zeros(LOG_ENTRIES_PER_BLOCK * capacity_blocks, dtype=np.int64)
        self._head = self._tail = 0

    @property
    def _ref_only(self) -> int:
        return self.capacity_blocks

    def __len__(self) -> int:
        return self._used

    def keys_lru(self) -> list[int]:
        """Every cached block hash, least recently used first."""
        at = np.arange(self._head, self._tail)
        current = at[self._stamp[self._log_slot[at]] == self._log_stamp[at]]
        return self._key[self._log_slot[current]].tolist()

    def run(self, flat: np.ndarray, layout: BatchLayout, cacheable_blocks: np.ndarray) -> tuple[np.ndarray, int]:
        """Look up and touch a batch's blocks: per prompt, its leading blocks found (hits),
        and how many distinct cacheable blocks missed on their first reference ever.

        `flat` is every prompt's chained block hashes back to back (uint64), `layout` says
        how many each prompt has, `cacheable_blocks` how many of them are inside its prefix.
        The batch is done in bulk unless an eviction during it would hit a block a later
        prompt uses; then prompt by prompt (each prompt alone is always done in bulk).
        """
        counts = layout.counts
        got = self._run_bulk(flat, layout, cacheable_blocks, strict=counts.shape[0] > 1)
        if got is not None:
            return got
        hits = np.zeros(counts.shape[0], dtype=np.int64)
        compulsory = 0
        for i, (start, n) in enumerate(zip(layout.starts.tolist(), counts.tolist())):
            one, new = self._run_bulk(flat[start:start + n], BatchLayout.of(counts[i:i + 1]), cacheable_blocks[i:i + 1],
                                      strict=False)
            hits[i] = one[0]
            compulsory += new
        return hits, compulsory

    def _run_bulk(self, flat: np.ndarray, layout: BatchLayout, cacheable_blocks: np.ndarray,
                  strict: bool) -> tuple[np.ndarray, int] | None:
        """`run` for the whole batch at once; None, with nothing changed, when `strict` and
        an eviction during the batch would hit a block of it (the oldest blocks before the
        batch, as many as its new blocks overflow, include one it uses, or are too few).

        Without `strict` (one prompt), evictions come after the prompt's own touches, so
        they never hit its blocks before it has used them; a prompt with more distinct
        blocks than the capacity keeps its most recent `capacity_blocks` of them.
        """
        if flat.shape[0] == 0:
            return np.zeros(layout.counts.shape[0], dtype=np.int64), 0
        batch = _Batch(flat, layout)
        if self._index_count + batch.keys.shape[0] > MAX_LOAD * self._index_key.shape[0]:
            self._rebuild_index(room=batch.keys.shape[0])
        pos, found, live, slot = self._lookup(batch.keys)
        n_live = int(np.count_nonzero(live))
        overflow = self._used + batch.keys.shape[0] - n_live - self.capacity_blocks
        victims = np.zeros(0, dtype=np.int64)
        if strict and overflow > 0:
            victims = self._oldest(overflow)
            if victims.shape[0] < overflow or (self._stamp[slot[live]] <= self._log_stamp[victims[-1]]).any():
                return None
        hits = batch.hits(live)
        if not found.all():
            pos[~found] = self._insert(batch.keys[~found], pos[~found])
        compulsory = self._reference(batch, pos, hits, cacheable_blocks)
        base = self._clock
        self._clock += flat.shape[0]
        stamps = base + batch.last
        if not strict and overflow > self._used - n_live:
            self._keep_newest(batch, pos, stamps, base)
        else:
            if not strict and overflow > 0:
                self._stamp[slot[live]] = stamps[live]  # so the search below passes them over
                victims = self._oldest(overflow)
            self._place(batch, pos, live, slot, stamps, victims, base)
        self.evicted_blocks += max(overflow, 0)
        return hits, compulsory

    def _lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per distinct key: its index position (or the first free one on its probe path),
        whether it has an entry, whether it is cached, and its slot (meaningful if cached)."""
        pos, slot = self._find(keys, self._home(keys))
        found = slot != _NO_SLOT
        live = found & (slot < self._used) & (self._key[slot] == keys)
        return pos, found, live, slot

    def _place(self, batch: _Batch, pos: np.ndarray, live: np.ndarray, slot: np.ndarray, stamps: np.ndarray,
               victims: np.ndarray, base: int) -> None:
        """Give the batch's new blocks slots (free ones, then the victims'), stamp every
        block of the batch, and log the touches; the victims leave the log."""
        new = ~live
        n_new = int(np.count_nonzero(new))
        fresh = min(n_new, self.capacity_blocks - self._used)
        new_slots = np.arange(self._used, self._used + fresh, dtype=np.int64)
        if victims.shape[0]:
            assert victims.shape[0] == n_new - fresh, "victims must make room for exactly the new blocks"
            new_slots = np.concatenate([new_slots, self._log_slot[victims].astype(np.int64)])
            self._head = int(victims[-1]) + 1
        slot = slot.copy()
        slot[new] = new_slots
        self._key[new_slots] = batch.keys[new]
        self._index_slot[pos[new]] = new_slots
        self._stamp[slot] = stamps
        self._used += fresh
        self._append_log(batch, slot, np.ones(slot.shape[0], dtype=bool), base)

    def _keep_newest(self, batch: _Batch, pos: np.ndarray, stamps: np.ndarray, base: int) -> None:
        """One prompt with more distinct blocks than the capacity: every other block goes,
        and of the prompt's blocks the `capacity_blocks` most recently touched stay (its
        head; the tail, touched first, is evicted first)."""
        keep = np.zeros(stamps.shape[0], dtype=bool)
        keep[np.argsort(stamps)[-self.capacity_blocks:]] = True
        slot = np.full(stamps.shape[0], self._ref_only, dtype=np.int64)
        slot[keep] = np.arange(int(np.count_nonzero(keep)), dtype=np.int64)
        self._used = int(np.count_nonzero(keep))
        self._head = self._tail  # every block cached before is gone: no current entry left
        self._key[slot[keep]] = batch.keys[keep]
        self._index_slot[pos[keep]] = slot[keep]
        self._stamp[slot[keep]] = stamps[keep]
        self._append_log(batch, slot, keep, base)

    def _reference(self, batch: _Batch, pos: np.ndarray, hits: np.ndarray, cacheable_blocks: np.ndarray) -> int:
        """Distinct cacheable blocks of the batch that missed on their first reference ever
        (prompt by prompt: never referenced as cacheable before the batch, nor earlier in
        it); every cacheable block of the batch is referenced from now on. Only misses
        count, so hits + compulsory misses never exceed the cacheable blocks.

        Example: prompts [k] (k hits, cacheable) then [x, k] (x misses, so k counts as a
        miss too): k is not compulsory, its first reference hit. With [x, k] first, it is.
        """
        layout = batch.layout
        in_prefix = layout.local < np.minimum(cacheable_blocks, layout.counts)[layout.prompt]
        if not in_prefix.any():
            return 0
        missed = in_prefix & (layout.local >= hits[layout.prompt])
        new = 0
        if missed.any():  # a block's first reference: within a prompt, hits come before misses
            first_miss = batch.first_prompt_where(missed)
            first_hit = batch.first_prompt_where(in_prefix & ~missed)
            new = int(np.count_nonzero((first_miss < first_hit) & ~self._index_ref[pos]))
        self._index_ref[pos[batch.group[in_prefix]]] = True
        return new

    def _oldest(self, count: int) -> np.ndarray:
        """Log positions of the `count` least recently used blocks (fewer if the cache holds
        fewer), oldest first: the first current entries from the head."""
        found: list[np.ndarray] = []
        need, start, chunk = count, self._head, max(2 * count, SCAN_MIN_ENTRIES)
        while need > 0 and start < self._tail:
            end = min(start + chunk, self._tail)
            current = np.flatnonzero(self._stamp[self._log_slot[start:end]] == self._log_stamp[start:end])[:need]
            found.append(current + start)
            need -= current.shape[0]
            start, chunk = end, 2 * chunk
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def _append_log(self, batch: _Batch, slot: np.ndarray, cached: np.ndarray, base: int) -> None:
        """Log the last touch of each cached block of the batch, in touch (stamp) order;
        compact the log first (its current entries to the front) or grow it if full."""
        by_touch = np.full(batch.group.shape[0], -1, dtype=np.int32)
        by_touch[batch.last[cached]] = slot[cached]
        at = np.flatnonzero(by_touch >= 0)
        count = at.shape[0]
        if self._tail + count > self._log_slot.shape[0]:
            self._compact_log(count)
        self._log_slot[self._tail:self._tail + count] = by_touch[at]
        self._log_stamp[self._tail:self._tail + count] = at + base
        self._tail += count

    def _compact_log(self, room: int) -> None:
        at = np.arange(self._head, self._tail)
        current = at[self._stamp[self._log_slot[at]] == self._log_stamp[at]]
        kept = current.shape[0]
        size = self._log_slot.shape[0]
        if kept + room > size:  # a batch with more blocks than the log holds: grow it
            size = 2 * (kept + room)
        slots, stamps = self._log_slot[current], self._log_stamp[current]
        if size != self._log_slot.shape[0]:
            self._log_slot = np.zeros(size, dtype=np.int32)
            self._log_stamp = np.zeros(size, dtype=np.int64)
        self._log_slot[:kept], self._log_stamp[:kept] = slots, stamps
        self._head, self._tail = 0, kept

    def _new_index(self, size: int) -> None:
        """An empty index of `size` ways (a power of two, at least one bucket)."""
        size = max(size, BUCKET_WAYS)
        self._index_key = np.zeros(size, dtype=np.uint64)
        self._index_slot = np.full(size, _NO_SLOT, dtype=np.int32)
        self._index_ref = np.zeros(size, dtype=bool)
        self._key_rows = self._index_key.reshape(-1, BUCKET_WAYS)
        self._slot_rows = self._index_slot.reshape(-1, BUCKET_WAYS)
        self._bucket_mask = size // BUCKET_WAYS - 1
        self._index_count = 0

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return keys.view(np.int64) & self._bucket_mask

    def _find(self, keys: np.ndarray, bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per key, the index position (way) holding it, or the first free way on its probe
        path (buckets from `bucket` on), and that way's slot (_NO_SLOT if free): one bucket
        row per key, and another for the few whose bucket is full without them. A bucket
        fills from its first way and nothing is deleted, so a free way ends every path.

        Example: a key whose home bucket 12 is full of other keys and whose bucket 13 holds
        two: row 12 has no match and no free way, so row 13 is read, and the key's search
        stops at way 2 of it (13 * 8 + 2 = 106, free): the key is not in the index.
        """
        slots = np.take(self._slot_rows, bucket, axis=0)
        stop = np.take(self._key_rows, bucket, axis=0) == keys[:, None]
        stop |= slots == _NO_SLOT
        way = stop.argmax(axis=1)
        at = _row_starts(keys.shape[0]) + way
        pos, slot = bucket * BUCKET_WAYS + way, slots.ravel()[at]
        on = np.flatnonzero(~stop.ravel()[at])  # a full bucket without the key: the next one
        if on.shape[0]:
            pos[on], slot[on] = self._find(keys[on], (bucket[on] + 1) & self._bucket_mask)
        return pos, slot.astype(np.int64)

    def _insert(self, keys: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Enter distinct keys that are not in the index, each at `pos`, the first free way
        on its path, as referenced-flag-only entries (`_place` sets their slots); return
        where each went. Keys that claim the same free way: one of them takes it, the others
        look again from the same bucket, round after round."""
        pos = pos.copy()
        todo = np.arange(keys.shape[0])
        while todo.shape[0]:
            at, want = pos[todo], keys[todo]
            self._index_key[at] = want  # one of the claimants of a way stays there
            won = self._index_key[at] == want
            self._index_slot[at[won]] = self._ref_only
            todo = todo[~won]
            if todo.shape[0]:
                pos[todo] = self._find(keys[todo], pos[todo] // BUCKET_WAYS)[0]
        self._index_count += keys.shape[0]
        return pos

    def _rebuild_index(self, room: int) -> None:
        """A fresh index of the cached blocks and the referenced ones (stale entries of
        evicted blocks dropped), at most a quarter full with `room` more keys in it: twice
        the size (or more) if needed."""
        at = np.flatnonzero(self._index_slot != _NO_SLOT)
        keys, slot, ref = self._index_key[at], self._index_slot[at].astype(np.int64), self._index_ref[at]
        live = (slot < self._used) & (self._key[slot] == keys)
        if np.count_nonzero(ref & ~live) > self.max_remembered_blocks:
            ref = ref & live  # forget the evicted blocks' references (see the constant)
            self.forgotten_references += 1
        keep = live | ref
        keys, slot, ref = keys[keep], np.where(live, slot, self._ref_only)[keep], ref[keep]
        size = self._index_key.shape[0]
        while keys.shape[0] + room > MAX_LOAD / 2 * size:
            size *= 2
        self._new_index(size)
        # Straight into place: the k-th key of a bucket (any order) takes its way k.
        home = self._home(keys)
        order = np.argsort(home)
        home = home[order]
        run_start = np.ones(home.shape[0], dtype=bool)
        run_start[1:] = home[1:] != home[:-1]
        rank = np.arange(home.shape[0])
        rank -= np.maximum.accumulate(np.where(run_start, rank, 0))
        direct = rank < BUCKET_WAYS
        pos = np.empty(keys.shape[0], dtype=np.int64)
        pos[order[direct]] = home[direct] * BUCKET_WAYS + rank[direct]
        self._index_key[pos[order[direct]]] = keys[order[direct]]
        self._index_slot[pos[order[direct]]] = self._ref_only
        self._index_count = int(np.count_nonzero(direct))
        spill = order[~direct]  # a bucket's ninth key and on: the next buckets, as usual
        if spill.shape[0]:
            pos[spill] = self._insert(keys[spill], self._find(keys[spill], self._home(keys[spill]))[0])
        self._index_slot[pos] = slot
        self._index_ref[pos] = ref


def _row_starts(rows: int) -> np.ndarray:
    """0, 8, 16, ...: the first way of each of `rows` bucket rows read back to back."""
    global _ROW_STARTS
    if _ROW_STARTS.shape[0] < rows:
        _ROW_STARTS = np.arange(2 * rows, dtype=np.int64) * BUCKET_WAYS
    return _ROW_STARTS[:rows]


_ROW_STARTS = np.zeros(0, dtype=np.int64)


class BatchLayout:
    """Where each block of a batch sits, from how many blocks each prompt has: its prompt,
    its place in the prompt, and its touch position (prompt by prompt, each prompt tail
    first). Read-only and shared: `of` remembers the layouts it made, since a consumer's
    batches come in a few shapes.

    Example, counts [2, 3]: starts [0, 2]; prompt [0, 0, 1, 1, 1]; local [0, 1, 0, 1, 2];
    touch [1, 0, 4, 3, 2] (reversing each prompt; its own inverse).
    """

    __slots__ = ("counts", "starts", "prompt", "local", "touch", "filled", "filled_starts", "count_of_block",
                 "prompt_start")

    def __init__(self, counts: np.ndarray) -> None:
        self.counts = counts
        self.starts = np.cumsum(counts) - counts
        self.prompt = np.repeat(np.arange(counts.shape[0]), counts)
        self.prompt_start = self.starts[self.prompt]  # each block's prompt's first block
        self.local = np.arange(self.prompt.shape[0]) - self.prompt_start
        self.touch = (self.starts + counts - 1)[self.prompt] - self.local
        self.filled = counts > 0
        self.filled_starts = self.starts[self.filled]
        self.count_of_block = counts[self.prompt]
        for name in self.__slots__:
            getattr(self, name).flags.writeable = False

    @staticmethod
    def of(counts: np.ndarray) -> BatchLayout:
        key = counts.tobytes()
        layout = _LAYOUTS.by_counts.get(key)
        if layout is None:
            layout = BatchLayout(counts.astype(np.int64))
            _LAYOUTS.remember(key, layout)
        return layout


class _Layouts:
    """The remembered layouts (`BatchLayout.of`), within LAYOUT_CACHE_MAX of them and
    LAYOUT_CACHE_MAX_BLOCKS blocks together: past either, they are forgotten all at once."""

    def __init__(self) -> None:
        self.by_counts: dict[bytes, BatchLayout] = {}
        self.blocks = 0

    def remember(self, key: bytes, layout: BatchLayout) -> None:
        blocks = layout.prompt.shape[0]
        if len(self.by_counts) >= LAYOUT_CACHE_MAX or self.blocks + blocks > LAYOUT_CACHE_MAX_BLOCKS:
            self.by_counts.clear()
            self.blocks = 0
        if blocks <= LAYOUT_CACHE_MAX_BLOCKS:
            self.by_counts[key] = layout
            self.blocks += blocks


_LAYOUTS = _Layouts()


def _group_sort(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A permutation that puts equal `keys` (uint64) side by side, the keys in that order,
    and where each run of equal keys starts (bool).

    Each key's low bits are replaced by its position and the words sorted (a value sort),
    so the permutation is read off them; equal keys share their high bits, and two unequal
    keys that share them (about n^2 / 2^(65 - bits) a batch: never, for hashes) are found
    and sorted again the usual way.
    NOTE: an argsort of the keys was rejected: numpy's sort of uint64 values is vectorised and
    its argsort is not (10 against 40 us for 4,096 keys on a 2-core AMD EPYC); for a 256-item
    batch's 4,096 block keys the whole grouping takes 26 us here against 58 with argsort.
    """
    n = keys.shape[0]
    bits = _U64(max(1, (n - 1).bit_length()))
    packed = np.sort((keys >> bits << bits) | np.arange(n, dtype=np.uint64))
    order = (packed & ((_U64(1) << bits) - _U64(1))).astype(np.int64)
    by_key = keys[order]
    head = np.empty(n, dtype=bool)
    head[0] = True
    np.not_equal(by_key[1:], by_key[:-1], out=head[1:])
    high = packed >> bits
    if np.count_nonzero(high[1:] != high[:-1]) != np.count_nonzero(head) - 1:  # a high-bits tie
        order = np.argsort(keys)
        by_key = keys[order]
        np.not_equal(by_key[1:], by_key[:-1], out=head[1:])
    return order, by_key, head


class _Batch:
    """A batch's blocks grouped by hash: `keys` (distinct, sorted), `group` (each block's
    key, in prompt order), `first` and `last` (each key's first and last touch position).

    Example, prompts [a, b] and [a, c]: touch order b, a, c, a; keys a, b, c; group
    0, 1, 0, 2; first 1, 0, 2; last 3, 0, 2.
    """

    def __init__(self, flat: np.ndarray, layout: BatchLayout) -> None:
        self.layout = layout
        n = flat.shape[0]
        touched = flat[layout.touch]
        order, by_key, head = _group_sort(touched)
        self._group_starts = np.flatnonzero(head)
        self._order = order
        self.keys = by_key[self._group_starts]
        group_by_touch = np.empty(n, dtype=np.int64)
        group_by_touch[order] = np.cumsum(head) - 1
        self.group = group_by_touch[layout.touch]
        self.first = np.minimum.reduceat(order, self._group_starts)
        self.last = np.maximum.reduceat(order, self._group_starts)

    def first_prompt_where(self, mask: np.ndarray) -> np.ndarray:
        """Per key, the first prompt where one of its blocks is in `mask` (the prompt count
        if none)."""
        layout = self.layout
        prompts = np.where(mask, layout.prompt, layout.counts.shape[0])[layout.touch][self._order]
        return np.minimum.reduceat(prompts, self._group_starts)

    def hits(self, cached_before: np.ndarray) -> np.ndarray:
        """Per prompt, its leading blocks that are cached when it runs: cached before the
        batch, or touched by an earlier prompt of it (exact when nothing the batch uses is
        evicted during it)."""
        layout = self.layout
        cached = cached_before[self.group] | (layout.prompt[self.first][self.group] < layout.prompt)
        first_miss = np.where(cached, layout.count_of_block, layout.local)
        hits = np.zeros(layout.counts.shape[0], dtype=np.int64)
        hits[layout.filled] = np.minimum.reduceat(first_miss, layout.filled_starts)
        return hits
