"""The shared-memory ring, with real second processes: content, wrap-around, blocking,
kill -9 of the writer, permissions, stale objects, closing and unlinking."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import posix_ipc
import pytest

from shm.errors import (
    ObjectExistsError,
    ObjectMissingError,
    RecordTooLargeError,
    RingClosedError,
    RingTimeoutError,
    ShmError,
    StaleObjectError,
)
from shm.objects import OWNER_ONLY_MODE, Doorbell, create_shared_memory, semaphore_mode
from shm.ring import RingReader, RingWriter, SharedRing
from shm.ring_layout import (
    HEADER_SIZE_BYTES,
    RECORD_ALIGN_BYTES,
    RECORD_DATA,
    RECORD_HEADER_DTYPE,
    RECORD_HEADER_SIZE_BYTES,
    RING_HEADER_DTYPE,
    RING_LAYOUT_VERSION,
    RING_MAGIC,
    max_body_bytes,
    unreleased_records,
)

# Random bytes that record bodies are cut from: record i is POOL[start(i) : start(i) + size(i)],
# so a reader can check every byte and the order without being told anything.
POOL = np.random.default_rng(7).integers(0, 256, size=1 << 20, dtype=np.uint8)


def body_for(i: int, size: int) -> np.ndarray:
    start = (i * 7919) % (POOL.shape[0] - size)
    return POOL[start:start + size]


@contextmanager
def ring_pair(shm_name, capacity: int = 4096, **options) -> Iterator[tuple[RingWriter, RingReader]]:
    """A new ring and a reader of it; both closed and the ring unlinked afterwards."""
    writer = RingWriter.create(shm_name(), capacity, **options)
    reader = RingReader.attach(writer.name)
    try:
        yield writer, reader
    finally:
        reader.close()
        writer.close()
        writer.unlink()


def sizes_for(seed: int, count: int, max_size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, max_size + 1, size=count)


def writer_proc(name: str, seed: int, count: int, max_size: int, first: int = 0) -> None:
    writer = RingWriter.attach(name)
    for i, size in enumerate(sizes_for(seed, count, max_size)[first:], start=first):
        writer.write(body_for(i, int(size)), timeout_s=60)
    writer.close()


def read_and_check(reader: RingReader, seed: int, count: int, max_size: int, first: int = 0) -> int:
    """Read records first..count-1, checking every byte; releases in groups of 64."""
    sizes = sizes_for(seed, count, max_size)
    for i in range(first, count):
        record = reader.peek(timeout_s=60)
        assert record is not None, f"nothing after record {i - 1}"
        expected = body_for(i, int(sizes[i]))
        assert record.body.shape[0] == expected.shape[0], f"record {i}: size {record.body.shape[0]}"
        assert np.array_equal(record.body, expected), f"record {i}: content differs"
        if i % 64 == 63 or i == count - 1:
            reader.release(record.end)
    return count - first


def stream_through_second_process(shm_name, ctx, count: int, seed: int, max_size: int, capacity: int) -> None:
    name = shm_name()
    reader = RingReader.create(name, capacity)
    child = ctx.Process(target=writer_proc, args=(name, seed, count, max_size))
    child.start()
    try:
        assert read_and_check(reader, seed, count, max_size) == count
        with pytest.raises(RingClosedError):
            reader.peek(timeout_s=10)
    finally:
        child.join(30)
        reader.close()
        reader.unlink()
    assert child.exitcode == 0


@pytest.mark.campaign
def test_two_processes_two_million_records_across_wraparound(shm_name, ctx):
    # A 64 KiB ring and records of 0..300 bytes: the ring laps about 6,000 times and record
    # starts land on every 16-byte offset of the data region.
    stream_through_second_process(shm_name, ctx, 2_000_000, seed=11, max_size=300, capacity=1 << 16)


@pytest.mark.campaign
@pytest.mark.slow
def test_two_processes_twenty_million_records(shm_name, ctx):
    stream_through_second_process(shm_name, ctx, 20_000_000, seed=12, max_size=200, capacity=1 << 14)


def test_every_body_size_at_every_offset(shm_name):
    # One process, deterministic: a 4 KiB ring; at every 16-byte start offset, bodies of
    # every size modulo 16, the smallest sizes and the largest ones (which must wrap).
    capacity = 4096
    limit = max_body_bytes(capacity)
    sizes = list(range(0, 40)) + list(range(limit - 40, limit + 1))
    i = 0

    def put_and_check(size: int) -> None:
        nonlocal i
        writer.write(body_for(i, size))
        record = reader.poll()
        assert record is not None and np.array_equal(record.body, body_for(i, size)), (i, size)
        assert reader.poll() is None
        reader.release(record.end)
        i += 1

    with ring_pair(shm_name, capacity) as (writer, reader):
        for offset in range(0, capacity, RECORD_ALIGN_BYTES):
            for size in sizes:
                # Filler records move the next start to `offset` (each at most half the ring).
                while (gap := (offset - writer.write_pos) % capacity) != 0:
                    tail = capacity - writer.write_pos % capacity  # fillers never wrap
                    put_and_check(min(gap, tail, capacity // 2) - RECORD_HEADER_SIZE_BYTES)
                put_and_check(size)


def test_zero_copy_views(shm_name):
    with ring_pair(shm_name) as (writer, reader):
        writer.write(b"x" * 40)
        record = reader.poll()
        # The body is a view into the mapping, not a copy, and it is read-only.
        assert record.body.base is not None and not record.body.flags.owndata
        assert not record.body.flags.writeable
        address = record.body.__array_interface__["data"][0]
        region = reader.data.__array_interface__["data"][0]
        assert region <= address < region + reader.capacity_bytes
        assert (address - region) % RECORD_ALIGN_BYTES == 0
        del record


def test_the_control_block_and_a_record_header_read_back_field_by_field(shm_name):
    # Written by position (structs and word views), read here by name: a swapped field fails.
    with ring_pair(shm_name, 8192, doorbell=None) as (writer, reader):
        writer.write(b"abc")
        header = np.frombuffer(writer._header, dtype=RING_HEADER_DTYPE, count=1)[0]
        assert (bytes(header["magic"]), header["layout_version"], header["header_size"]) == (
            RING_MAGIC, RING_LAYOUT_VERSION, HEADER_SIZE_BYTES)
        assert (header["capacity"], header["creator_pid"], header["record_align"]) == (8192, os.getpid(),
                                                                                         RECORD_ALIGN_BYTES)
        assert (header["write_pos"], header["read_pos"]) == (RECORD_HEADER_SIZE_BYTES + 16, 0)
        assert (header["writer_pid"], header["reader_pid"], header["writer_closed"]) == (os.getpid(), os.getpid(), 0)
        record = np.frombuffer(writer.buf, dtype=RECORD_HEADER_DTYPE, count=1)[0]
        assert (record["body_size"], record["kind"], record["pos"]) == (3, RECORD_DATA, 0)
        del header, record


def slow_reader_proc(name: str, count: int, pipe) -> None:
    reader = RingReader.attach(name)
    pipe.recv()  # wait until the writer is blocked
    for _ in range(count):
        record = reader.peek(timeout_s=30)
        reader.release(record.end)
    pipe.send("done")
    reader.close(mark_closed=False)


@pytest.mark.integration
def test_full_ring_times_out_then_blocks_until_released(shm_name, ctx):
    name = shm_name()
    writer = RingWriter.create(name, 4096)
    body = b"z" * 1000  # 1,016 bytes with header: four fit in 4 KiB
    for _ in range(4):
        writer.write(body, timeout_s=0)
    used = writer.write_pos
    with pytest.raises(RingTimeoutError, match="full"):
        writer.write(body, timeout_s=0.05)
    assert writer.write_pos == used  # a timed-out write publishes nothing
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=slow_reader_proc, args=(name, 5, child_end))
    child.start()
    try:
        parent.send("go")
        writer.write(body, timeout_s=None)  # blocks until the reader releases room
        assert parent.recv() == "done"
    finally:
        child.join(30)
        writer.close()
        writer.unlink()
    assert child.exitcode == 0


def test_peek_timeout_returns_none_on_empty_ring(shm_name):
    with ring_pair(shm_name) as (_writer, reader):
        assert reader.peek(timeout_s=0.01) is None
        assert reader.poll() is None


def killed_writer_proc(name: str, record_size: int, pipe) -> None:
    """Write whole records, then reserve one more, fill half of it, report, and wait to die."""
    writer = RingWriter.attach(name)
    for i in range(3):
        writer.write(body_for(i, record_size))
    offset = writer.reserve(record_size)
    writer.buf[offset:offset + record_size // 2] = body_for(3, record_size)[: record_size // 2]
    pipe.send("mid-record")
    signal.pause()


@pytest.mark.integration
def test_writer_killed_mid_record_leaves_no_torn_record(shm_name, ctx):
    name = shm_name()
    reader = RingReader.create(name, 1 << 16)
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=killed_writer_proc, args=(name, 5000, child_end))
    child.start()
    assert parent.recv() == "mid-record"
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    try:
        for i in range(3):
            record = reader.peek(timeout_s=5)
            assert np.array_equal(record.body, body_for(i, 5000))
        assert reader.peek(timeout_s=0.05) is None  # the half-written record never appears
        # A new writer reattaches and goes on where the published records end.
        writer = RingWriter.attach(name)
        writer.write(body_for(9, 300))
        assert np.array_equal(reader.peek(timeout_s=5).body, body_for(9, 300))
        writer.close()
    finally:
        reader.close()
        reader.unlink()


def busy_writer_proc(name: str, seed: int) -> None:
    writer = RingWriter.attach(name)
    rng = np.random.default_rng(seed)
    i = 0
    while True:
        size = int(rng.integers(1000, 60_000))
        writer.write(body_for(i, size), timeout_s=None)
        i += 1


@pytest.mark.integration
@pytest.mark.parametrize("kill_round", range(10))
def test_writer_killed_at_random_moments(shm_name, ctx, kill_round):
    # Big records so a SIGKILL often lands inside a copy; every record the reader sees must
    # be whole and in order, and after the kill nothing more appears.
    name = shm_name()
    reader = RingReader.create(name, 1 << 18)
    rng = np.random.default_rng(100 + kill_round)
    child = ctx.Process(target=busy_writer_proc, args=(name, kill_round))
    child.start()
    sizes = np.random.default_rng(kill_round)
    seen = 0
    try:
        budget = int(rng.integers(20, 400))
        while seen < budget:
            record = reader.peek(timeout_s=30)
            size = int(sizes.integers(1000, 60_000))
            assert np.array_equal(record.body, body_for(seen, size)), f"record {seen}"
            reader.release(record.end)
            seen += 1
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        while (record := reader.poll()) is not None:
            size = int(sizes.integers(1000, 60_000))
            assert np.array_equal(record.body, body_for(seen, size)), f"record {seen} after kill"
            reader.release(record.end)
            seen += 1
        assert reader.read_pos == reader.write_pos
    finally:
        if child.is_alive():
            child.kill()
        reader.close()
        reader.unlink()


def test_objects_are_owner_only_even_with_open_umask(shm_name):
    old = os.umask(0)
    try:
        bell = Doorbell.create(shm_name("bell"))
        name = shm_name()
        writer = RingWriter.create(name, 4096, doorbell=bell.name)
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm{name}").st_mode)
        assert mode == OWNER_ONLY_MODE
        for suffix in (".d", ".s"):
            assert semaphore_mode(name + suffix) == OWNER_ONLY_MODE
        assert semaphore_mode(bell.name) == OWNER_ONLY_MODE
    finally:
        writer.close()
        writer.unlink()
        bell.close()
        bell.unlink()


def test_attach_refuses_a_group_readable_object(shm_name):
    name = shm_name()
    writer = RingWriter.create(name, 4096)
    try:
        os.chmod(f"/dev/shm{name}", 0o644)
        with pytest.raises(StaleObjectError, match="owner-only"):
            RingReader.attach(name)
    finally:
        writer.close()
        writer.unlink()


def test_leftover_of_same_layout_is_reattached_with_its_records(shm_name):
    name = shm_name()
    crashed = RingWriter.create(name, 4096)
    crashed.write(b"before the crash")
    # The creator "crashes": its handle is dropped without closing or unlinking.
    with pytest.raises(ObjectExistsError):
        RingWriter.create(name, 4096)
    again = RingWriter.create(name, 4096, reattach=True)
    again.write(b"after the restart")
    reader = RingReader.attach(name)
    try:
        assert bytes(reader.poll().body) == b"before the crash"
        assert bytes(reader.poll().body) == b"after the restart"
        assert again.is_creator
    finally:
        reader.close()
        again.close()
        crashed.close()
        again.unlink()


def test_leftover_of_other_capacity_is_reported(shm_name):
    name = shm_name()
    old = RingWriter.create(name, 4096)
    try:
        with pytest.raises(StaleObjectError, match="capacity"):
            RingWriter.create(name, 8192, reattach=True)
    finally:
        old.close()
        old.unlink()


def _write_foreign_object(name: str, header: bytes, size: int) -> None:
    mapping, _ = create_shared_memory(name, size)
    mapping[: len(header)] = header
    mapping.close()


@pytest.mark.parametrize(
    "header, match",
    [
        (b"NOTARING" + bytes(24), "magic"),
        (b"SHMRING1" + (RING_LAYOUT_VERSION + 1).to_bytes(4, "little") + bytes(20), "layout version"),
        (
            b"SHMRING1" + RING_LAYOUT_VERSION.to_bytes(4, "little") + HEADER_SIZE_BYTES.to_bytes(4, "little")
            + (1 << 20).to_bytes(8, "little"),
            "do not match",
        ),
    ],
    ids=["foreign-magic", "other-version", "wrong-capacity"],
)
def test_stale_object_with_another_layout_is_reported_never_read(shm_name, header, match):
    name = shm_name()
    _write_foreign_object(name, header, HEADER_SIZE_BYTES + 4096)
    try:
        with pytest.raises(StaleObjectError, match=match):
            RingReader.attach(name)
        with pytest.raises(StaleObjectError, match=match):
            RingWriter.create(name, 4096, reattach=True)
    finally:
        assert SharedRing.unlink_leftover(name) == [name]


def test_attach_missing_ring(shm_name):
    with pytest.raises(ObjectMissingError):
        RingReader.attach(shm_name())


def test_only_the_creator_unlinks_and_only_once(shm_name):
    name = shm_name()
    writer = RingWriter.create(name, 4096)
    reader = RingReader.attach(name)
    with pytest.raises(ShmError, match="only its creator"):
        reader.unlink()
    writer.unlink()
    writer.unlink()  # second call: nothing left to do, no error
    assert not os.path.exists(f"/dev/shm{name}")
    assert not os.path.exists(f"/dev/shm/sem.{name[1:]}.d")
    with pytest.raises(ObjectMissingError):
        RingReader.attach(name)
    reader.close()
    writer.close()


def test_writer_close_ends_the_stream_after_the_last_record(shm_name):
    with ring_pair(shm_name) as (writer, reader):
        writer.write(b"last")
        writer.close()
        with pytest.raises(RingClosedError):
            writer.write(b"more")
        assert bytes(reader.peek(timeout_s=1).body) == b"last"
        with pytest.raises(RingClosedError):
            reader.peek(timeout_s=1)


def test_closed_reader_fails_a_writer_that_needs_room(shm_name):
    with ring_pair(shm_name) as (writer, reader):
        for _ in range(4):
            writer.write(b"q" * 1000)
        reader.close()
        with pytest.raises(RingClosedError, match="reader closed"):
            writer.write(b"q" * 1000, timeout_s=5)


def test_record_larger_than_half_the_ring_is_refused(shm_name):
    with ring_pair(shm_name) as (writer, _reader):
        writer.write(b"a" * max_body_bytes(4096))
        with pytest.raises(RecordTooLargeError, match="limit"):
            writer.write(b"a" * (max_body_bytes(4096) + 1))


def test_reader_that_restarts_sees_unreleased_records_again(shm_name):
    name = shm_name()
    writer = RingWriter.create(name, 4096)
    first = RingReader.attach(name)
    for word in (b"one", b"two", b"three"):
        writer.write(word)
    assert bytes(first.poll().body) == b"one"
    first.release(first.cursor)
    assert bytes(first.poll().body) == b"two"  # peeked, never released
    first.close(mark_closed=False)  # the reader dies
    second = RingReader.attach(name)
    try:
        assert [bytes(second.poll().body) for _ in range(2)] == [b"two", b"three"]
    finally:
        second.close()
        writer.close()
        writer.unlink()


def test_scribbled_record_header_is_reported_not_misread(shm_name):
    with ring_pair(shm_name) as (writer, reader):
        writer.write(b"fine")
        writer.write(b"damaged")
        first_end = reader.poll().end
        # Overwrite the second record's header (its own-position word) as a stray writer would.
        second_at = first_end % 4096
        writer.buf[second_at + 8:second_at + 16] = (12345).to_bytes(8, "little")
        with pytest.raises(StaleObjectError, match="own position 12345"):
            reader.poll()


def doorbell_waiter_proc(bell_name: str, names: list[str], expected: int, pipe) -> None:
    bell = Doorbell.attach(bell_name)
    readers = [RingReader.attach(n) for n in names]
    got = []
    pipe.send("ready")
    while len(got) < expected:
        if not bell.wait(30):
            break
        for reader in readers:
            while (record := reader.poll()) is not None:
                got.append(bytes(record.body))
                reader.release(record.end)
    pipe.send(sorted(got))
    for reader in readers:
        reader.close(mark_closed=False)
    bell.close()


@pytest.mark.integration
def test_one_reader_sleeps_on_a_doorbell_for_many_rings(shm_name, ctx):
    bell = Doorbell.create(shm_name("bell"))
    names = [shm_name() for _ in range(3)]
    writers = [RingWriter.create(n, 4096, doorbell=bell.name) for n in names]
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=doorbell_waiter_proc, args=(bell.name, names, 30, child_end))
    child.start()
    try:
        assert parent.recv() == "ready"
        expected = []
        for i in range(10):
            for k, writer in enumerate(writers):
                body = f"ring{k}-{i:02d}".encode()
                writer.write(body)
                expected.append(body)
        assert parent.recv() == sorted(expected)
    finally:
        child.join(30)
        for writer in writers:
            writer.close()
            writer.unlink()
        bell.close()
        bell.unlink()
    assert child.exitcode == 0


def test_doorbell_count_stays_bounded(shm_name):
    bell = Doorbell.create(shm_name("bell"))
    try:
        with ring_pair(shm_name, 1 << 16, doorbell=bell.name) as (writer, reader):
            for _ in range(5000):
                writer.write(b"r")
                reader.release(reader.poll().end)
            for name in (bell.name, writer.name + ".d"):
                sem = posix_ipc.Semaphore(name)
                assert sem.value <= 1, name
                sem.close()
    finally:
        bell.close()
        bell.unlink()


def test_unreleased_records_are_read_across_the_wrap_and_nothing_changes(shm_name):
    """What a stopped run's stock-taking reads: every record after the reader's released
    position, in order, across a wrap, with no position, flag or pid written."""
    name = shm_name()
    writer = RingWriter.create(name, 4096)
    reader = RingReader.attach(name)
    try:
        for k in range(60):  # 60 records of 96 bytes pass the 4 KiB end of the data region
            writer.write(bytes([k]) * 80)
            if k < 40:
                reader.release(reader.poll().end)
        assert writer.read_pos & 4095 > writer.write_pos & 4095  # the unreleased records wrap
        reader.poll()  # peeked, not released: still unreleased
        header = bytes(writer._header)
        assert unreleased_records(name) == [bytes([k]) * 80 for k in range(40, 60)]
        assert bytes(writer._header) == header
        reader.release(reader.cursor)
        assert unreleased_records(name) == [bytes([k]) * 80 for k in range(41, 60)]
    finally:
        reader.close()
        writer.close()
        writer.unlink()


def test_unreleased_records_of_a_scribbled_ring_are_refused(shm_name):
    name = shm_name()
    writer = RingWriter.create(name, 4096)
    try:
        writer.write(b"x" * 100)
        writer.buf[4] = 9  # the record's kind is neither data nor wrap
        with pytest.raises(StaleObjectError, match="record at position 0"):
            unreleased_records(name)
    finally:
        writer.close()
        writer.unlink()


@pytest.mark.parametrize("missing", [".d", ".s"])
def test_a_ring_whose_semaphore_its_creator_unlinked_is_missing_not_a_crash(shm_name, missing):
    # A producer that closed and unlinked its ring between the broker's open of the memory
    # and of its semaphores: attach must raise ObjectMissingError and leave nothing open
    # (it raised BufferError closing a map with live views, which killed the broker).
    writer = RingWriter.create(shm_name(), 4096)
    try:
        posix_ipc.unlink_semaphore(writer.name + missing)
        with pytest.raises(ObjectMissingError, match=f"semaphore {writer.name}{missing}"):
            RingReader.attach(writer.name)
    finally:
        writer.close()
        writer.unlink()


def test_a_writer_whose_doorbell_is_gone_fails_with_that_not_a_buffer_error(shm_name):
    """A broker that stops while a producer registers unlinks the doorbell it named: the
    ring's creation fails on it, its views released before the map is closed, and nothing
    of the ring is left (the fixture checks)."""
    with pytest.raises(ObjectMissingError):
        RingWriter.create(shm_name(), 4096, doorbell=shm_name("bell"))
