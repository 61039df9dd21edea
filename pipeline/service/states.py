"""A batch's life as OpenAI's Batch object shows it: its status, the time of each step, and
why it is stopping (a cancel, its deadline). Pure: the scheduler passes the time in.

    validating ──running──► in_progress ──answered──► finalizing ──finalized──► completed
        │  (waiting for a slot,  │
        │   or its job checks    ├──cancel──► cancelling ──finalized──► cancelled
        │   its input)           ├──expire──► (stop: expire) ──finalized──► expired
        └── the same three ──────┴──failed──► failed

`cancel` and `expire` say the batch is to stop; its status changes again only once what was
answered is in its output and error files (`finalized`), so a terminal status always has
its files. A batch whose every request is answered before a stop lands finishes by it: a
cancel still ends `cancelled` (with a whole output), a passed deadline ends `completed`
(the work is done; nothing is left to expire).
"""

from __future__ import annotations

from dataclasses import dataclass

VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
ACTIVE = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
TERMINAL = (COMPLETED, FAILED, EXPIRED, CANCELLED)
STATUSES = ACTIVE + TERMINAL
# Statuses in which the batch's job may still run (waiting for a slot counts).
RUNNABLE = (VALIDATING, IN_PROGRESS)

# Why a batch stops before every request is answered.
STOP_CANCEL = "cancel"
STOP_EXPIRE = "expire"

# Events.
RUNNING = "running"  # its job runs past its input's check
ANSWERED = "answered"  # every request has its answer
CANCEL = "cancel"  # the user asked
EXPIRE = "expire"  # its deadline passed
FAIL = "fail"  # its job failed for good
FINALIZED = "finalized"  # its output and error files are written
EVENTS = (RUNNING, ANSWERED, CANCEL, EXPIRE, FAIL, FINALIZED)

# Each status's time field, as OpenAI names them (validating's is created_at).
STAMPS = {IN_PROGRESS: "in_progress_at", FINALIZING: "finalizing_at", COMPLETED: "completed_at",
          FAILED: "failed_at", EXPIRED: "expired_at", CANCELLING: "cancelling_at", CANCELLED: "cancelled_at"}
# The terminal status a stop ends in.
STOP_ENDS = {STOP_CANCEL: CANCELLED, STOP_EXPIRE: EXPIRED}


class TransitionError(ValueError):
    """An event the batch's status does not take (a cancel of a completed batch): the API
    layer checks `takes` first and answers the client; the scheduler never sends one."""


@dataclass(slots=True)
class Lifecycle:
    status: str
    created_at: int
    expires_at: int
    stop: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @classmethod
    def new(cls, now: int, window_s: int) -> Lifecycle:
        return cls(VALIDATING, now, now + window_s)

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def takes(self, event: str) -> bool:
        """Whether `event` is one this batch takes now (an ignored repeat counts)."""
        status, stop = self.status, self.stop
        if event == RUNNING:
            return status in RUNNABLE
        if event == ANSWERED:
            return status in RUNNABLE or status == CANCELLING
        if event == CANCEL:
            return status in RUNNABLE or status == CANCELLING
        if event == EXPIRE:
            return status in RUNNABLE
        if event == FAIL:
            return status in RUNNABLE
        if event == FINALIZED:
            return status in (FINALIZING, CANCELLING) or (status in RUNNABLE and stop == STOP_EXPIRE)
        raise TransitionError(f"unknown event {event!r}")

    def due(self, now: int) -> bool:
        """Whether its deadline passed and it is not stopping yet."""
        return now >= self.expires_at and self.status in RUNNABLE and self.stop is None

    def step(self, event: str, now: int) -> None:
        """Apply `event` at `now` (TransitionError where `takes` says no)."""
        if not self.takes(event):
            raise TransitionError(f"a {self.status} batch cannot take {event!r}")
        status = self.status
        if event == RUNNING:
            if status == VALIDATING:
                self._enter(IN_PROGRESS, now)
        elif event == ANSWERED:
            if status != CANCELLING:
                self.stop = None  # a passed deadline with every answer in: done, not expired
                self._enter(FINALIZING, now)
        elif event == CANCEL:
            if status != CANCELLING:
                self.stop = STOP_CANCEL
                self._enter(CANCELLING, now)
        elif event == EXPIRE:
            self.stop = self.stop or STOP_EXPIRE
        elif event == FAIL:
            self.stop = None
            self._enter(FAILED, now)
        else:
            self._enter(COMPLETED if status == FINALIZING else STOP_ENDS[self.stop], now)

    def _enter(self, status: str, now: int) -> None:
        """`status` from `now`, never before an earlier step (a wall clock set back)."""
        self.status = status
        earlier = [t for t in self.stamps().values() if t is not None]
        setattr(self, STAMPS[status], max(now, self.created_at, *earlier))

    def stamps(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in STAMPS.values()}

    def check_invariants(self) -> None:
        assert self.status in STATUSES, self.status
        assert self.expires_at >= self.created_at
        stamps = self.stamps()
        assert all(t is None or t >= self.created_at for t in stamps.values()), stamps
        if self.status != VALIDATING:
            assert stamps[STAMPS[self.status]] is not None, (self.status, stamps)
        ends = [status for status in TERMINAL if stamps[STAMPS[status]] is not None]
        assert ends == ([self.status] if self.ended else []), (self.status, ends)
        expected_stop = {CANCELLING: (STOP_CANCEL,), CANCELLED: (STOP_CANCEL,), EXPIRED: (STOP_EXPIRE,),
                         VALIDATING: (None, STOP_EXPIRE), IN_PROGRESS: (None, STOP_EXPIRE)}
        assert self.stop in expected_stop.get(self.status, (None,)), (self.status, self.stop)
        if self.cancelled_at is not None:
            assert self.cancelling_at is not None and self.cancelling_at <= self.cancelled_at
        if self.completed_at is not None:
            assert self.finalizing_at is not None and self.finalizing_at <= self.completed_at
        end = next((stamps[STAMPS[s]] for s in ends), None)
        if end is not None and self.in_progress_at is not None:
            assert self.in_progress_at <= end
