"""Accounting that proves nothing is lost: the results files against the broker's counters.

The broker counts items and tokens received (stored), routed (dispatched; a redelivery
counts again) and completed. The consumers' results files hold one line per item they ran;
an item with two lines was redelivered after a lost completion (a duplicate, at-least-once
delivery), which is counted, never hidden. At the end of a run:

    lost = received - |unfinished or with a result|                     must be 0
         = received - unfinished - distinct items with a result + unfinished items with one
    (unfinished: still queued or dispatched in the broker, 0 once a run has completed; an
    unfinished item can have a result when its consumer wrote it and died before reporting
    the completion: the item is redelivered later, and counted once here)
    received = completed (broker, over this broker's life) and tokens likewise
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from pipeline.errors import ResultsFileError


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
    torn_lines: int = 0  # a last line cut short (a consumer killed mid-write): not a result


def summarize_results(results_dir: str) -> ResultsSummary:
    """Read every `*.jsonl` results file of a run (one per consumer)."""
    summary = ResultsSummary()
    seen: Counter[int] = Counter()
    status: Counter[str] = Counter()
    if not os.path.isdir(results_dir):
        return summary
    for name in sorted(os.listdir(results_dir)):
        if not name.endswith(".jsonl"):
            continue
        consumer = name[: -len(".jsonl")]
        mine = summary.per_consumer.setdefault(consumer, {"lines": 0, "prompt_tokens": 0, "cached_tokens": 0})
        path = os.path.join(results_dir, name)
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
    summary.lines = sum(seen.values())
    summary.items = len(seen)
    summary.duplicates = summary.lines - summary.items
    summary.by_status = dict(status)
    summary.item_ids = set(seen)
    return summary


def _rows(path: str, summary: ResultsSummary):
    """The result rows of one file. A last line without its newline that is not JSON was cut
    short by a kill: counted in `torn_lines` (that batch was never completed, so it comes
    back); any other bad line raises ResultsFileError naming the file and line."""
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                if not line.endswith("\n") and not file.read(1):
                    summary.torn_lines += 1
                    return
                raise ResultsFileError(f"{path}:{number}: not a result line ({exc})") from exc


def reconcile(summary: ResultsSummary, broker: dict, expected_items: int | None = None,
              unfinished_ids: set[int] | None = None) -> dict:
    """The run's accounting: received / routed / completed from the broker's status, the
    results files' distinct items and duplicates, and `lost` (received but no result).
    `unfinished_ids`: the item ids still in the store when the status was taken, if read
    (then unfinished items that already have a result are counted once, not twice)."""
    received = broker["items_received"] + broker.get("items_recovered", 0)
    # Still queued or dispatched when the status was taken (a run stopped early): not lost,
    # they are in the store. Zero at the end of a completed run, where `lost` is exact.
    unfinished = broker.get("backlog_items", 0) + broker.get("pending_items", 0)
    with_results = len(unfinished_ids & summary.item_ids) if unfinished_ids else 0
    accounted = {
        "items_received": received,
        "tokens_received": broker["tokens_received"] + broker.get("tokens_recovered", 0),
        "items_routed": broker["items_routed"],
        "tokens_routed": broker["tokens_routed"],
        "items_completed": broker["items_completed"],
        "tokens_completed": broker["tokens_completed"],
        "items_with_results": summary.items,
        "duplicates": summary.duplicates,
        "items_unfinished": unfinished,
        "items_unfinished_with_results": with_results,
        "lost": (received - unfinished + with_results if expected_items is None else expected_items) - summary.items,
        "items_empty": summary.by_status.get("too_long", 0),
        "items_corrupt": summary.by_status.get("corrupt", 0),
    }
    return accounted
