"""Named POSIX objects (shared memory, semaphores): create owner-only, attach, unlink once.

Names are per run (`object_name`), so two runs never share an object by accident, and a
leftover from a crashed run is found by name and checked before anything reads it.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat

import posix_ipc

from shm.errors import ObjectExistsError, ObjectMissingError, ShmError, ShmSpaceError, StaleObjectError

# Owner read/write only: SPEC §7, every shared-memory object is created owner-only.
OWNER_ONLY_MODE = 0o600
# Linux allows 255 bytes, named semaphores lose 4 to the "sem." prefix, and our semaphore
# suffixes add 2 more; 200 leaves room and keeps names readable in /dev/shm.
MAX_NAME_LENGTH = 200
_NAME_RE = re.compile(r"^/[A-Za-z0-9_.\-]+$")
# Where Linux keeps POSIX shared memory and named semaphores (NAME as sem.NAME, without the
# leading '/'): the one place that knows it.
DEV_SHM = "/dev/shm"
_SEMAPHORE_FILE_PREFIX = "sem."
# What an object takes in /dev/shm (tmpfs counts whole pages): a shared-memory object its
# size rounded up to pages; a named semaphore one page (sem_open writes a 32-byte sem_t).
PAGE_BYTES = mmap.PAGESIZE
SEMAPHORE_FOOTPRINT_BYTES = PAGE_BYTES
# errno values that mean "no room": a full tmpfs, or a tmpfs quota.
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Where /dev/shm's size is set, for the messages of a shortage.
RAISE_HINT = "`docker run --shm-size=...`, or as root `mount -o remount,size=... /dev/shm`"


def object_name(prefix: str, run_id: str, role: str) -> str:
    """The POSIX name of one object of one run, e.g. `/sbrk-1a2b3c-producer-3`."""
    name = f"/{prefix}-{run_id}-{role}"
    check_name(name)
    return name


def check_name(name: str) -> None:
    if not _NAME_RE.match(name) or len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"shared-memory name {name!r} must be '/' then letters, digits, '_', '.', '-', "
            f"at most {MAX_NAME_LENGTH} characters"
        )


def create_shared_memory(name: str, size_bytes: int) -> tuple[mmap.mmap, int]:
    """Create a new owner-only shared-memory object of `size_bytes`, map it, return (map, inode)."""
    check_name(name)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=OWNER_ONLY_MODE, size=size_bytes)
    except posix_ipc.ExistentialError as exc:
        raise ObjectExistsError(f"shared-memory object {name} already exists: {exc}") from exc
    try:
        # fchmod too: the creation mode is filtered by the umask, which may be stricter but never
        # looser, and we want the mode stated, not inherited.
        os.fchmod(shm.fd, OWNER_ONLY_MODE)
        _reserve(name, shm.fd, size_bytes)
        mapping = mmap.mmap(shm.fd, size_bytes)
        return mapping, os.fstat(shm.fd).st_ino
    except BaseException:
        unlink_quietly([name], [])  # made here, with O_EXCL: ours to remove, and half made
        raise
    finally:
        shm.close_fd()


def _reserve(name: str, fd: int, size_bytes: int) -> None:
    """Allocate every page of a new object now. ftruncate alone makes it sparse on tmpfs: a
    full /dev/shm would show up later as SIGBUS on the first write to a page it cannot back,
    in whichever process writes it. ShmSpaceError (the object, its size, what is free)."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as exc:
        if exc.errno not in _NO_SPACE_ERRNOS:
            raise
        free, total = shm_space()
        raise ShmSpaceError(f"{DEV_SHM} has no room for shared-memory object {name} of {size_bytes:,} bytes: "
                            f"{free:,} of its {total:,} bytes are free; raise its size ({RAISE_HINT})") from exc


def shm_space() -> tuple[int, int]:
    """(free, total) bytes of the file system of /dev/shm."""
    info = os.statvfs(DEV_SHM)
    return info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize


def object_footprint_bytes(size_bytes: int) -> int:
    """What a shared-memory object of `size_bytes` takes in /dev/shm: whole pages."""
    return -(-size_bytes // PAGE_BYTES) * PAGE_BYTES


def attach_shared_memory(name: str) -> tuple[mmap.mmap, int]:
    """Map an existing object after checking it is ours and owner-only; return (map, inode)."""
    check_name(name)
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError as exc:
        raise ObjectMissingError(f"shared-memory object {name} does not exist") from exc
    except posix_ipc.PermissionsError as exc:  # another user's object under our name
        raise StaleObjectError(f"{name} is not ours: no permission to open it ({exc})") from exc
    try:
        info = os.fstat(shm.fd)
        if info.st_uid != os.getuid():
            raise StaleObjectError(f"{name} belongs to uid {info.st_uid}, not {os.getuid()}")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise StaleObjectError(f"{name} has mode {oct(stat.S_IMODE(info.st_mode))}, not owner-only")
        if info.st_size == 0:
            raise StaleObjectError(f"{name} is empty (its creator died before sizing it)")
        return mmap.mmap(shm.fd, info.st_size), info.st_ino
    finally:
        shm.close_fd()


def open_semaphore(name: str, create: bool) -> posix_ipc.Semaphore:
    """Create (exclusive) or open a named semaphore, owner-only. An existing one is opened
    only if it is ours and owner-only, as `attach_shared_memory` checks shared memory: one
    another user created under our name (/dev/shm is writable by everyone) could be posted
    or waited on by that user, so it is refused (StaleObjectError), never used."""
    check_name(name)
    try:
        if create:
            return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=OWNER_ONLY_MODE, initial_value=0)
        before = _check_semaphore_file(name)
        sem = posix_ipc.Semaphore(name)
    except posix_ipc.ExistentialError as exc:
        kind = ObjectExistsError if create else ObjectMissingError
        raise kind(f"semaphore {name}: {exc}") from exc
    except posix_ipc.PermissionsError as exc:  # another user's semaphore under our name
        raise StaleObjectError(f"semaphore {name} is not ours: no permission to open it ({exc})") from exc
    except OSError as exc:  # sem_open writes its sem_t: a full /dev/shm refuses it
        if not create or exc.errno not in _NO_SPACE_ERRNOS:
            raise
        free, total = shm_space()
        raise ShmSpaceError(f"{DEV_SHM} has no room for semaphore {name} ({SEMAPHORE_FOOTPRINT_BYTES:,} bytes): "
                            f"{free:,} of its {total:,} bytes are free; raise its size ({RAISE_HINT})") from exc
    # /dev/shm is sticky, so nobody else can replace our file; unless we (or root) unlinked
    # and someone recreated it between the check and the open. Checked again: same file.
    try:
        after = _check_semaphore_file(name)
    except ShmError:
        sem.close()
        raise
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        sem.close()
        raise StaleObjectError(f"semaphore {name} was replaced while it was being opened")
    return sem


def semaphore_path(name: str) -> str:
    """Where Linux keeps a named semaphore: /dev/shm/sem.NAME (without the leading '/')."""
    return os.path.join(DEV_SHM, _SEMAPHORE_FILE_PREFIX + name.lstrip("/"))


def named_objects(prefix: str) -> tuple[list[str], list[str]]:
    """The names (as for shm_open and sem_open: '/' first) of the shared-memory objects and
    of the named semaphores that exist now and start with `prefix` (given without the '/'),
    each list sorted: what runs of one namespace hold or a crashed one left, for whoever
    takes stock or cleans up. Directories are neither (a tmpfs data directory under
    /dev/shm) and are skipped; no /dev/shm: ([], []). Whose they are is not checked
    (attaching and unlinking check that).

    Example: /dev/shm holds sbx-p3, sem.sbx-p3.d and sbx-g2-c1/ (a directory): with prefix
    "sbx-" -> (["/sbx-p3"], ["/sbx-p3.d"])."""
    shared, semaphores = [], []
    try:
        entries = list(os.scandir(DEV_SHM))
    except FileNotFoundError:
        return [], []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            continue
        if entry.name.startswith(_SEMAPHORE_FILE_PREFIX):
            name = entry.name[len(_SEMAPHORE_FILE_PREFIX):]
            if name.startswith(prefix):
                semaphores.append(f"/{name}")
        elif entry.name.startswith(prefix):
            shared.append(f"/{entry.name}")
    return sorted(shared), sorted(semaphores)


def object_path(name: str) -> str:
    """Where Linux keeps the shared-memory object NAME: /dev/shm/NAME (without the '/')."""
    return os.path.join(DEV_SHM, name.lstrip("/"))


def processes_mapping(prefix: str, include_self: bool = False) -> dict[str, set[int]]:
    """Which live processes map something in /dev/shm whose name starts with `prefix` (a
    shared-memory object, a named semaphore, a file of a directory there), from
    /proc/PID/maps: {path in /dev/shm: pids}. This process is left out (but with
    `include_self`), and so are processes whose maps this user may not read (another
    user's: they cannot map our owner-only objects). Linux only; no /proc: {}. What a
    cleanup must not remove: what a process uses.

    Matched by device and inode, not by the path a map shows: sem_open creates a semaphore
    under a temporary name, maps it, then links it to its real name, so its creator's map
    shows the temporary name, deleted. NOTE: a process holding only a descriptor (no mmap)
    is not seen; our code maps every object it opens and closes the descriptor."""
    paths = _files_under(prefix)
    if not paths:
        return {}
    device = os.stat(DEV_SHM).st_dev
    wanted_dev = f"{os.major(device):02x}:{os.minor(device):02x}"
    by_inode = {}
    for path in paths:
        try:
            by_inode[os.lstat(path).st_ino] = path
        except FileNotFoundError:  # removed meanwhile
            continue
    found: dict[str, set[int]] = {}
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        if pid == os.getpid() and not include_self:
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[3] == wanted_dev and int(fields[4]) in by_inode:
                found.setdefault(by_inode[int(fields[4])], set()).add(pid)
    return found


def mapped_only_by(pids: set[int], skip_prefix: str) -> list[tuple[str, int]]:
    """The objects of this user directly in /dev/shm that the processes `pids` map and no
    other process does (this one included), as (path, inode), but those named with
    `skip_prefix` (and anything in a directory there): what a group of processes killed
    together would leave behind, since nobody else unlinks them. Another user's objects are
    never among them: their other users' maps cannot be read."""
    found = []
    for path, users in processes_mapping("", include_self=True).items():
        name = os.path.relpath(path, DEV_SHM)
        if not users <= pids or os.sep in name or name.startswith((skip_prefix, _SEMAPHORE_FILE_PREFIX + skip_prefix)):
            continue
        try:
            info = os.lstat(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        if info.st_uid == os.geteuid():
            found.append((path, info.st_ino))
    return found


def unlink_if_same(path: str, inode: int) -> bool:
    """Remove `path` if it is still the file `inode` (not one made since under its name);
    whether it did. One that cannot be removed is left (the caller's cleanup is best effort)."""
    try:
        if os.lstat(path).st_ino != inode:
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def _files_under(prefix: str) -> list[str]:
    """Every file in /dev/shm named with `prefix` (a semaphore's sem.PREFIX too), and every
    file inside such a directory."""
    try:
        entries = list(os.scandir(DEV_SHM))
    except FileNotFoundError:
        return []
    paths = []
    for entry in entries:
        if not entry.name.startswith((prefix, _SEMAPHORE_FILE_PREFIX + prefix)):
            continue
        if entry.is_dir(follow_symlinks=False):
            paths.extend(os.path.join(root, name) for root, _dirs, files in os.walk(entry.path) for name in files)
        else:
            paths.append(entry.path)
    return paths


def _check_semaphore_file(name: str) -> os.stat_result:
    """The semaphore's file, if it is a regular file of ours that nobody else may open."""
    path = semaphore_path(name)
    try:
        info = os.lstat(path)
    except FileNotFoundError as exc:
        raise ObjectMissingError(f"semaphore {name} does not exist (no {path})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise StaleObjectError(f"semaphore {name}: {path} is not a regular file ({stat.filemode(info.st_mode)})")
    if info.st_uid != os.geteuid():
        raise StaleObjectError(
            f"semaphore {name} ({path}) belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): "
            f"another user created it under this name; remove it (as that user or root: rm {path})")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise StaleObjectError(
            f"semaphore {name} ({path}) has mode {oct(stat.S_IMODE(info.st_mode))}, not owner-only: "
            f"others may use it; remove it (rm {path})")
    return info


def unlink_quietly(shm_names: list[str], sem_names: list[str]) -> list[str]:
    """Unlink whatever of these exists and is ours to unlink; return the names removed (for
    reports). One another user made under our name cannot be removed by us (/dev/shm is
    sticky): it is left, never a reason to fail."""
    removed = []
    for unlink, names in ((posix_ipc.unlink_shared_memory, shm_names), (posix_ipc.unlink_semaphore, sem_names)):
        for name in names:
            try:
                unlink(name)
                removed.append(name)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                pass
    return removed


def semaphore_mode(name: str) -> int:
    """Permission bits of a named semaphore (Linux keeps them in /dev/shm/sem.NAME)."""
    path = semaphore_path(name)
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError as exc:
        raise ShmError(f"semaphore {name} not found at {path}") from exc


class Doorbell:
    """One semaphore many writers ring and a single reader (the broker) sleeps on.

    Owner: the reader creates and unlinks it; writers attach by name (the ring header names
    it). Process-safe (a POSIX semaphore); not meant to be shared between threads of one
    process beyond what the semaphore itself allows.

    Ringing posts only when no wake-up is already pending (value 0), so the count stays
    at most a few however long the reader stays busy (a semaphore's count overflows at
    2**31 posts). A wait that returns is a hint to look at every ring, never a count.
    """

    def __init__(self, name: str, sem: posix_ipc.Semaphore, creator: bool) -> None:
        self.name = name
        self._sem = sem
        self.is_creator = creator
        self._unlinked = False

    @classmethod
    def create(cls, name: str) -> Doorbell:
        return cls(name, open_semaphore(name, create=True), creator=True)

    @classmethod
    def attach(cls, name: str) -> Doorbell:
        return cls(name, open_semaphore(name, create=False), creator=False)

    def ring(self) -> None:
        if self._sem.value == 0:
            self._sem.release()

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or `timeout_s` passes; True if rung."""
        try:
            self._sem.acquire(max(timeout_s, 0.0))
            return True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False  # timed out, or a signal arrived: the caller looks again

    def close(self) -> None:
        self._sem.close()

    def unlink(self) -> None:
        if not self.is_creator:
            raise ShmError(f"doorbell {self.name}: only its creator unlinks it")
        if not self._unlinked:
            self._unlinked = True
            unlink_quietly([], [self.name])
