"""Kill campaigns through the stage commands: kill -9 of the broker at
random moments and at each named crash point, faults of consumers (SIGKILL, SIGSTOP then
SIGCONT after the heartbeat timeout, the control socket shut down under it), kill -9 of a
producer while it submits. After each fault the stage is started again the way a user (or
a supervisor) would: `pipeline broker start`, `pipeline consumer start`, `pipeline produce`
of what was never submitted. At the end `pipeline tools check` judges every item of every
workload the campaign wrote (lost = unexpected = corrupt = 0, duplicates within the bound:
faults x items in flight at one).

Figures: restart-to-serving (broker killed, or found dead at its crash point, to a new
broker answering on its socket: recovered, caught up, serving), and redelivery latency
(consumer lost to its batch completed again; `lab.reliability.timing`).

Owner: one caller at a time per work directory; processes it starts are stopped before
it returns.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from pipeline.producer.feed import DEFAULT_CHUNK_ITEMS
from lab.reliability.procs import (
    COMMAND_TIMEOUT_S,
    Stages,
    gone,
    kill,
    pipeline,
    spawn,
    wait_until,
    write_workload,
)
from pipeline.audit.sources import results_dirs
from lab.reliability.timing import Line, Loss, percentiles, redeliveries
from pipeline.reporting.accounting import result_rows

# An armed broker that has not reached its crash point after this long is killed instead
# (and the point reported as not reached in this run).
CRASH_WAIT_S = 5.0
# Random broker kills land this long after the broker serves, at most (uniform from 0).
MAX_KILL_GAP_S = 0.6
# The syscall that copies another process's descriptor (Linux 5.6; x86-64 and arm64 share it).
SYS_PIDFD_GETFD = 438
CONSUMER_FAULTS = ("kill", "stop", "socket")
# What `pipeline produce` says when a producer failed: how many of the file's items to submit again.
NEVER_SUBMITTED = re.compile(r"([\d,]+) were never submitted")
# What it says when a producer failed; without NEVER_SUBMITTED, all of the file went in.
PRODUCER_FAILED = "producers failed or were killed"
# What it says when it found no broker at its start (it submitted nothing).
NO_BROKER = "no broker answers on"
# A campaign resubmits what `produce` says was never submitted at most this often per file.
MAX_RESUBMITS = 20


@dataclass
class Outcome:
    """What one campaign did and what the checker said."""

    campaign: str
    faults: dict[str, int] = field(default_factory=dict)
    verdict: dict = field(default_factory=dict)
    restart_s: list[float] = field(default_factory=list)
    process_start_to_serving_s: list[float] = field(default_factory=list)  # the restarted broker's own share
    redelivery: list[dict] = field(default_factory=list)
    crash_points: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    resubmits: int = 0  # `produce` runs of what a failed one said it never submitted
    wall_s: float = 0.0

    def bound(self, per_fault: int) -> int:
        """The duplicate bound: each fault may deliver again what was in flight at it, and
        each resubmission one submit call its ledger had not counted yet."""
        return sum(self.faults.values()) * per_fault + self.resubmits * DEFAULT_CHUNK_ITEMS

    @property
    def passed(self) -> bool:
        return bool(self.verdict.get("passed"))

    def figures(self) -> dict:
        latencies = [r["latency_s"] for r in self.redelivery if r["latency_s"] is not None]
        return {"campaign": self.campaign, "faults": sum(self.faults.values()), "by_kind": self.faults,
                "passed": self.passed, **{k: self.verdict.get(k) for k in (
                    "attempted", "completed", "lost", "unexpected", "corrupt", "duplicated", "duplicate_bound")},
                "restart_s": percentiles(self.restart_s),
                "broker_process_start_to_serving_s": percentiles(self.process_start_to_serving_s),
                "redelivery_s": percentiles(latencies),
                "wall_s": round(self.wall_s, 1)}

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "figures": self.figures()}


def check(data_dir: str, workload: str, bound: int) -> dict:
    """`pipeline tools check` on every run of `data_dir`: its JSON verdict."""
    done = pipeline("tools", "check", data_dir, "--workload", workload, "--duplicate-bound", str(bound), "--json",
                    check=False)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"pipeline tools check {data_dir}: exit {done.returncode}: {done.stderr.strip()[-1500:]}")


def concatenate(paths: list[str], into: str) -> str:
    with open(into, "w") as out:
        for path in paths:
            with open(path) as part:
                out.write(part.read())
    return into


def produce_to_the_end(process: subprocess.Popen, path: str, stages: Stages, out: Outcome) -> None:
    """Wait for `pipeline produce PATH`; where it failed saying N items were never submitted,
    submit the file's last N lines again, as it tells the user to (one producer: its items
    go in file order), until all is stored."""
    rounds = 0
    while True:
        _out, err = process.communicate(timeout=COMMAND_TIMEOUT_S)
        if process.returncode == 0:
            return
        unsent = NEVER_SUBMITTED.search(err)
        if unsent is None and NO_BROKER in err:  # it found no broker at its start: nothing went in
            with open(path) as file:
                unsent = NEVER_SUBMITTED.search(f"{sum(1 for _ in file)} were never submitted")
        if unsent is None and PRODUCER_FAILED in err:
            return  # killed once all was submitted: the rings hold the rest, the broker stores it
        if unsent is None or rounds >= MAX_RESUBMITS:
            raise RuntimeError(f"pipeline produce: exit {process.returncode}: {err.strip()[-1500:]}")
        out.notes.append(f"produce failed ({err.strip().splitlines()[-1][:200]}); its never-submitted lines "
                         f"submitted again")
        count = int(unsent.group(1).replace(",", ""))
        with open(path) as file:
            rest = file.readlines()[-count:] if count else []
        rounds += 1
        out.resubmits += 1
        path = f"{path}.rest{rounds}"
        with open(path, "w") as file:
            file.writelines(rest)
        process = spawn("produce", path, "--data-dir", stages.data_dir)


def wait_drained(stages: Stages) -> None:
    """Until the broker holds nothing queued or in flight (every item has its completion)."""
    def drained() -> bool:
        status = stages.status()
        return status is not None and not status.backlog_items and not status.pending_items

    wait_until(drained, COMMAND_TIMEOUT_S, "the broker to complete every item")


# ---------------------------------------------------------------------- broker


def _serving_again(stages: Stages, old_pid: int | None, killed_ns: int, env: dict[str, str] | None = None,
                   own_s: list[float] | None = None) -> float:
    """Start the broker; seconds from `killed_ns` to a new broker (not `old_pid`) answering.
    `own_s` gets the share of it from the new broker process's start (its imports, recovery
    and catch-up, without the command that spawned it)."""
    starter = spawn("broker", "start", "--data-dir", stages.data_dir, "--durability", stages.durability, "--detach",
                    "--set", f"heartbeat_timeout_s={stages.heartbeat_timeout_s}",
                    *[arg for pair in stages.broker_settings for arg in ("--set", pair)], env=env)

    def answers() -> bool:
        status = stages.status()
        return status is not None and status.pid != old_pid

    try:
        wait_until(lambda: answers() or starter.poll() is not None, COMMAND_TIMEOUT_S, "a new broker")
        served_ns = time.monotonic_ns()
        status = stages.status()
        if status is None or status.pid == old_pid:  # the starter ended first: the armed broker died first
            return -1.0
        if own_s is not None:
            age = _process_age_s(status.pid)
            if age is not None:
                own_s.append(age - (time.monotonic_ns() - served_ns) / 1e9)
        return (served_ns - killed_ns) / 1e9
    finally:
        starter.communicate(timeout=COMMAND_TIMEOUT_S)


def broker_kills(work: str, kills: int, seed: int, *, rounds: int = 1, items_per_round: int = 3000,
                 points: tuple[str, ...] = (), point_rounds: int = 0, durability: str = "process") -> Outcome:
    """`kills` kill -9s of the broker at random moments while producers submit and consumers
    complete, over `rounds` workloads of `items_per_round` items each; then each crash point
    of `points` armed (PIPELINE_CRASH_POINT=name:skip, skip seeded) in `point_rounds` more
    broker starts each. Every death is followed by `pipeline broker start`."""
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(seed)
    out = Outcome("broker kill -9 (stage commands)" + (" and crash points" if points else ""))
    stages = Stages(os.path.join(work, "data"), durability=durability)
    workloads = []
    plan = [("random", None)] * kills + [("point", p) for _ in range(point_rounds) for p in points]
    rng.shuffle(plan)
    per_round = max(1, -(-len(plan) // rounds))
    feeds: list[tuple[subprocess.Popen, str]] = []

    def feed(wait: bool = True) -> None:
        """A fresh workload through `pipeline produce` (once the broker stores its records)."""
        path = write_workload(os.path.join(work, f"w{len(workloads)}.jsonl"), items_per_round,
                              seed + len(workloads), key=f"b{len(workloads)}")
        workloads.append(path)
        feeds.append((spawn("produce", path, "--data-dir", stages.data_dir), path))
        if wait:
            _wait_submitting(stages, feeds[-1][0])

    stages.start()
    try:
        for index in range(0, len(plan), per_round):
            feed()
            for kind, point in plan[index:index + per_round]:
                if kind == "random":
                    time.sleep(rng.uniform(0, MAX_KILL_GAP_S))
                    kill_broker(stages, out)
                else:  # a feed started under the armed broker: it ingests, so every point is passed
                    crash_at(stages, out, point, rng, feed)
            for producer, path in feeds:
                produce_to_the_end(producer, path, stages, out)
            feeds.clear()
        wait_drained(stages)
    finally:
        stages.close()
    whole = concatenate(workloads, os.path.join(work, "all.jsonl"))
    out.verdict = check(stages.data_dir, whole, out.bound(stages.in_flight_bound))
    out.wall_s = time.monotonic() - started
    return out


def _wait_submitting(stages: Stages, producer: subprocess.Popen) -> None:
    """Until the broker stores items again (`produce` checks for a broker once, at its start,
    and a kill between its producer's registration and its first record fails it)."""
    base = wait_until(stages.status, COMMAND_TIMEOUT_S, "the broker's status").items_received

    def storing() -> bool:
        status = stages.status()
        return producer.poll() is not None or (status is not None and status.items_received > base)

    wait_until(storing, COMMAND_TIMEOUT_S, "the producer to submit")


def _process_age_s(pid: int) -> float | None:
    """Seconds since process `pid` started (/proc: its start in clock ticks since boot, to
    1/CLK_TCK), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            started_ticks = int(file.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as file:
            uptime_s = float(file.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")


def _wait_stored(stages: Stages, producer: subprocess.Popen, items: int) -> None:
    """Until the broker stored `items` more items than now, or `produce` ended."""
    base = wait_until(stages.status, COMMAND_TIMEOUT_S, "the broker's status").items_received

    def stored() -> bool:
        status = stages.status()
        return producer.poll() is not None or (status is not None and status.items_received - base >= items)

    wait_until(stored, COMMAND_TIMEOUT_S, f"{items} items stored", poll_s=0.002)


def kill_broker(stages: Stages, out: Outcome, env: dict[str, str] | None = None) -> float:
    """kill -9 of the broker, then `pipeline broker start` (with `env`); returns seconds from
    the kill to the new broker serving, or -1 when it died before it served."""
    pid = stages.broker_pid()
    if pid is None or gone(pid):
        raise RuntimeError("no live broker to kill")
    killed_ns = kill(pid)
    out.faults["broker kill -9"] = out.faults.get("broker kill -9", 0) + 1
    served = _serving_again(stages, pid, killed_ns, env, out.process_start_to_serving_s)
    if served >= 0:
        out.restart_s.append(served)
    return served


def crash_at(stages: Stages, out: Outcome, point: str, rng: random.Random, feed) -> None:
    """Kill the broker and start one armed at `point` (PIPELINE_CRASH_POINT, skip seeded);
    once it died there (before or after it served), start a plain one. An armed broker
    that has not reached its point in CRASH_WAIT_S is killed instead. `feed()` starts a
    producer under the armed broker once it serves."""
    counts = out.crash_points.setdefault(point, {"armed": 0, "hit": 0, "hit_before_serving": 0, "not_reached": 0})
    counts["armed"] += 1
    old = stages.broker_pid()
    served = kill_broker(stages, out, env={"PIPELINE_CRASH_POINT": f"{point}:{rng.randrange(0, 20)}"})
    if served < 0:
        counts["hit"] += 1
        counts["hit_before_serving"] += 1
        died_ns = time.monotonic_ns()
    else:
        old = stages.broker_pid()
        assert old is not None
        feed(wait=False)
        try:
            wait_until(lambda: gone(old), CRASH_WAIT_S, f"the broker to reach {point}", poll_s=0.002)
            died_ns = time.monotonic_ns()
            counts["hit"] += 1
        except TimeoutError:
            counts["not_reached"] += 1
            died_ns = kill(old)
    out.faults["broker crash point"] = out.faults.get("broker crash point", 0) + 1
    served = _serving_again(stages, old, died_ns, own_s=out.process_start_to_serving_s)
    if served < 0:
        raise RuntimeError("a plain broker did not start after a crash point")
    out.restart_s.append(served)


# ---------------------------------------------------------------------- consumers


def shutdown_control_socket(pid: int, socket_path: str) -> int:
    """Shut down, from outside, every connection process `pid` holds to the broker's socket
    (pidfd_getfd copies its descriptor; shutdown acts on the shared socket, so both ends see
    it closed while the process lives on). Returns how many; needs ptrace rights on `pid`."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    closed = 0
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd < 0:
                raise OSError(ctypes.get_errno(), f"pidfd_getfd of pid {pid} fd {name}")
            sock = socket.socket(fileno=fd)
            try:
                if sock.family == socket.AF_UNIX and sock.getpeername() == socket_path:
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
            except OSError:
                pass
            finally:
                sock.close()
    finally:
        os.close(pidfd)
    return closed


def consumer_faults(work: str, per_kind: int, seed: int, heartbeat_timeout_s: float = 1.0) -> Outcome:
    """`per_kind` faults of each of CONSUMER_FAULTS on seeded consumers of three, over one
    lane (one shape, one length, one producer) so redelivery can be read off the results."""
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(seed)
    out = Outcome("consumer faults (stage commands)")
    stages = Stages(os.path.join(work, "data"), consumers=("c0", "c1", "c2"), heartbeat_timeout_s=heartbeat_timeout_s,
                    max_batch=8, batch_cost_s=0.05)
    plan = [kind for kind in CONSUMER_FAULTS for _ in range(per_kind)]
    rng.shuffle(plan)
    rate = len(stages.consumers) * stages.max_batch / stages.batch_cost_s  # items a second, at most
    workload = write_workload(os.path.join(work, "w.jsonl"), int(rate * (2 * heartbeat_timeout_s + 1.5) * len(plan) + 200),
                              seed, key="c", shapes=1, length=48)
    losses, returned = [], []
    stages.start()
    try:
        producer = spawn("produce", workload, "--data-dir", stages.data_dir)
        wait_until(lambda: (s := stages.status()) is not None and s.items_completed > 100, COMMAND_TIMEOUT_S,
                   "the first completions")
        for kind in plan:
            name = rng.choice(stages.consumers)
            before = stages.status()
            assert before is not None
            at_ns = consumer_fault(stages, name, kind)
            if at_ns is None:
                out.notes.append(f"consumer {name} was between connections: no socket to cut")
                continue
            out.faults[f"consumer {kind}"] = out.faults.get(f"consumer {kind}", 0) + 1
            time.sleep(heartbeat_timeout_s + 1.0)  # its batch redelivered and completed meanwhile
            after = wait_until(stages.status, 10, "the broker's status")
            losses.append((name, kind, at_ns))
            returned.append(after.items_returned - before.items_returned)
        produce_to_the_end(producer, workload, stages, out)
        wait_drained(stages)
    finally:
        stages.close()
    out.verdict = check(stages.data_dir, workload, out.bound(stages.in_flight_bound))
    redelivery_figures(out, stages, losses, returned)
    out.wall_s = time.monotonic() - started
    return out


def consumer_fault(stages: Stages, name: str, kind: str) -> int | None:
    """Apply one fault of CONSUMER_FAULTS to consumer `name`; returns the time of the fault
    (monotonic ns), or None where there was nothing to fault (no connection to cut)."""
    pid = stages.consumer_pid(name)
    if pid is None or gone(pid):
        raise RuntimeError(f"consumer {name} is not running")
    if kind == "kill":
        at_ns = kill(pid)
        stages.start_consumer(name)  # as a supervisor would
    elif kind == "stop":
        at_ns = kill(pid, signal.SIGSTOP)
        # Resumed once the broker declared it dead and handed its batch to another: its late
        # completion arrives after the redelivery.
        time.sleep(2 * stages.heartbeat_timeout_s + 0.3)
        os.kill(pid, signal.SIGCONT)
    else:
        at_ns = time.monotonic_ns()
        if not shutdown_control_socket(pid, stages.socket_path):
            return None  # between two connections (reconnecting): nothing to cut
    return at_ns


def redelivery_figures(out: Outcome, stages: Stages, losses: list, returned: list[int],
                       keys: bytes = b"", faults_ns: list[int] | None = None,
                       brokers_changed: list[bool] | None = None) -> None:
    """Each loss's redelivery (`timing.redeliveries`) from every results line of the items
    whose key starts with `keys` (those fed in one lane each). A loss's window ends at the
    next fault of any kind in `faults_ns` (default: the next loss). `brokers_changed`: per
    loss, whether another broker served at the window's end than at its start (an armed
    broker that reached its crash point in it): its items came back through recovery."""
    lines = []
    for path in results_dirs(stages.data_dir):
        for name in sorted(os.listdir(path)):
            if name.endswith(".jsonl"):
                lines += [Line(int(r["item_id"]), name, int(r["dispatch_ns"]), int(r["done_ns"]))
                          for r in result_rows(os.path.join(path, name))
                          if base64.b64decode(r.get("payload") or "").startswith(keys)]
    now = time.monotonic_ns()
    starts = sorted(faults_ns if faults_ns is not None else [at for _, _, at in losses])
    ends = [next((t for t in starts if t > at), now) for _, _, at in losses]
    # A paused consumer is judged once silent for the heartbeat timeout: not before 0.9 of it.
    hold_ns = int(0.9 * stages.heartbeat_timeout_s * 1e9)
    found = redeliveries(lines, [Loss(n, k, at, end, at + (hold_ns if k == "stop" else 0))
                                 for (n, k, at), end in zip(losses, ends)])
    changed = brokers_changed if brokers_changed is not None else [False] * len(found)
    for event, broker_count, restarted in zip(found, returned, changed):
        out.redelivery.append({"kind": event.loss.kind, "consumer": event.loss.consumer, "items": event.items,
                               "returned_by_broker": broker_count, "latency_s": event.latency_s,
                               "broker_restarted": restarted})
    mismatched = sum(1 for r in out.redelivery if r["items"] != r["returned_by_broker"])
    if mismatched:
        out.notes.append(f"{mismatched} of {len(found)} losses: items found redelivered in the results differ "
                         f"from the broker's items_returned (the one-lane premise did not hold there)")


# ---------------------------------------------------------------------- producers


def producer_kills(work: str, kills: int, seed: int, items: int = 3000) -> Outcome:
    """`kills` times: `pipeline produce` of a fresh workload (long prompts: a frame takes a
    while to write), its producer process killed -9 at a seeded moment while it submits;
    then `pipeline produce` of the file's lines it says were never submitted."""
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(seed)
    out = Outcome("producer kill -9 (stage commands)")
    stages = Stages(os.path.join(work, "data"))
    workloads = []
    stages.start()
    try:
        for k in range(kills):
            path = write_workload(os.path.join(work, f"w{k}.jsonl"), items, seed + k, key=f"p{k}", length=3000)
            workloads.append(path)
            producer = spawn("produce", path, "--data-dir", stages.data_dir, "--producers", "1")
            child = wait_until(lambda: _child_of(producer.pid), COMMAND_TIMEOUT_S, "the producer process")
            # Killed once the broker stored a seeded share of the file: the producer is a
            # ring ahead of the broker then, writing frames.
            _wait_stored(stages, producer, rng.randrange(1, items // 2))
            if gone(child):
                out.notes.append(f"producer {k} finished before its kill")
            else:
                kill(child)
                out.faults["producer kill -9"] = out.faults.get("producer kill -9", 0) + 1
            produce_to_the_end(producer, path, stages, out)
        wait_drained(stages)
    finally:
        stages.close()
    whole = concatenate(workloads, os.path.join(work, "all.jsonl"))
    # Duplicates: a submit call the ledger had not counted when the kill came (one chunk,
    # counted by the resubmission), and what consumers held if a kill disturbed them.
    out.verdict = check(stages.data_dir, whole, out.bound(0))
    out.wall_s = time.monotonic() - started
    return out


def _child_of(pid: int) -> int | None:
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return None
    return children[0].pid if children else None
