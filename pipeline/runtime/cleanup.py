"""What a crashed run of one data directory left behind, and its removal (`pipeline tools
cleanup DATA_DIR`).

A broker, producer or consumer killed with SIGKILL cannot unlink what it made. Left are:

    in /dev/shm, named for the data directory (`object_prefix`, its namespace):
        producer rings (sbrk-NS-pN) and their semaphores (.d, .s), descriptor rings
        (sbrk-NS-gG-cC) and theirs, the doorbell (sem.sbrk-NS-bell), the memory tier's
        directory (sbrk-NS-memory/, segment files of a broker that is gone)
    in DATA_DIR/run:
        pid files of stage processes that are gone (broker.pid, consumer-NAME.pid, and a
        pid file's temporary NAME.pid.PID.tmp), the broker socket nobody listens on

and nothing else is touched: not the store, the results, the logs, the lock files, nor
anything of another data directory (another namespace) or of another user.

Kept, and said why:
- everything, while a broker runs on the data directory (it holds run/broker.lock), or a
  launcher does (run/launch.lock: its broker may be starting or just stopped): the cleanup
  refuses (LiveRunError). It holds the broker's lock itself while it looks and removes, so
  no broker starts meanwhile;
- what a live process still maps (a producer waiting for a broker maps its ring and the
  doorbell; a consumer its old descriptor ring and segment files), and the pid file of a
  live stage process;
- a producer ring that holds records the broker never stored: accepted items, which the
  next broker on this data directory stores (SPEC 12: nothing accepted is lost); removed
  only with `discard_unstored`, their count said; one that cannot be read (damaged: what it
  holds is unknown) likewise;
- an object under our names that belongs to another user (/dev/shm is sticky: only its
  owner or root may remove it, and it is not ours to judge).

    plan = plan_cleanup(data_dir)         # inside held_run_lock(data_dir)
    removed = apply_cleanup(plan)

A launcher's clean-up after its run (`pipeline.runtime.local.remove_leftovers`) is this
same plan, inside `held_broker_lock` (the launcher holds run/launch.lock itself), with the
rings it keeps for the next broker named.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pipeline.broker.config import SOCKET_NAME, BrokerConfig
from pipeline.broker.peers import NAMESPACE_FILE, namespace_for, object_prefix
from pipeline.broker.state import LOCK_NAME
from pipeline.runtime import daemon
from pipeline.runtime.datadir import check_data_dir, describe_holder, launch_lock_path, lock_holder
from pipeline.runtime.inventory import ring_stock
from pipeline.wire.errors import DataDirError, LiveRunError
from pipeline.wire.layouts.names import BROKER_STATE_NAME
from shm.objects import DEV_SHM, named_objects, object_path, processes_mapping, semaphore_path, unlink_quietly
from shm.ring_layout import unfinished_ring

# A stage pid file (daemon.StageFiles) and the temporary a writer killed mid-write leaves.
_PID_FILE_RE = re.compile(r"^(broker|consumer-.+)\.pid$")
_PID_TEMPORARY_RE = re.compile(r"^(broker|consumer-.+)\.pid\.(\d+)\.tmp$")
# How long the socket check waits for a connect to a socket file (a listener answers at once).
SOCKET_PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Leftover:
    """One thing found: what it is, where, and why it is removed or kept."""

    kind: str  # "producer ring", "descriptor ring", "semaphore", "shared memory", "memory tier", "pid file", "socket"
    path: str  # its file: /dev/shm/... or under DATA_DIR/run
    why: str
    name: str = ""  # the POSIX name of a shared-memory object or semaphore ('/' first), else ""

    def to_json(self) -> dict:
        return {"kind": self.kind, "path": self.path, "name": self.name, "why": self.why}


@dataclass(slots=True)
class CleanupPlan:
    """What `plan_cleanup` found: `remove` is what `apply_cleanup` removes, `keep` what it
    leaves, each with its reason."""

    data_dir: str
    prefix: str  # the data directory's object names begin with this (no '/')
    remove: list[Leftover] = field(default_factory=list)
    keep: list[Leftover] = field(default_factory=list)


@contextmanager
def held_run_lock(data_dir: str) -> Iterator[None]:
    """`pipeline tools cleanup`'s hold of a data directory: DataDirError first for a path
    that is not a data directory of ours (`plan_cleanup`'s check), LiveRunError if a
    launcher holds it (its pid said), then `held_broker_lock` for the block."""
    _check_is_data_dir(data_dir)
    launcher = lock_holder(launch_lock_path(data_dir))
    if launcher is not None:
        raise LiveRunError(f"a run is in progress on {data_dir} ({describe_holder(launcher)}, a `pipeline launch` or "
                           f"`run-batch`, holds {launch_lock_path(data_dir)}): cleanup touches nothing of a live run; "
                           f"it removes what it leaves itself when it ends (Ctrl-C stops it)")
    with held_broker_lock(data_dir, f"cleanup touches nothing of a live run; stop it first (`pipeline broker stop "
                                    f"--data-dir {data_dir}`, or end its launch)"):
        yield


@contextmanager
def held_broker_lock(data_dir: str, refusal: str, error: type[LiveRunError] = LiveRunError) -> Iterator[None]:
    """Hold the data directory's broker lock for the block, so no broker starts meanwhile:
    `error` naming the data directory, the pid holding the lock and `refusal` (what is not
    done, and what to do) if a broker holds it. No lock file (no broker ever ran there):
    nothing to hold; the file is never created here (a cleanup makes nothing)."""
    path = os.path.join(BrokerConfig(data_dir).run_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise error(f"a broker is running on {data_dir} ({describe_holder(holder)} holds {path}): "
                        f"{refusal}") from exc
        yield
    finally:
        os.close(fd)  # closing releases the lock


def plan_cleanup(data_dir: str, discard_unstored: bool = False,
                 keep_rings: frozenset[str] = frozenset()) -> CleanupPlan:
    """Everything a stopped or crashed run of `data_dir` left (module docstring), sorted into
    remove and keep; the rings named in `keep_rings` (the caller keeps them for the next
    broker) and their semaphores are kept whatever they hold. Call it holding
    `held_run_lock` (or `held_broker_lock`). DataDirError for a path that is not a data
    directory, or one another user could change (it decides what gets removed)."""
    _check_is_data_dir(data_dir)
    prefix = object_prefix(namespace_for(data_dir))
    plan = CleanupPlan(os.path.realpath(data_dir), prefix)
    in_use = processes_mapping(prefix)
    shared, semaphores = named_objects(prefix)
    kept_rings = _plan_shared_memory(plan, shared, in_use, discard_unstored, keep_rings)
    _plan_semaphores(plan, semaphores, in_use, kept_rings)
    _plan_memory_tier(plan, in_use)
    _plan_run_dir(plan, BrokerConfig(data_dir).run_dir)
    return plan


def _check_is_data_dir(data_dir: str) -> None:
    if not os.path.isdir(data_dir):
        raise DataDirError(f"{data_dir} is not a directory: no data directory to clean")
    check_data_dir(data_dir)
    markers = ("run", NAMESPACE_FILE, BROKER_STATE_NAME)
    if not any(os.path.lexists(os.path.join(data_dir, marker)) for marker in markers):
        raise DataDirError(f"{data_dir} is not a data directory (it has none of {', '.join(markers)}): "
                           f"nothing of a run to clean there")


def _not_ours(path: str) -> str:
    """Why an object in /dev/shm must be left alone ('' when it is ours to remove)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "gone meanwhile"
    if info.st_uid != os.geteuid():
        return (f"belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): another user made it under "
                f"this data directory's names; its owner or root removes it")
    return ""


def _users(in_use: dict[str, set[int]], path: str) -> str:
    """'in use by pid 12, 13' when live processes map `path` (or a file under it), else ''."""
    pids = sorted({pid for mapped, found in in_use.items() if mapped == path or mapped.startswith(path + "/")
                   for pid in found})
    return f"in use by pid {', '.join(map(str, pids))}" if pids else ""


def _plan_shared_memory(plan: CleanupPlan, shared: list[str], in_use: dict[str, set[int]],
                        discard_unstored: bool, keep_rings: frozenset[str]) -> set[str]:
    """Rings and other shared-memory objects; returns the names of the rings kept (their
    semaphores stay with them)."""
    kept: set[str] = set()
    for name in shared:
        path = object_path(name)
        kind, why = _ring_kind(plan.prefix, name), ""
        reason = _not_ours(path) or _users(in_use, path) or (
            "kept for the next broker on this data directory: it holds records the broker has not stored"
            if name in keep_rings else "")
        if not reason and kind == "producer ring":
            reason, why = _unstored(name, discard_unstored)
        if reason:
            plan.keep.append(Leftover(kind, path, reason, name))
            kept.add(name)
        else:
            plan.remove.append(Leftover(kind, path, why or "no live process uses it", name))
    return kept


def _ring_kind(prefix: str, name: str) -> str:
    role = name[len(prefix) + 1:]
    if re.fullmatch(r"p\d+", role):
        return "producer ring"
    if re.fullmatch(r"g\d+-c\d+", role):
        return "descriptor ring"
    return "shared memory"


def _unstored(name: str, discard: bool) -> tuple[str, str]:
    """(why keep it or '', why remove it) for a producer ring nobody maps."""
    if unfinished_ring(name):
        return "", "its producer died making it: it never held anything"
    stock = ring_stock([name])
    if stock.unreadable:
        problem = stock.unreadable[0].split(": ", 1)[-1]
        if not discard:
            return (f"cannot be read ({problem}): what it holds is unknown; kept (--discard-unstored removes it)",
                    "")
        return "", f"cannot be read ({problem}); discarded as asked"
    items = int(stock.item_ids.size)
    if not items:
        return "", "its producer is gone and the broker stored everything it held"
    if not discard:
        return (f"holds {items:,} item{'' if items == 1 else 's'} the broker never stored: the next broker on this data directory stores "
                f"them (--discard-unstored removes it, and loses them)", "")
    return "", f"holds {items:,} item{'' if items == 1 else 's'} the broker never stored: discarded as asked (they are lost)"


def _plan_semaphores(plan: CleanupPlan, semaphores: list[str], in_use: dict[str, set[int]],
                     kept_rings: set[str]) -> None:
    for name in semaphores:
        path = semaphore_path(name)
        owner = name.rsplit(".", 1)[0]
        if owner in kept_rings:
            plan.keep.append(Leftover("semaphore", path, f"a semaphore of ring {owner}, which is kept", name))
            continue
        reason = _not_ours(path) or _users(in_use, path)
        what = "the doorbell" if name == f"/{plan.prefix}bell" else "no live process uses it"
        (plan.keep if reason else plan.remove).append(Leftover("semaphore", path, reason or what, name))


def _plan_memory_tier(plan: CleanupPlan, in_use: dict[str, set[int]]) -> None:
    """The memory tier's directory of a broker that is gone: not durable by contract (the
    next broker start removes it too), and it holds RAM until then."""
    path = os.path.join(DEV_SHM, plan.prefix + "memory")
    if not os.path.lexists(path):
        return
    info = os.lstat(path)
    reason = _not_ours(path) or _users(in_use, path)
    if not reason and not stat.S_ISDIR(info.st_mode):
        reason = "not a directory: not the memory tier's; left alone"
    why = "the memory tier of a broker that is gone (not durable: the next broker start removes it too)"
    (plan.keep if reason else plan.remove).append(Leftover("memory tier", path, reason or why))


def _plan_run_dir(plan: CleanupPlan, run_dir: str) -> None:
    """Stale pid files (and their temporaries) and the broker socket nobody listens on."""
    try:
        names = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(run_dir, name)
        if _PID_FILE_RE.match(name):
            _plan_pid_file(plan, path)
        elif match := _PID_TEMPORARY_RE.match(name):
            writer = int(match.group(2))
            if _pid_alive(writer):
                plan.keep.append(Leftover("pid file", path, f"being written by pid {writer}"))
            else:
                plan.remove.append(Leftover("pid file", path, f"a temporary whose writer (pid {writer}) is gone"))
        elif name == SOCKET_NAME:
            _plan_socket(plan, path)


def _plan_pid_file(plan: CleanupPlan, path: str) -> None:
    pid = daemon.read_pid(path)
    if pid is None:
        plan.keep.append(Leftover("pid file", path, "holds no pid that can be read: left alone"))
    elif (process := daemon.stage_process(path)) is not None:
        plan.keep.append(Leftover("pid file", path, f"pid {process.pid} is running"))
    else:
        plan.remove.append(Leftover("pid file", path, f"pid {pid} is gone (or is another program now)"))


def _plan_socket(plan: CleanupPlan, path: str) -> None:
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode):
        plan.keep.append(Leftover("socket", path, "not a socket: left alone"))
        return
    if info.st_uid != os.geteuid():
        plan.keep.append(Leftover("socket", path, f"belongs to uid {info.st_uid}, not to you: left alone"))
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(SOCKET_PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        plan.remove.append(Leftover("socket", path, "nobody listens on it"))
        return
    except OSError as exc:
        plan.keep.append(Leftover("socket", path, f"cannot be checked ({exc.strerror or exc}): left alone"))
        return
    finally:
        probe.close()
    plan.keep.append(Leftover("socket", path, "a process listens on it"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def apply_cleanup(plan: CleanupPlan) -> list[Leftover]:
    """Remove what the plan lists to remove (still holding `held_run_lock`); returns what
    was removed. What is gone meanwhile is skipped; what cannot be removed raises OSError
    naming it."""
    removed = []
    for found in plan.remove:
        if found.kind == "semaphore":
            gone = bool(unlink_quietly([], [found.name]))
        elif found.name:
            gone = bool(unlink_quietly([found.name], []))
        elif found.kind == "memory tier":
            gone = os.path.isdir(found.path)
            shutil.rmtree(found.path, onerror=_raise_unless_gone)
        else:
            try:
                os.unlink(found.path)
                gone = True
            except FileNotFoundError:
                gone = False
        if gone:
            removed.append(found)
    return removed


def _raise_unless_gone(_function, _path: str, exc_info) -> None:
    """rmtree's error handler: what is gone meanwhile is fine, anything else is raised."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
