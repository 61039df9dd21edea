"""Who may touch a data directory: only its owner (SPEC §7, §12).

A data directory holds the control socket, the segment files and the results. Anyone who can
write to it, or to a directory above it, can replace those: serve a fake socket that
`status` and `produce` talk to, or rename `segments/` away. So every command refuses a data
directory it cannot trust before reading or writing anything there:

- the data directory and every directory inside it must be owned by this user and not
  writable by group or others (a directory of ours that others may only read is tightened
  to 0700, and said so: an older version made them 0755);
- every directory above it must be owned by this user or root, and not writable by group or
  others unless it has the sticky bit (as /tmp has: others cannot rename what is ours), the
  rule sshd applies to a home directory (StrictModes).

Everything the product creates is owner-only whatever the umask: `owner_only_umask()` at
each entry point, and explicit modes where files are created.

One run at a time: a launcher (`pipeline launch`, `run-batch`) holds run/launch.lock for
its whole run, beside the broker's run/broker.lock. A second launcher on the same data
directory would otherwise start while the first runs and, once its own broker was refused,
remove the first one's shared-memory objects as leftovers.

    data_dir = prepare_data_dir("/data/run1")     # created 0700, or checked; DataDirError
    check_data_dir("/data/run1")                  # a client: checked, never created
    fd = hold_for_launch("/data/run1")            # DataDirInUseError; release_launch(fd)
    held = hold_lock(path)                        # a descriptor, or the holder's pid (str)
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from pipeline.broker.config import RUN_DIR
from pipeline.wire.errors import DataDirError, DataDirInUseError

# Directories of a data directory: owner-only (SPEC §7, §12; files are made 0600 where made).
DIRECTORY_MODE = 0o700
# The umask every entry point sets: group and others get nothing, whatever the caller's umask.
OWNER_ONLY_UMASK = 0o077
# Permission bits that let another user change a directory's entries.
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
# Directories inside a data directory that clients look at (the broker checks the whole tree).
CLIENT_CHECKED = (RUN_DIR, "results")
# In the run directory: held by a launcher for its whole run (module docstring).
LAUNCH_LOCK_NAME = "launch.lock"
# At the top: held by a node process for its whole life (`runtime/node.py`'s `_lock_node`).
NODE_LOCK_NAME = "node.lock"
# Free space a data directory needs beyond the store's reserve for a run to start: the first
# segments' allocations, the results and a job's own files of a small run.
MIN_WORK_ROOM_BYTES = 4 << 20


def owner_only_umask() -> None:
    """Make everything this process creates owner-only (0700 directories, 0600 files)."""
    os.umask(OWNER_ONLY_UMASK)


def prepare_data_dir(path: str) -> str:
    """Create the data directory owner-only if it does not exist, else check it and every
    directory inside it (the broker's start: it owns all of them). Returns its real path."""
    if not os.path.lexists(path):
        _check_ancestors(os.path.dirname(os.path.abspath(path)) or "/")
        os.makedirs(path, mode=DIRECTORY_MODE, exist_ok=True)
        os.chmod(path, DIRECTORY_MODE)
    check_data_dir(path, whole_tree=True)
    return os.path.realpath(path)


def check_data_dir(path: str, whole_tree: bool = False) -> None:
    """Refuse (DataDirError) a data directory that another user could change: the checks of
    the module docstring for it and its ancestors, and for the directories inside it that
    clients use (`whole_tree`: every directory inside it). A missing data directory passes:
    the command then says what is missing (no broker answers there)."""
    if not os.path.lexists(path):
        return
    check_not_shared(path)
    real = os.path.realpath(path)
    _check_ancestors(os.path.dirname(real) or "/")
    _check_own_directory(real, "data directory")
    if whole_tree:
        for root, dirnames, _files in os.walk(real, onerror=_unreadable):
            for name in dirnames:
                _check_own_directory(os.path.join(root, name), "directory")
    else:
        for name in CLIENT_CHECKED:
            inside = os.path.join(real, name)
            if os.path.lexists(inside):
                _check_own_directory(inside, "directory")


def check_not_shared(path: str) -> None:
    """DataDirError for a data directory that is a shared system directory: / or one that
    everyone may write with the sticky bit (/tmp, /dev/shm). Its mode is the system's (a
    chmod would break every other user of it) and its entries are not a run's: the run goes
    in a directory of its own inside it."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return  # missing or unreadable: the caller's checks say so
    if not stat.S_ISDIR(mode):
        return
    if real == "/":
        raise DataDirError(f"data directory {path} is the root directory: give a directory of your own for the "
                           f"run, such as {os.path.join(os.path.expanduser('~'), 'run1')}")
    if mode & stat.S_IWOTH and mode & stat.S_ISVTX:
        raise DataDirError(f"data directory {path} is a directory everyone shares (mode "
                           f"{stat.S_IMODE(mode):04o}, as /tmp): give a directory of your own inside it, such as "
                           f"{os.path.join(real, 'run1')} (leave its mode as it is)")


def _unreadable(exc: OSError) -> None:
    raise DataDirError(f"cannot check {exc.filename}: {exc.strerror}") from exc


def _check_own_directory(path: str, what: str) -> None:
    info = _lstat(path)
    if stat.S_ISLNK(info.st_mode):
        _check_link(path, info, what)
        return
    if not stat.S_ISDIR(info.st_mode):
        raise DataDirError(f"{what} {path} is not a directory")
    me = os.geteuid()
    if info.st_uid != me:
        raise DataDirError(f"{what} {path} is owned by uid {info.st_uid}, not by you (uid {me}): refusing it, "
                           f"another user could replace its files; use a directory of your own")
    mode = stat.S_IMODE(info.st_mode)
    if mode & _WRITABLE_BY_OTHERS:
        raise DataDirError(f"{what} {path} has mode {mode:04o}: group or others can write to it and could "
                           f"replace its files; fix it with `chmod 700 {path}` (and check what is inside)")
    if mode & 0o077:
        os.chmod(path, DIRECTORY_MODE)  # ours, readable by others: made owner-only


def _check_link(path: str, info: os.stat_result, what: str) -> None:
    """A symbolic link inside the data directory (results/ on another disk, say): it must be
    ours, and what it points to must pass the checks of a data directory itself."""
    if info.st_uid != os.geteuid():
        raise DataDirError(f"{what} {path} is a symbolic link owned by uid {info.st_uid}, not by you: refusing "
                           f"it (another user placed it); remove it")
    target = os.path.realpath(path)
    if not os.path.lexists(target):
        raise DataDirError(f"{what} {path} is a symbolic link to {target}, which does not exist")
    _check_ancestors(os.path.dirname(target) or "/")
    _check_own_directory(target, f"{what} {path} links to")


def _check_ancestors(path: str) -> None:
    """Every directory from `path` up to / : owned by us or root, and not writable by group
    or others unless sticky."""
    me = os.geteuid()
    current = os.path.realpath(path)
    while not os.path.lexists(current):  # what does not exist yet is created owner-only
        current = os.path.dirname(current)
    while True:
        info = _lstat(current)
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid not in (me, 0):
            raise DataDirError(f"{current}, above the data directory, is owned by uid {info.st_uid} (neither you "
                               f"nor root): its owner could swap the data directory; use a path of your own")
        if mode & _WRITABLE_BY_OTHERS and not mode & stat.S_ISVTX:
            raise DataDirError(f"{current}, above the data directory, has mode {mode:04o}: group or others can "
                               f"rename the data directory away and put theirs in its place; use a path whose "
                               f"directories only you (or root) can write, or set the sticky bit (chmod +t)")
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def _lstat(path: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except OSError as exc:
        raise DataDirError(f"cannot check {path}: {exc.strerror}") from exc


def launch_lock_path(data_dir: str) -> str:
    return os.path.join(data_dir, RUN_DIR, LAUNCH_LOCK_NAME)


# The descriptors of the locks this process holds (`hold_lock`: the launch lock, a batch
# job's lock). A forked child closes its copies at once, so a lock is its taker's alone
# (the pid in it is the holder) and is free the moment that process is gone. NOTE: children
# sharing it, so that a killed launcher's run held the data directory until its last orphan
# exited, was rejected: a rerun right after a crash was then refused for as long as an
# orphan lingered, while what the orphans still use is kept anyway (the broker's lock, and a
# clean-up never removes what a process maps).
_holds: set[int] = set()


def _drop_inherited_holds() -> None:
    for fd in _holds:
        os.close(fd)
    _holds.clear()


os.register_at_fork(after_in_child=_drop_inherited_holds)


def hold_lock(path: str) -> int | str:
    """An exclusive, non-blocking flock on `path` (created 0600), with this pid written in
    it, held by this process alone (never by a child it forks): its descriptor, for
    `release_lock`; or, when another process holds it, that holder as its file names it
    (`describe_holder`)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _pid_in(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return holder
    _holds.add(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int) -> None:
    """End a hold `hold_lock` took."""
    _holds.discard(fd)
    os.close(fd)


def hold_for_launch(data_dir: str) -> int:
    """Take the data directory for one launcher's run: `hold_lock` on run/launch.lock.
    Returns its descriptor, for `release_launch`. Refuses at once (DataDirInUseError,
    naming the pid that holds it) when another run holds it."""
    path = launch_lock_path(data_dir)
    os.makedirs(os.path.dirname(path), mode=DIRECTORY_MODE, exist_ok=True)
    held = hold_lock(path)
    if isinstance(held, str):
        raise DataDirInUseError(f"another run is using the data directory {data_dir}: {describe_holder(held)} "
                                f"holds {path}; wait for it to end, or use another --data-dir")
    return held


release_launch = release_lock


def lock_holder(path: str) -> str | None:
    """Who holds the flock on `path`: the pid written in it ("unknown" before it is written),
    or None when nobody does or there is no such file (it is never created here). Another
    process's view: a lock this process holds reads as held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return _pid_in(fd)
        return None
    finally:
        os.close(fd)  # closing releases a shared lock taken above


def describe_holder(holder: str) -> str:
    """'pid 12' for a lock's holder as its file says ('a process' before it is written)."""
    return f"pid {holder}" if holder.isdigit() else "a process (its pid not written yet)"


def holder_gone(holder: str) -> bool:
    """The pid a held lock's file names no longer runs: a process that pid left behind
    (one forked before its locks were dropped in children, or given the descriptor) still
    holds it, so stopping "where it runs" is no advice."""
    if not holder.isdigit():
        return False
    try:
        os.kill(int(holder), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it runs, as another user
    return False


def _pid_in(fd: int) -> str:
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def check_room(data_dir: str, holds_work: bool = False) -> None:
    """DataDirError where the data directory's file system (or, before it is made, its nearest
    existing parent's) has too little free for a run to start: its store could never take an
    item, and the run would wait for ever. `holds_work`: the directory holds an earlier run's
    work, which moves with it."""
    from pipeline.storage.diskio import disk_reserve_bytes

    existing = os.path.abspath(data_dir)
    while not os.path.isdir(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)  # where it will be made: the same file system
    info = os.statvfs(existing)
    free, reserve = info.f_bavail * info.f_frsize, disk_reserve_bytes(info.f_blocks * info.f_frsize)
    if free < reserve + MIN_WORK_ROOM_BYTES:
        raise DataDirError(f"{data_dir} is on a file system with {free:,} bytes free: a run needs at least "
                           f"{reserve + MIN_WORK_ROOM_BYTES:,} ({reserve:,} its store keeps free for results, and room "
                           f"to work): make room there, or "
                           + (f"move {data_dir} whole to a larger disk and give its new path as --data-dir (what "
                              f"it holds goes with it)" if holds_work else "give --data-dir on another disk"))
