"""The total-queue checker (Jepsen's idea): from what producers attempted and had
acknowledged, and what the results and the store hold afterwards, count each item's fate.

Items are named by a key of the producer's own (its payload: a workload's line number, a
batch job's request index), never by the broker's numbering, so a checker is independent of
the code it checks; each attempted item carries the digest of its prompt
(`pipeline.wire.layouts.prompt_digest`), and each results line the digest of what the engine
was given (`prompt_xxh3`).

    attempted       keys the producers tried to submit
    acknowledged    of those, keys whose submit returned (the product owes them an answer)
    completed       keys with at least one results line whose digest matches
    held            keys still live in the store or a producer ring (the next run on the data
                    directory completes them): not lost, not yet completed
    lost            acknowledged keys neither completed nor held                  must be 0
    unexpected      results lines whose key was never attempted                   must be 0
    corrupt         results lines whose digest differs from the attempted one's   must be 0
    detected        results lines with status `corrupt` (the consumer's checks caught
                    damage; the item has no answer from them; reported, not failed)
    duplicated      results lines beyond the first per key (at-least-once delivery)
                    passes when within `duplicate_bound` (items in flight at the fault)

Pure: no I/O, no clock (`pipeline.audit.sources` reads the files). Owner: one campaign
step; not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NewType

# An item's name as its producer gave it (the payload bytes).
ItemKey = NewType("ItemKey", bytes)
# The status a results line has when the consumer found the entry damaged (no tokens read).
CORRUPT_STATUS = "corrupt"
# Keys named per kind of failure in a verdict: enough to start debugging, bounded in size.
MAX_EXAMPLES = 10


@dataclass(slots=True)
class Verdict:
    attempted: int
    acknowledged: int
    completed: int
    held: int
    lost: int
    unexpected: int
    corrupt: int
    detected: int
    duplicated: int
    duplicate_bound: int | None
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        within = self.duplicate_bound is None or self.duplicated <= self.duplicate_bound
        return self.lost == 0 and self.unexpected == 0 and self.corrupt == 0 and within

    def line(self) -> str:
        """One line for a log or a campaign table."""
        bound = "" if self.duplicate_bound is None else f" (bound {self.duplicate_bound:,})"
        return (f"{'PASS' if self.passed else 'FAIL'}: attempted {self.attempted:,}, acknowledged "
                f"{self.acknowledged:,}, completed {self.completed:,}, held {self.held:,}, lost {self.lost:,}, "
                f"unexpected {self.unexpected:,}, corrupt {self.corrupt:,}, detected {self.detected:,}, "
                f"duplicated {self.duplicated:,}{bound}")


class History:
    """What one campaign run attempted and what came of it."""

    def __init__(self) -> None:
        self._digests: dict[ItemKey, int] = {}  # attempted key -> prompt digest
        self._acknowledged: set[ItemKey] = set()
        self._lines: Counter[ItemKey] = Counter()  # results lines per attempted key
        self._good_lines = 0  # lines whose digest matched
        self._completed: set[ItemKey] = set()
        self._held: set[ItemKey] = set()
        self._unexpected: list[ItemKey] = []
        self._corrupt: list[ItemKey] = []
        self._detected: list[ItemKey] = []

    def attempt(self, key: ItemKey, digest: int) -> None:
        assert key not in self._digests, f"key {key!r} attempted twice: keys must name items apart"
        self._digests[key] = digest

    def acknowledge(self, key: ItemKey) -> None:
        assert key in self._digests, f"key {key!r} acknowledged but never attempted"
        self._acknowledged.add(key)

    def acknowledge_all(self) -> None:
        """Every attempted item was acknowledged (a run whose producers all returned)."""
        self._acknowledged.update(self._digests)

    def deliver(self, key: ItemKey, status: str, digest: int | None) -> None:
        """One results line (every line, duplicates included)."""
        if key not in self._digests:
            self._unexpected.append(key)
            return
        self._lines[key] += 1
        if status == CORRUPT_STATUS:
            self._detected.append(key)
        elif digest != self._digests[key]:
            self._corrupt.append(key)
        else:
            self._completed.add(key)
            self._good_lines += 1

    def hold(self, key: ItemKey) -> None:
        """A live entry of the store or a producer ring after the run."""
        if key not in self._digests:
            self._unexpected.append(key)
        else:
            self._held.add(key)

    def lost_keys(self) -> list[ItemKey]:
        """Acknowledged keys neither completed nor held, sorted."""
        return sorted(self._acknowledged - self._completed - self._held)

    def verdict(self, duplicate_bound: int | None = None) -> Verdict:
        lost = self.lost_keys()
        duplicated = sum(n - 1 for n in self._lines.values() if n > 1)
        dupes = [k for k, n in self._lines.items() if n > 1]
        examples = {name: [_show(k) for k in keys[:MAX_EXAMPLES]] for name, keys in
                    (("lost", lost), ("unexpected", self._unexpected), ("corrupt", self._corrupt),
                     ("detected", self._detected), ("duplicated", dupes)) if keys}
        return Verdict(len(self._digests), len(self._acknowledged), len(self._completed), len(self._held - self._completed),
                       len(lost), len(self._unexpected), len(self._corrupt), len(self._detected), duplicated,
                       duplicate_bound, examples)

    def check_invariants(self) -> None:
        assert self._acknowledged <= self._digests.keys()
        assert self._completed <= self._digests.keys() and self._held <= self._digests.keys()
        assert all(self._lines[k] >= 1 for k in self._completed)
        assert sum(self._lines.values()) == self._good_lines + len(self._corrupt) + len(self._detected)
        assert self._good_lines >= len(self._completed)


def _show(key: bytes) -> str:
    text = key.decode("utf-8", "backslashreplace")
    return text if len(text) <= 64 else text[:61] + "..."
