"""Named POSIX objects: per-run names, name checks, doorbell wake-ups across processes, the
owner and mode checks before an existing semaphore is opened (another user's, or one
others may use, is refused; test_control_users.py plants one as a second user), the one
listing of what exists under a prefix, and which processes map what (what a cleanup must
leave); every page of a new object reserved at its creation, so a /dev/shm without room is
a ShmSpaceError then (a real small /dev/shm: at the limit and one page past), never a SIGBUS
on a later write."""

from __future__ import annotations

import errno
import json
import os
import sys

import pytest

import shm.objects
from shm.errors import ObjectExistsError, ObjectMissingError, ShmError, ShmSpaceError, StaleObjectError
from shm.objects import (
    DEV_SHM,
    MAX_NAME_LENGTH,
    PAGE_BYTES,
    Doorbell,
    check_name,
    create_shared_memory,
    named_objects,
    object_footprint_bytes,
    object_name,
    object_path,
    open_semaphore,
    processes_mapping,
    semaphore_path,
    unlink_quietly,
)
from shm.ring_layout import HEADER_SIZE_BYTES, ring_footprint_bytes
from tests.consumer.tmpfs import with_small_dev_shm
from tests.support.repo import ROOT


def test_object_names_are_per_run_and_checked():
    assert object_name("sbrk", "1a2b", "producer-3") == "/sbrk-1a2b-producer-3"
    assert object_name("sbrk", "run1", "x") != object_name("sbrk", "run2", "x")
    for bad in ("no-slash", "/has/slash", "/spa ce", "/" + "a" * MAX_NAME_LENGTH):
        with pytest.raises(ValueError):
            check_name(bad)


def test_doorbell_create_attach_unlink(shm_name):
    bell = Doorbell.create(shm_name("bell"))
    with pytest.raises(ObjectExistsError):
        Doorbell.create(bell.name)
    other = Doorbell.attach(bell.name)
    assert not bell.wait(0.01)
    other.ring()
    other.ring()  # a pending wake-up is not doubled
    assert bell.wait(0.01)
    assert not bell.wait(0.01)
    with pytest.raises(ShmError, match="only its creator"):
        other.unlink()
    other.close()
    bell.close()
    bell.unlink()
    with pytest.raises(ObjectMissingError):
        Doorbell.attach(bell.name)


def test_an_existing_semaphore_is_opened_only_if_owner_only(shm_name):
    name = shm_name("bell")
    ours = open_semaphore(name, create=True)
    path = semaphore_path(name)
    try:
        os.chmod(path, 0o666)  # others could post it or wait on it
        with pytest.raises(StaleObjectError, match=f"semaphore {name} .* has mode 0o666, not owner-only"):
            open_semaphore(name, create=False)
        os.chmod(path, 0o600)
        open_semaphore(name, create=False).close()
    finally:
        ours.close()
        unlink_quietly([], [name])
    with pytest.raises(ObjectMissingError, match=f"semaphore {name} does not exist"):
        open_semaphore(name, create=False)


def test_a_semaphore_name_that_is_a_link_is_refused(shm_name):
    target, name = shm_name("bell"), shm_name("bell")
    real = open_semaphore(target, create=True)
    os.symlink(semaphore_path(target), semaphore_path(name))
    try:
        with pytest.raises(StaleObjectError, match="is not a regular file"):
            open_semaphore(name, create=False)
    finally:
        os.unlink(semaphore_path(name))
        real.close()
        unlink_quietly([], [target])


def test_named_objects_lists_shared_memory_and_semaphores_under_a_prefix(shm_name):
    ring, bell = shm_name("ring"), shm_name("bell")
    mapping, _inode = create_shared_memory(ring, 4096)
    sem = open_semaphore(bell, create=True)
    directory = os.path.join(DEV_SHM, f"{shm_name.tag}-store")  # a tmpfs data directory: neither
    os.mkdir(directory)
    try:
        assert named_objects(shm_name.tag) == ([ring], [bell])
        assert named_objects(ring.lstrip("/")) == ([ring], [])
        assert named_objects(f"{shm_name.tag}-none") == ([], [])
    finally:
        os.rmdir(directory)
        mapping.close()
        sem.close()
        unlink_quietly([ring], [bell])


def _map_and_wait(name: str, bell: str, mapped, release) -> None:
    memory, _inode = create_shared_memory(name, 4096)
    sem = open_semaphore(bell, create=True)
    mapped.set()
    release.wait(30)
    memory.close()
    sem.close()


@pytest.mark.integration
def test_processes_mapping_names_the_live_processes_that_map_an_object(shm_name, ctx):
    name, bell, mine = shm_name("ring"), shm_name("bell"), shm_name("mine")
    mapped, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_map_and_wait, args=(name, bell, mapped, release))
    child.start()
    try:
        assert mapped.wait(30)
        found = processes_mapping(shm_name.tag)
        assert found == {object_path(name): {child.pid}, semaphore_path(bell): {child.pid}}
        memory, _inode = create_shared_memory(mine, 4096)  # this process: left out
        assert set(processes_mapping(shm_name.tag)) == set(found)
        memory.close()
    finally:
        release.set()
        child.join(30)
    assert processes_mapping(shm_name.tag) == {}  # it unmapped and exited: nobody uses them
    unlink_quietly([name, mine], [bell])


def test_every_page_of_a_new_object_is_reserved_at_its_creation(shm_name):
    name = shm_name("ring")
    size = 3 * PAGE_BYTES + 1
    mapping, _inode = create_shared_memory(name, size)
    try:
        # tmpfs counts st_blocks in 512-byte units of the pages it holds: all of them, unwritten.
        assert os.stat(object_path(name)).st_blocks * 512 == object_footprint_bytes(size) == 4 * PAGE_BYTES
    finally:
        mapping.close()
        unlink_quietly([name], [])


def test_no_room_at_creation_is_a_typed_error_naming_the_object_and_nothing_is_left(shm_name, monkeypatch):
    def full(_fd: int, _offset: int, _length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.objects.os, "posix_fallocate", full)
    name = shm_name("ring")
    with pytest.raises(ShmSpaceError, match=rf"no room for shared-memory object {name} of 1,048,576 bytes: "
                                            rf"[\d,]+ of its [\d,]+ bytes are free; raise its size") as caught:
        create_shared_memory(name, 1 << 20)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)
    assert not os.path.exists(object_path(name))  # made with O_EXCL, half made: removed


# Run in a private /dev/shm of exactly one ring's footprint: the ring fits; with one page
# less its second semaphore finds no room; with the object's last page gone, the object.
_RING_AT_THE_LIMIT = """
import json, os, subprocess, sys
from shm.errors import ShmSpaceError
from shm.ring import RingWriter
capacity, footprint, page = (int(arg) for arg in sys.argv[1:])
found = {}
ring = RingWriter.create("/limit-ring", capacity)
found["fits"] = sorted(os.listdir("/dev/shm"))
ring.close()
ring.unlink()
for name, size in (("semaphore", footprint - page), ("object", footprint - 3 * page)):
    subprocess.run(["mount", "-o", f"remount,size={size}", "/dev/shm"], check=True)
    try:
        RingWriter.create("/limit-ring", capacity)
    except ShmSpaceError as exc:
        found[name] = [str(exc), exc.errno, sorted(os.listdir("/dev/shm"))]
print(json.dumps(found))
"""


@pytest.mark.integration
def test_a_ring_in_a_dev_shm_of_exactly_its_size_fits_and_one_page_less_is_a_typed_error():
    capacity = 1 << 20
    footprint = ring_footprint_bytes(capacity)
    assert footprint == HEADER_SIZE_BYTES + capacity + 2 * PAGE_BYTES  # the object and its two semaphores
    done = with_small_dev_shm(footprint, [sys.executable, "-c", _RING_AT_THE_LIMIT, str(capacity), str(footprint),
                                          str(PAGE_BYTES)], timeout_s=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["fits"] == ["limit-ring", "sem.limit-ring.d", "sem.limit-ring.s"]
    message, code, left = found["semaphore"]
    assert "no room for semaphore /limit-ring.s" in message and code == errno.ENOSPC and left == []
    message, code, left = found["object"]
    assert f"no room for shared-memory object /limit-ring of {HEADER_SIZE_BYTES + capacity:,} bytes" in message
    assert code == errno.ENOSPC and left == []
