"""Feeding a `History` from the outside world: the workload the producers submitted, the
results files the consumers wrote, and what the store and the producer rings still hold.

    history = attempted(workload)                 # every item, keyed by its payload
    history.acknowledge_all()                     # or acknowledge(key) per submit that returned
    deliver_results(history, results_dir)         # every line of every results file
    hold_leftovers(history, data_dir)             # live entries and unstored ring records
    verdict = history.verdict(duplicate_bound=in_flight)
"""

from __future__ import annotations

import base64
import binascii
import os

import numpy as np

from pipeline.batchjob.layout import item_key
from pipeline.producer.workload import Workload
from pipeline.audit.checker import History, ItemKey
from pipeline.reporting.accounting import result_rows
from pipeline.runtime.inventory import pending_payloads, producer_ring_names
from pipeline.wire.errors import ResultsFileError
from pipeline.wire.errors import GenerationParamsError
from pipeline.wire.generation import decode_payload
from pipeline.wire.layouts.segments import prompt_digest


def stored_own_payload(payload: bytes) -> bytes:
    """A stored payload without its generation envelope: the producer's own (the key)."""
    try:
        return decode_payload(payload)[1]
    except GenerationParamsError:
        return payload


def attempted(workload: Workload) -> History:
    """A History with every item of `workload` attempted, keyed by its payload, with the
    digest of its whole prompt (components, then suffix). A workload whose payloads do not
    name items apart cannot be checked by key: AssertionError names the first repeat."""
    history = History()
    for item in workload:
        prompt = np.concatenate([*item.components, item.suffix]) if item.components else item.suffix
        history.attempt(ItemKey(item_key(item.payload)), prompt_digest(prompt))
    return history


def deliver_results(history: History, results_dir: str) -> int:
    """Every results line of `results_dir`'s files into `history`; returns the lines read.
    A line whose payload is not base64 is an unexpected delivery (its key is unreadable)."""
    lines = 0
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if not name.endswith(".jsonl"):
            continue
        for row in result_rows(os.path.join(results_dir, name)):
            lines += 1
            digest = row.get("prompt_xxh3")
            try:
                key = base64.b64decode(row.get("payload") or "", validate=True)
            except (binascii.Error, TypeError) as exc:
                raise ResultsFileError(f"{results_dir}/{name}: item {row.get('item_id')}: payload is not base64 "
                                       f"({exc})") from None
            history.deliver(ItemKey(item_key(key)), str(row["status"]), digest if isinstance(digest, int) else None)
    return lines


def hold_leftovers(history: History, data_dir: str) -> int:
    """Every live store entry and unstored producer-ring record of `data_dir` into `history`
    as held; returns how many were found."""
    found = dict(pending_payloads(data_dir, producer_ring_names(data_dir)))  # an item in store and ring: once
    for payload in found.values():
        history.hold(ItemKey(item_key(stored_own_payload(payload))))
    return len(found)


def results_dirs(data_dir: str) -> list[str]:
    """Every run's results directory under `data_dir/results` (launch writes one per run;
    the stage commands and run-batch write into `results` itself)."""
    top = os.path.join(data_dir, "results")
    if not os.path.isdir(top):
        return []
    found = [top] + [os.path.join(top, name) for name in sorted(os.listdir(top))]
    return [path for path in found if os.path.isdir(path)]


def check_data_dir(workload: Workload, data_dir: str, duplicate_bound: int | None = None):
    """The verdict on every run on `data_dir` of `workload`, all of it acknowledged (the
    producers returned): every results file of every run, and what is left in the store."""
    history = attempted(workload)
    history.acknowledge_all()
    for path in results_dirs(data_dir):
        deliver_results(history, path)
    hold_leftovers(history, data_dir)
    return history.verdict(duplicate_bound)
