"""A small real tmpfs for tests of a full results disk: mounted for one test, always unmounted;
and a command run with a small /dev/shm of its own (a private mount namespace: the
machine's /dev/shm is untouched).

Needs root and a kernel that lets it mount (skips with the reason otherwise).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# Small enough to fill in a few milliseconds, large enough for a few hundred results lines
# once the filler is gone.
TMPFS_SIZE_BYTES = 256 << 10
FILLER_NAME = "filler.bin"
_CHUNK_BYTES = 4096


@contextmanager
def small_tmpfs(directory: str, size_bytes: int = TMPFS_SIZE_BYTES) -> Iterator[str]:
    """A tmpfs of `size_bytes` mounted on `directory` (created, mode 0700) for the block."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.makedirs(directory, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", directory],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {directory}: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", directory], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", directory], capture_output=True)  # still busy: detach it


def fill(directory: str, leave_bytes: int = 0) -> str:
    """Fill the file system of `directory` with a filler file until a write finds it full,
    then give back `leave_bytes` (whole pages); the filler's path (delete it: space back)."""
    path = os.path.join(directory, FILLER_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        chunk = b"\0" * _CHUNK_BYTES
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        if leave_bytes:
            size = os.fstat(fd).st_size
            os.ftruncate(fd, max(0, size - leave_bytes) // _CHUNK_BYTES * _CHUNK_BYTES)
    finally:
        os.close(fd)
    return path


def with_small_dev_shm(size_bytes: int, command: list[str], timeout_s: float, **popen) -> subprocess.CompletedProcess:
    """Run `command` (stdout and stderr captured as text) in a private mount namespace whose
    /dev/shm is a fresh tmpfs of `size_bytes` (rounded up to pages): what a container's
    /dev/shm looks like (Docker's default is 64 MiB). Skips without root or unshare."""
    if os.geteuid() != 0:
        pytest.skip("a private /dev/shm needs root (unshare --mount, mount -t tmpfs)")
    private = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    mount = f"mount -t tmpfs -o size={size_bytes},mode=1777 tmpfs /dev/shm"
    try:
        probe = subprocess.run([*private, mount], capture_output=True, text=True)
    except FileNotFoundError as exc:
        pytest.skip(f"no unshare here: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace: {probe.stderr.strip()}")
    return subprocess.run([*private, f'{mount} && exec "$@"', "sh", *command], capture_output=True, text=True,
                          timeout=timeout_s, **popen)
