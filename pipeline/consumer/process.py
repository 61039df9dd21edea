"""The consumer process: one per GPU (SPEC §6).

    start the engine (load its model) -> register (four-number contract) -> heartbeat
    thread -> loop:
        while the engine has room: take a batch descriptor from its ring -> map the items'
            tokens from the segment files (zero-copy) -> split each payload's generation
            parameters off (pipeline/wire/generation.py) -> release the descriptor ->
            submit the batch to the engine, in slices by the answers they may hold
            (slices.py: one slice for a batch of ordinary requests)
        poll the engine -> for each slice it finished: write its items' results to the
            results file (one write, all or nothing: results.py) -> for each batch whose
            every slice is written: report the completion

A synchronous engine (sim) runs each batch as it is submitted, so the loop is one batch at
a time. A pipelined one (vllm) gets the next batches while the last ones still run: the
consumer keeps as many in the engine as it can run at once (vLLM's running set: its
max_num_seqs, bounded by what its KV cache holds) and asks the broker for that many
batches plus its credit window, so the engine's scheduler never waits on the consumer, and
nothing more waits inside the engine, where it could not be given to another consumer. A
slow GPU batch never makes the broker declare the consumer dead: heartbeats come from
their own thread. Completions go out in the order batches finish.

A completion is reported only after its results are written: completion means the result
is safe. Items longer than the contract's max input length come back as empty completions
with status "too_long"; nothing is dropped. If the broker goes away, the consumer reconnects
with backoff and registers again; results it wrote for a batch whose completion was lost
stay in the file, and the redelivered batch's results are written again: the run report
counts those duplicates by item id.

When things go wrong:
    broker not there, socket errors, timeouts    reconnect with backoff (RECONNECT_*_S)
    the broker refuses the registration          FATAL: RegistrationRefusedError out of run()
                                                 with the broker's reason (exit status 2);
                                                 the same contract would be refused again
    results disk full (ENOSPC, EDQUOT)           nothing of that slice is kept and its batch
                                                 is not reported complete; say goodbye (the broker
                                                 takes back every batch held, at once), log
                                                 a WARNING, wait RESULTS_FULL_FIRST_WAIT_S,
                                                 doubling up to RESULTS_FULL_MAX_WAIT_S while
                                                 the disk stays full, register again
    any other error writing results              FATAL: goodbye, then ResultsWriteError out
                                                 of run() naming the path and errno
    a segment that cannot be mapped now          hand back (goodbye), WARNING, the same
    (EMFILE, ENOMEM, EACCES: SegmentReadError)   backoff, register again; its items are
                                                 intact, never answered as corrupt
    a segment file gone or cut short             damage: each item answered "corrupt", named


Results file: `results_dir/{name}.jsonl`, one JSON object per item (the format, and the one
function that writes it, `result_lines`: pipeline/consumer/results.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, fields

from pipeline.consumer.config import ConsumerConfig
from pipeline.consumer.credit import CreditWindow, Pace
from pipeline.consumer.engines import Engine, EngineBatch, make_engine
from pipeline.consumer.engines.base import BATCH_TOTALS, CHECK_KEYS, EngineResult
from pipeline.consumer.reader import ReadBatch, SegmentReader
from pipeline.consumer.results import (
    STATUS_CANCELLED,
    STATUS_CORRUPT,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TOO_LONG,
    ResultsFile,
    error_lines,
    result_lines,
)
from pipeline.consumer.session import BrokerSession
from pipeline.consumer.slices import HeldBatch, select_rows
from pipeline.wire.dirpin import DirPin
from pipeline.wire.errors import (
    GenerationParamsError,
    ProtocolError,
    ResultsDiskFullError,
    ResultsWriteError,
    RingClosedError,
    SegmentReadError,
)
from pipeline.wire.generation import GENERATION_MAGIC, GenerationParams, PayloadDecoder
from pipeline.wire.layouts.descriptors import Descriptor, descriptor_size_bytes, parse_descriptor
from pipeline.wire.layouts.names import SEGMENTS_DIR
from pipeline.wire.owners import EndedOwners
from pipeline.wire.protocol import RECONNECT_FIRST_S, RECONNECT_MAX_S
from shm.ring import RingReader
from shm.ring_layout import RECORD_ALIGN_BYTES, RECORD_HEADER_SIZE_BYTES, align_up

log = logging.getLogger("pipeline.consumer")

# How long one wait for a descriptor lasts before the loop checks whether to stop.
POLL_S = 0.2
# How often the consumer unmaps segments the broker deleted (a mapping keeps a deleted
# file's space allocated): about a stat per mapped segment each time, nothing per item.
DROP_DELETED_INTERVAL_S = 1.0

# The key under which `run_batch` returns the item ids it answered "corrupt" (entries that
# failed their checks): the completion names them to the broker.
CORRUPT_KEY = "corrupt_item_ids"

@dataclass(slots=True)
class ConsumerCounters:
    """What this consumer ran (its side of the accounting)."""

    batches: int = 0
    items: int = 0
    items_too_long: int = 0
    items_cancelled: int = 0  # their owner ended: answered without running them
    items_corrupt: int = 0
    items_error: int = 0  # items the engine failed (answered with its message)
    prompt_tokens: int = 0
    reconnects: int = 0
    results_disk_full: int = 0  # batches whose results found the disk full (handed back)
    segment_read_errors: int = 0  # batches whose segments could not be mapped now (handed back)

    def summary(self) -> str:
        """One line for the consumer's log as it stops (what its status row does not say)."""
        return ", ".join(f"{f.name.replace('_', ' ')} {getattr(self, f.name):,}" for f in fields(self))


@dataclass(slots=True)
class FullDiskBackoff:
    """How long to wait before registering again while the results disk is full: `first_s`,
    doubling each time the disk is still full, at most `max_s`; `first_s` again once a
    batch's results were written since the last wait. Pure. Owner: the consumer's main
    thread.

    Example, 1 s and 30 s: waits 1, 2, 4, 8, 16, 30, 30, ...; a batch written, then the disk
    full again: 1.
    """

    first_s: float
    max_s: float
    next_s: float = 0.0
    batches_at_last_wait: int = -1

    def wait_s(self, batches_written: int) -> float:
        """The wait after a failure, given how many batches were written so far."""
        if batches_written != self.batches_at_last_wait:
            self.next_s = self.first_s
            self.batches_at_last_wait = batches_written
        wait = self.next_s
        self.next_s = min(wait * 2, self.max_s)
        return wait


class Consumer:
    """Runs batches for one engine: its GPUs (or the CPU). Owner: the consumer process. Not thread-safe
    apart from the heartbeat thread inside its session."""

    def __init__(self, config: ConsumerConfig, engine: Engine | None = None) -> None:
        if config.gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(config.gpu)  # before any engine touches CUDA
        self.config = config
        self.engine = engine or make_engine(config.engine, **config.engine_options)
        self.results_path = os.path.join(config.results_dir, f"{config.name}.jsonl")
        self._results: ResultsFile | None = None
        try:
            self._open_results()
        except ResultsDiskFullError as exc:  # no room to create it: `run` retries with backoff
            log.warning("%s: results disk full: %s; the consumer waits for space", config.name, exc)
        self.counters = ConsumerCounters()
        self._reader: SegmentReader | None = None
        self._pin: DirPin | None = None  # the data directory as the first session found it
        self._ended = EndedOwners(None)  # whose items are answered unrun: the served data directory's
        self._checks_sent: dict[str, int] = {}  # the engine's check_totals as last reported
        # Slices submitted to the engine, by engine key, and slices waiting for room in it;
        # both of the current session only (the broker takes their batches back at goodbye).
        self._running: dict[int, tuple[HeldBatch, ReadBatch]] = {}
        self._waiting: deque[tuple[int, HeldBatch, ReadBatch, EngineBatch]] = deque()
        self._next_key = 0
        self._payloads = PayloadDecoder()

    def _open_results(self) -> None:
        """Open (or create) the results file; ResultsDiskFullError when there is no room to
        create it (no inode, no directory block), ResultsFileError otherwise."""
        self._results = ResultsFile(self.results_path, fsync=self.config.fsync_results)
        if self._results.torn_tail_found:
            log.warning("%s: %s ended in a torn line (a consumer killed while writing): it is terminated "
                        "where it stands, at byte %d, and counted as a bad line by the accounting",
                        self.config.name, self.results_path, self._results.size_at_open_bytes)

    def run(self, stop) -> None:
        """Serve batches until `stop()` is true, reconnecting whenever the broker goes away.
        Raises RegistrationRefusedError (the broker refused this consumer) and
        ResultsWriteError (results cannot be written, the disk being full aside): both are
        fatal. The engine, the results file and the segment maps are closed either way. The
        engine starts (loads its model) before the first registration."""
        try:
            self.engine.start()
            self._serve_sessions(stop)
        finally:
            self.engine.close()  # an engine's own processes (vLLM's engine core) stop with the consumer
            if self._results is not None:
                self._results.close()
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            log.info("%s: stopping: %s", self.config.name, self.counters.summary())

    def _serve_sessions(self, stop) -> None:
        backoff = RECONNECT_FIRST_S
        full_disk = FullDiskBackoff(self.config.results_full_first_wait_s, self.config.results_full_max_wait_s)
        cannot_read = FullDiskBackoff(self.config.results_full_first_wait_s, self.config.results_full_max_wait_s)
        while not stop():
            if self._results is None:
                try:
                    self._open_results()
                except ResultsDiskFullError as exc:
                    pause_s = full_disk.wait_s(self.counters.batches)
                    log.warning("%s: results disk full: %s; retrying in %g s", self.config.name, exc, pause_s)
                    _sleep_unless(stop, pause_s)
                    continue
            try:
                session = BrokerSession(self.config)
            except (OSError, ProtocolError, TimeoutError) as exc:
                log.info("%s: broker not reachable (%s); retrying in %.2f s", self.config.name, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                continue
            backoff = RECONNECT_FIRST_S
            pause_s = 0.0
            try:
                self._results.sync_writes(session.durability == "power" or self.config.fsync_results)
                self._serve(session, stop)
            except ResultsDiskFullError as exc:
                self.counters.results_disk_full += 1
                held = session.hand_back()
                self._unmap_segments()  # holding nothing now: let the deleted ones' space go
                pause_s = full_disk.wait_s(self.counters.batches)
                log.warning("%s: results disk full: %s; handing back %d batches, retrying in %g s",
                            self.config.name, exc, held, pause_s)
            except ResultsWriteError:
                session.hand_back()
                raise
            except SegmentReadError as exc:  # the entries are intact: never answer them as corrupt
                self.counters.segment_read_errors += 1
                held = session.hand_back()
                self._unmap_segments()
                pause_s = cannot_read.wait_s(self.counters.batches)
                log.warning("%s: %s; handing back %d batches, retrying in %g s", self.config.name, exc, held, pause_s)
            except (OSError, ConnectionError, RingClosedError, TimeoutError, ProtocolError) as exc:
                log.warning("%s: lost the broker (%s); reconnecting", self.config.name, exc)
                self.counters.reconnects += 1
            finally:
                session.close()
            if pause_s:
                _sleep_unless(stop, pause_s)

    def _unmap_segments(self) -> None:
        """Drop every segment mapping (the consumer holds no batch): a mapping keeps a deleted
        segment's space allocated, and a consumer backing off from a full results disk that
        kept 70 deleted segments mapped held 11 MB of the disk its results needed."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _serve(self, session: BrokerSession, stop) -> None:
        if self._pin is None or self._pin.path != session.data_dir:
            self._pin = DirPin.take(session.data_dir)  # the first time: the folder the broker serves
        if self._reader is None or self._reader.root != os.path.join(session.data_dir, SEGMENTS_DIR):
            self._reader = SegmentReader(session.data_dir, pin=self._pin)
            self._ended = EndedOwners(session.data_dir)
        credit = self._credit_window(session.ring)
        session.send({"type": "request_work", "credit": credit.start()})
        pace = Pace()
        in_flight: dict[int, HeldBatch] = {}
        sweep_s = time.monotonic() + DROP_DELETED_INTERVAL_S
        try:
            while not stop():
                if time.monotonic() >= sweep_s:
                    self._reader.drop_deleted()  # a deleted segment's space is freed only once unmapped
                    sweep_s = time.monotonic() + DROP_DELETED_INTERVAL_S
                done = self._feed(session, in_flight)
                polled = self.engine.poll()
                if done or polled:
                    # Woken from a SIGSTOP declared dead, the broker gave these batches to
                    # another consumer: their results must not be written here too.
                    session.check_open()
                done += [started for key, result in polled if (started := self._slice_ended(key, result))]
                for started in done:  # held in in_flight until completed (hand_back counts it)
                    summary = self.finish_batch(started)
                    self._complete(session, credit, pace, started, summary)
                    del in_flight[started.descriptor.batch_id]
        finally:
            session.in_engine = len(in_flight)  # hand_back's count
            dropped = self.engine.abort()  # unfinished: the broker takes them back at goodbye
            self._running.clear()
            self._waiting.clear()
            if dropped:
                log.info("%s: %d slices of batches left unfinished in the engine; the broker hands them out again",
                         self.config.name, len(dropped))
        session.send({"type": "goodbye"})

    def _feed(self, session: BrokerSession, in_flight: dict[int, HeldBatch]) -> list[HeldBatch]:
        """Give the engine slices of batches from the ring while it has room (a synchronous
        engine runs each here), waiting up to POLL_S for a batch only while nothing is in
        flight. Returns the batches with nothing for the engine (every item too long or
        corrupt), done already."""
        ready: list[HeldBatch] = []
        while self.engine.wants_more():
            if self._waiting:
                self._submit(*self._waiting.popleft())
                continue
            record = session.ring.peek(timeout_s=0 if in_flight else POLL_S)
            if record is None:
                session.check_open()  # a broker that went away is noticed within POLL_S
                return ready
            # A consumer that was stopped (SIGSTOP) may wake up declared dead, its batches
            # given to others: it must not run what is left in its old ring.
            session.check_open()
            descriptor = parse_descriptor(record.body, where=f"ring {session.ring.name} at {record.start}")
            started = self.start_batch(descriptor)
            session.ring.release(record.end)  # start_batch copied what it needs of the record
            in_flight[descriptor.batch_id] = started
            slices = started.slices(self.config.max_input_len)
            for part, batch in slices:
                self._waiting.append((self._next_key, started, part, batch))
                self._next_key += 1
            if not slices:
                ready.append(started)
        return ready

    def _submit(self, key: int, started: HeldBatch, part: ReadBatch, batch: EngineBatch) -> None:
        self._running[key] = (started, part)
        self.engine.submit(key, batch)

    def _slice_ended(self, key: int, result: EngineResult) -> HeldBatch | None:
        """Write an ended slice's lines (with any of its batch's not written yet); its batch
        once every slice of it ended, else None. A failed write raises ResultsWriteError
        (ResultsDiskFullError for a full disk) with nothing of the slice in the file."""
        started, part = self._running.pop(key)
        ok, failed = self._engine_lines(started, part, result)
        self._write(started.lines)
        started.lines.clear()
        started.statuses[STATUS_OK] += ok
        started.statuses[STATUS_ERROR] += failed
        started.counted.add(result.counted)
        started.slices_left -= 1
        return started if started.slices_left == 0 else None

    def _complete(self, session: BrokerSession, credit: CreditWindow, pace: Pace, started: HeldBatch,
                  summary: dict) -> None:
        """Report a batch whose results are written, with the credit it returns."""
        now_s = time.monotonic()
        credit.floor = pace.completed(started.started_s, now_s, len(started.descriptor.items),
                                      self.engine.max_running_prompts(), credit.min_credit)
        grant = credit.completed(pace.batch_s)
        completion = {"type": "complete", "batch_id": started.descriptor.batch_id, "results": summary,
                      "credit": grant}
        corrupt = summary.pop(CORRUPT_KEY)
        if corrupt:  # the broker keeps their segment as evidence (quarantine/), never deletes it
            completion["corrupt"] = corrupt
        session.send(completion)

    def _credit_window(self, ring: RingReader) -> CreditWindow:
        """A fixed window when the config names one, else one sized from batch times; never
        more batches than the descriptor ring surely holds (`descriptors_that_fit`): more
        would make the broker peek batches it cannot hand over."""
        fits = descriptors_that_fit(ring.capacity_bytes, self.config.max_batch_items)
        if self.config.credit is not None:
            return CreditWindow.fixed(min(self.config.credit, fits))
        return CreditWindow(self.config.ahead_s, min(self.config.credit_min_batches, fits),
                            min(self.config.credit_max_batches, fits))

    def run_batch(self, descriptor: Descriptor) -> dict:
        """Run one batch to the end and write its results; return the completion's summary
        (`finish_batch`). The serving loop does the same in steps, many batches at once."""
        started = self.start_batch(descriptor)
        for part, batch in started.slices(self.config.max_input_len):
            self._running[self._next_key] = (started, part)
            self._slice_ended(self._next_key, self.engine.run(batch))
            self._next_key += 1
        return self.finish_batch(started)

    def start_batch(self, descriptor: Descriptor) -> HeldBatch:
        """Read a batch's entries and answer those the engine will not run: corrupt ones
        (failed their checks), too long ones (over the contract's max input length), ones
        whose owner ended (STATUS_CANCELLED: a cancelled batch's, `wire/owners.py`), and
        ones whose generation envelope is malformed (STATUS_ERROR). Copies what it keeps of
        the descriptor: its ring record may be released once this returns."""
        got = self._reader.read_batch(descriptor.model, descriptor.signature, descriptor.items)
        started = HeldBatch(dataclasses.replace(descriptor, items=descriptor.items.copy()), ReadBatch(),
                           time.monotonic(), spans=got.spans)
        corrupt_lengths: list[int] = []
        for item_id, length, exc in got.failed:
            log.error("%s: %s", self.config.name, exc)
            started.corrupt.append(item_id)
            corrupt_lengths.append(length)
        if started.corrupt:  # no output, no payload, no submit time (the entry could not be read)
            nothing = [0] * len(started.corrupt)
            started.lines.append(result_lines(descriptor, STATUS_CORRUPT, started.corrupt, nothing, corrupt_lengths,
                                              nothing, [[]] * len(nothing), [b""] * len(nothing)))
            started.statuses[STATUS_CORRUPT] = len(nothing)
        got, params = self._split_payloads(started, got)
        self._ended.refresh()
        ended = self._ended.positions(got.payloads)
        if ended:
            got, params = _set_aside(started, got, params, ended, STATUS_CANCELLED)
        limit = self.config.max_input_len
        if got.lengths and max(got.lengths) > limit:
            got, params = _set_aside(started, got, params, [i for i, n in enumerate(got.lengths) if n > limit],
                                     STATUS_TOO_LONG)
        started.got = got
        started.params = params if any(p is not None for p in params) else []
        return started

    def _split_payloads(self, started: HeldBatch, got: ReadBatch) -> tuple[ReadBatch, list[GenerationParams | None]]:
        """The items' own payloads and generation parameters (pipeline/wire/generation.py);
        items whose envelope is malformed are answered with the error and left out."""
        if not any(got.payloads):  # no item carries a payload (token-id producers): nothing to split
            return got, [None] * len(got.payloads)
        params: list[GenerationParams | None] = []
        bad: list[int] = []
        messages: list[str] = []
        for i, payload in enumerate(got.payloads):
            if payload[:4] != GENERATION_MAGIC:
                params.append(None)
                continue
            try:
                item_params, got.payloads[i] = self._payloads.decode(payload)
            except GenerationParamsError as exc:
                bad.append(i)
                messages.append(f"item {got.item_ids[i]}: {exc}")
                item_params = None
            params.append(item_params)
        if not bad:
            return got, params
        wrong = select_rows(got, bad)
        started.lines.append(error_lines(started.descriptor, wrong.item_ids, wrong.submit_ns, wrong.lengths, messages,
                                         [b""] * len(bad), wrong.digests))
        started.statuses[STATUS_ERROR] += len(bad)
        log.warning("%s: batch %d: %d items with malformed generation parameters, first: %s", self.config.name,
                    started.descriptor.batch_id, len(bad), messages[0])
        excluded = set(bad)
        keep = [i for i in range(len(got.item_ids)) if i not in excluded]
        return select_rows(got, keep), [params[i] for i in keep]

    def finish_batch(self, started: HeldBatch) -> dict:
        """Write a batch's result lines not written yet (each slice's were as it ended) and
        return the completion's summary: items by status, what the engine counted over the
        batch, its own counters' check, and CORRUPT_KEY. A failed write raises
        ResultsWriteError (ResultsDiskFullError for a full disk) with nothing counted."""
        if started.lines:
            self._write(started.lines)
            started.lines.clear()
        self._reader.release(started.spans)
        c = self.counters
        c.batches += 1
        c.items += sum(started.statuses.values())
        c.items_too_long += started.statuses[STATUS_TOO_LONG]
        c.items_cancelled += started.statuses[STATUS_CANCELLED]
        c.items_corrupt += started.statuses[STATUS_CORRUPT]
        c.items_error += started.statuses[STATUS_ERROR]
        c.prompt_tokens += sum(started.got.lengths)
        check = self.engine.check_totals()
        summary = {**{f"items_{k}": v for k, v in started.statuses.items()},
                   **{k: getattr(started.counted, k) for k in BATCH_TOTALS},
                   **{k: check.get(k, 0) - self._checks_sent.get(k, 0) for k in CHECK_KEYS},
                   CORRUPT_KEY: started.corrupt}
        self._checks_sent = check
        return summary

    def _engine_lines(self, started: HeldBatch, got: ReadBatch, result: EngineResult) -> tuple[int, int]:
        """Append the lines of the items the engine ran in one slice (`got`): STATUS_OK, and
        STATUS_ERROR with the engine's message for items it failed (EngineResult.errors; an
        engine error is that item's answer, never a lost item or a crashed consumer).
        Returns (ok, failed)."""
        d = started.descriptor
        result.fail_long_texts()
        failed = [i for i, error in enumerate(result.errors or ()) if error is not None]
        if not failed:
            started.lines.append(result_lines(d, STATUS_OK, got.item_ids, got.submit_ns, got.lengths,
                                              result.cached_tokens, result.outputs, got.payloads,
                                              result.finish_reasons, result.texts, got.digests, result.samples,
                                              result.embeddings))
            return len(got.item_ids), 0
        assert result.errors is not None
        bad = select_rows(got, failed)
        started.lines.append(error_lines(d, bad.item_ids, bad.submit_ns, bad.lengths,
                                         [str(result.errors[i]) for i in failed], bad.payloads, bad.digests))
        log.warning("%s: batch %d: the engine failed %d of %d items, first: %s", self.config.name,
                    d.batch_id, len(failed), len(got.item_ids), result.errors[failed[0]])
        ran = [i for i, error in enumerate(result.errors) if error is None]
        good = select_rows(got, ran)
        texts = [result.texts[i] for i in ran] if result.texts is not None else None
        samples = [result.samples[i] for i in ran] if result.samples is not None else None
        embeddings = [result.embeddings[i] for i in ran] if result.embeddings is not None else None
        started.lines.append(result_lines(d, STATUS_OK, good.item_ids, good.submit_ns, good.lengths,
                                          [result.cached_tokens[i] for i in ran], [result.outputs[i] for i in ran],
                                          good.payloads, [result.finish_reasons[i] for i in ran], texts,
                                          good.digests, samples, embeddings))
        return len(ran), len(failed)

    def _write(self, lines: list[str]) -> None:
        # One os.write: in the page cache when it returns (survives kill -9 of this
        # process), on disk too with fsync_results. The lines are ASCII (see `result_lines`).
        assert self._results is not None, "run() opens the results file before serving"
        self._results.write(("\n".join(lines) + "\n").encode())


def _sleep_unless(stop, seconds: float) -> None:
    """Sleep `seconds`, waking every POLL_S to return early once `stop()` is true."""
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, POLL_S))


def descriptors_that_fit(capacity_bytes: int, max_batch_items: int) -> int:
    """How many descriptors of `max_batch_items` items a descriptor ring of `capacity_bytes`
    always holds, wherever its write position: k records and, at worst, the tail a wrap
    wastes (less than one record) must fit, k * record + record - RECORD_ALIGN_BYTES <=
    capacity. At least 1 (registration refuses a contract whose descriptor does not fit).

    Example: 1 MiB ring, 1,024 items: a record is 32,832 bytes, so 31 fit side by side
    but only 30 whatever the wrap."""
    record = RECORD_HEADER_SIZE_BYTES + align_up(descriptor_size_bytes(max_batch_items))
    return max(1, (capacity_bytes - record + RECORD_ALIGN_BYTES) // record)


def _set_aside(started: HeldBatch, got: ReadBatch, params: list, positions: list[int],
               status: str) -> tuple[ReadBatch, list]:
    """Answer the items at `positions` of `got` with `status` and no output (the engine does
    not run them); the rest of `got`, and their parameters."""
    aside = select_rows(got, positions)
    count = len(aside.item_ids)
    started.lines.append(result_lines(started.descriptor, status, aside.item_ids, aside.submit_ns, aside.lengths,
                                      [0] * count, [[]] * count, aside.payloads, digests=aside.digests))
    started.statuses[status] += count
    excluded = set(positions)
    keep = [i for i in range(len(got.item_ids)) if i not in excluded]
    return select_rows(got, keep), [params[i] for i in keep]
