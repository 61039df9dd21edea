"""Accounting that proves nothing is lost: results files, the store and the producer rings
against what the producers accepted, by item id; and the broker's counters.

The broker counts items and tokens received (stored), routed (dispatched; a redelivery
counts again) and completed. The consumers' results files hold one line per item they ran;
an item with two lines was redelivered after a lost completion (a duplicate, at-least-once
delivery), which is counted, never hidden. At the end of a run (`take_stock`), every item
the run's producers accepted, and every item an earlier run left on the data directory (in
its store or its producer rings, read by id before the run's broker started), is found by
id in at least one place:

    with a result   a line of this run's results files
    in the store    a live (stored, not completed) entry: the next run on the data directory
                    completes it
    in a ring       a record of a producer ring the broker never stored: the next broker on
                    the data directory stores it first

    lost = |(accepted ∪ taken over) − (with a result ∪ in the store ∪ in a ring)|  must be 0
    received = completed (broker, over this broker's life) and tokens likewise, once a run
    has completed

An item in two places (a result written by a consumer that died before its completion
reached the broker: the item is still in the store and is redelivered) counts once.
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.wire.errors import ResultsFileError
from pipeline.wire.layouts.frames import ITEM_ID_SEQ_BITS, MAX_SEQ, make_item_id
from pipeline.wire.status import NS_PER_S, BrokerStatus
from pipeline.wire.textfiles import bounded_lines

# Bad results lines named in a summary (path:line and why); the rest are only counted: a
# file of garbage must not make a report of a million lines.
MAX_BAD_LINE_EXAMPLES = 10
# What a results line must hold to be read as a result: the fields a summary adds up.
_RESULT_FIELDS: tuple[tuple[str, type], ...] = (
    ("item_id", int), ("status", str), ("prompt_tokens", int), ("cached_tokens", int))


# The longest results line read: a result holds its output tokens (a long generation is
# tens of thousands of ids) and its payload (64 KiB at most, base64): 16 MiB leaves room and
# bounds what a file of one endless line costs.
MAX_RESULT_LINE_BYTES = 16 << 20
# Item ids are unsigned 64-bit (pipeline.wire.layouts ITEM_HEADER_DTYPE): a line with any
# other item_id is not a result.
ITEM_ID_LIMIT = 1 << 64


@dataclass(slots=True)
class ResultsSummary:
    """What the results files of a run hold."""

    lines: int = 0
    items: int = 0  # distinct item ids
    duplicates: int = 0  # lines beyond the first for an item
    by_status: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # of distinct items
    cached_tokens: int = 0  # over every line (a duplicate ran again)
    per_consumer: dict[str, dict[str, int]] = field(default_factory=dict)
    item_ids: set[int] = field(default_factory=set)
    # Lines that are not results (torn, glued, garbage, not JSON, JSON that is not a result
    # object): counted and never read; the first MAX_BAD_LINE_EXAMPLES named "path:line: why".
    bad_lines: int = 0
    bad_line_examples: list[str] = field(default_factory=list)
    # Of bad_lines, a file's last line cut short, without its newline (a consumer killed
    # mid-write; that batch was never completed, so it comes back). The next consumer of that
    # name terminates it, and it is then a bad line like any other.
    torn_lines: int = 0
    # The earliest dispatch and the latest completion over the lines (time.monotonic_ns() of
    # the broker and of the consumers: one clock for the machine); None without a line
    # that has them. `makespan_s` is the time between.
    first_dispatch_ns: int | None = None
    last_done_ns: int | None = None

    @property
    def makespan_s(self) -> float | None:
        """From the first batch's dispatch to the last batch's results, in seconds; None
        before any line with both times."""
        if self.first_dispatch_ns is None or self.last_done_ns is None:
            return None
        return max(0, self.last_done_ns - self.first_dispatch_ns) / NS_PER_S


def summarize_results(results_dir: str) -> ResultsSummary:
    """Read every `*.jsonl` results file of a run (one per consumer). A line that is not a
    result is counted and named (`bad_lines`, `bad_line_examples`) and reading goes on:
    never an error for what a file holds; so is a `*.jsonl` that is not a regular file (a
    directory, a pipe, a device: never opened, it could be read forever). A directory or
    file that cannot be read (no permission) is a ResultsFileError naming it."""
    summary = ResultsSummary()
    seen: Counter[int] = Counter()
    status: Counter[str] = Counter()
    try:
        names = sorted(os.listdir(results_dir))
    except FileNotFoundError:
        return summary  # no consumer has written a result yet
    except OSError as exc:  # not os.path.isdir first: it says False for a directory we may not enter
        raise ResultsFileError(f"{results_dir}: cannot list the results directory: {exc.strerror or exc}") from exc
    for name in names:
        if not name.endswith(".jsonl"):
            continue
        consumer = name[: -len(".jsonl")]
        mine = summary.per_consumer.setdefault(consumer, {"lines": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                                          "bad_lines": 0})
        path = os.path.join(results_dir, name)
        bad_before = summary.bad_lines
        if not _regular(path, summary):
            mine["bad_lines"] += 1
            continue
        for row in _rows(path, summary):
            item = row["item_id"]
            if not seen[item]:
                summary.prompt_tokens += row["prompt_tokens"]
            seen[item] += 1
            status[row["status"]] += 1
            summary.cached_tokens += row["cached_tokens"]
            mine["lines"] += 1
            mine["prompt_tokens"] += row["prompt_tokens"]
            mine["cached_tokens"] += row["cached_tokens"]
            _note_times(summary, row)
        mine["bad_lines"] += summary.bad_lines - bad_before
    summary.lines = sum(seen.values())
    summary.items = len(seen)
    summary.duplicates = summary.lines - summary.items
    summary.by_status = dict(status)
    summary.item_ids = set(seen)
    return summary


def _note_times(summary: ResultsSummary, row: dict) -> None:
    """Move the summary's first dispatch and last completion to cover `row`'s (a line
    without them, or with times that are not integers, leaves them)."""
    dispatch, done = row.get("dispatch_ns"), row.get("done_ns")
    if type(dispatch) is int and (summary.first_dispatch_ns is None or dispatch < summary.first_dispatch_ns):
        summary.first_dispatch_ns = dispatch
    if type(done) is int and (summary.last_done_ns is None or done > summary.last_done_ns):
        summary.last_done_ns = done


def _regular(path: str, summary: ResultsSummary) -> bool:
    """Whether `path` is a regular file (followed through a link); else it counts as one bad
    line, named, and is not read."""
    try:
        kind = os.stat(path).st_mode
    except OSError as exc:
        raise ResultsFileError(f"{path}: cannot read the results file: {exc.strerror or exc}") from exc
    if stat.S_ISREG(kind):
        return True
    summary.bad_lines += 1
    if len(summary.bad_line_examples) < MAX_BAD_LINE_EXAMPLES:
        summary.bad_line_examples.append(f"{path}: not a regular file (a directory, pipe or device): not read")
    return False


def result_rows(path: str, summary: ResultsSummary | None = None) -> Iterator[dict]:
    """The result rows of one results file (each a dict with at least the fields a summary
    reads); every other line is skipped and counted in `summary` when one is given."""
    return _rows(path, summary if summary is not None else ResultsSummary())


def _rows(path: str, summary: ResultsSummary):
    """The result rows of one file. Every other line is counted in `summary.bad_lines` and
    named "path:line: why" (the first MAX_BAD_LINE_EXAMPLES); a last line without its
    newline that is not a result is also a torn line (`torn_lines`). Read as bytes, so a
    line that is not UTF-8 is a bad line too. Only an unreadable file raises
    (ResultsFileError naming it)."""
    number = 0
    try:
        with open(path, "rb") as file:
            for number, line in bounded_lines(file, MAX_RESULT_LINE_BYTES):
                row, why = (None, f"longer than {MAX_RESULT_LINE_BYTES:,} bytes: not read") if line is None \
                    else _result(line)
                if why is None:
                    yield row
                    continue
                if line is not None and not line.endswith(b"\n"):  # only a file's last line can lack it
                    summary.torn_lines += 1
                    why = f"torn last line, no newline: {why}"
                summary.bad_lines += 1
                if len(summary.bad_line_examples) < MAX_BAD_LINE_EXAMPLES:
                    summary.bad_line_examples.append(f"{path}:{number}: {why}")
    except OSError as exc:
        where = f" after line {number}" if number else ""
        raise ResultsFileError(f"{path}: cannot read the results file{where}: {exc.strerror or exc}") from exc


def _result(line: bytes) -> tuple[dict | None, str | None]:
    """(the row, None) if `line` is a result object with the fields a summary reads, else
    (None, why not)."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested too deep
        return None, f"not JSON ({str(exc)[:80]})"
    if not isinstance(row, dict):
        return None, f"not a result object (a JSON {type(row).__name__})"
    for name, kind in _RESULT_FIELDS:
        value = row.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return None, f"not a result: field {name!r} is {_describe(value)}, not {kind.__name__}"
    if not 0 <= row["item_id"] < ITEM_ID_LIMIT:  # ids go into uint64 arrays (take_stock)
        return None, f"not a result: item_id {str(row['item_id'])[:40]} is not an item id (0 to {ITEM_ID_LIMIT - 1})"
    return row, None


def _describe(value: object) -> str:
    """A bounded account of a JSON value; never the repr of a container, which recurses as
    deep as the line nested it (RecursionError) and is as long as the line."""
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} elements"
    return f"{value!r:.40}"


@dataclass(slots=True)
class Stock:
    """Where a run's items are (see the module docstring). Counts are of distinct items.

    accepted: items this run's producers published; taken_over: items an earlier run left
    on the data directory (live in the store, or in a producer ring) when this run started;
    with_results / in_store / in_rings: items of either kind found there (an item in two
    places, e.g. a result written by a consumer that died before the completion arrived,
    counts once, in the first place that holds it); lost: items of either kind found
    nowhere; unexpected: items found that neither accounts for."""

    accepted: int
    taken_over: int
    with_results: int
    in_store: int
    in_rings: int
    lost: int
    unexpected: int
    lost_examples: list[int] = field(default_factory=list)
    accepted_by_producer: dict[int, int] = field(default_factory=dict)  # producer id -> items


def published_counts(ledger_entries: list[tuple[int, int]], found: np.ndarray) -> dict[int, int]:
    """How many items each producer published (its sequences 0 .. n-1): the larger of what it
    recorded and one past the highest sequence of it found anywhere (a producer killed
    between publishing a frame and recording it)."""
    counts = {}
    producers = found >> np.uint64(ITEM_ID_SEQ_BITS)
    for producer_id, published in ledger_entries:
        mine = found[producers == np.uint64(producer_id)]
        if mine.size:
            published = max(published, int((mine & np.uint64(MAX_SEQ)).max()) + 1)
        counts[producer_id] = published
    return counts


def accepted_ids(ledger_entries: list[tuple[int, int]], found: np.ndarray) -> np.ndarray:
    """The item ids the producers published (see `published_counts`), in producer order."""
    parts = [np.arange(published, dtype=np.uint64) | np.uint64(make_item_id(producer_id, 0))
             for producer_id, published in published_counts(ledger_entries, found).items()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def take_stock(ledger_entries: list[tuple[int, int]], results: np.ndarray, store: np.ndarray,
               rings: np.ndarray, taken_over: np.ndarray) -> Stock:
    """Compare by id what a run was responsible for (what its producers accepted, and the
    items it took over from an earlier run: `taken_over`, read before its broker started)
    with where items are (arrays of item ids, uint64)."""
    results, store, rings, taken_over = (np.unique(np.asarray(a, dtype=np.uint64))
                                         for a in (results, store, rings, taken_over))
    found = np.union1d(np.union1d(results, store), rings)
    accepted = accepted_ids(ledger_entries, found)
    expected = np.union1d(accepted, taken_over)
    missing = np.setdiff1d(expected, found, assume_unique=True)
    in_store = np.setdiff1d(store, results, assume_unique=True)
    in_rings = np.setdiff1d(rings, np.union1d(results, store), assume_unique=True)
    return Stock(
        accepted=int(accepted.size), taken_over=int(taken_over.size), with_results=int(results.size),
        in_store=int(in_store.size), in_rings=int(in_rings.size), lost=int(missing.size),
        unexpected=int(np.setdiff1d(found, expected, assume_unique=True).size),
        lost_examples=missing[:10].tolist(), accepted_by_producer=published_counts(ledger_entries, found),
    )


def reconcile(summary: ResultsSummary, broker: BrokerStatus, stock: Stock | None = None) -> dict:
    """The run's accounting: received / routed / completed from the broker's status, the
    results files' distinct items and duplicates, and, when the run's stock was taken
    (`inventory.take_stock`: every item found by id with a result, in the store or in a
    producer ring), what is unfinished and what is lost. Without a stock (a live broker,
    `pipeline status`) unfinished is the broker's backlog and pending, and lost is None:
    nothing can be judged before the run ends.

    lost counts items, by id, that the run accepted (or took over from an earlier run) and
    that are nowhere: it is never negative, and a duplicate result can never hide one."""
    accounted = {
        "items_received": broker.items_received_all,
        "tokens_received": broker.tokens_received_all,
        "items_routed": broker.items_routed,
        "tokens_routed": broker.tokens_routed,
        "items_completed": broker.items_completed,
        "tokens_completed": broker.tokens_completed,
        "items_with_results": summary.items,
        "duplicates": summary.duplicates,
        "items_empty": summary.by_status.get("too_long", 0),
        "items_corrupt": summary.by_status.get("corrupt", 0),
        "items_error": summary.by_status.get("error", 0),  # the engine failed them: answered, its message kept
    }
    if stock is None:
        accounted.update(items_unfinished=broker.items_unfinished,
                         items_in_store=None, items_in_rings=None, items_accepted=None, items_taken_over=None,
                         items_accepted_by_producer={},
                         lost=None, items_unexpected=None, lost_examples=[])
        return accounted
    accounted.update(
        items_accepted=stock.accepted, items_taken_over=stock.taken_over,
        items_accepted_by_producer={str(k): v for k, v in stock.accepted_by_producer.items()},
        items_in_store=stock.in_store, items_in_rings=stock.in_rings,
        items_unfinished=stock.in_store + stock.in_rings,
        lost=stock.lost, items_unexpected=stock.unexpected, lost_examples=stock.lost_examples,
    )
    return accounted
