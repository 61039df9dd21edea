"""Ended owners (`pipeline/wire/owners.py`): which items a consumer answers without running
them, read from the data directory's append-only file, against a plain reference."""

from __future__ import annotations

import os
import random

from pipeline.batchjob.layout import encode_job_payload
from pipeline.wire.owners import (
    ENDED_OWNERS_NAME,
    OWNED_PAYLOAD_MAGIC,
    EndedOwners,
    add_ended_owner,
    payload_owner,
)


def owned(owner: int, tail: bytes = b"") -> bytes:
    return OWNED_PAYLOAD_MAGIC + b"\x01\x00\x00\x00" + owner.to_bytes(8, "little") + tail


def test_a_payload_names_its_owner_only_with_the_magic_and_the_whole_id() -> None:
    assert payload_owner(owned(7)) == 7
    assert payload_owner(owned(2**64 - 1, b"more")) == 2**64 - 1
    assert payload_owner(owned(7)[:15]) is None  # the id cut short
    assert payload_owner(b"XXXX" + owned(7)[4:]) is None
    assert payload_owner(b"") is None
    job_id = 0x1234_5678_9ABC_DEF0
    assert payload_owner(encode_job_payload(job_id, 3, 0, 10, 99)) == job_id  # a batch job's items are owned


def test_the_ended_owners_are_read_as_the_file_grows_and_a_torn_tail_is_left_out(tmp_path) -> None:
    ended = EndedOwners(str(tmp_path))
    ended.refresh()  # no file yet: nobody ended
    assert ended.owners == frozenset() and ended.positions([owned(1)]) == []
    add_ended_owner(str(tmp_path), 1)
    add_ended_owner(str(tmp_path), 2**63 + 5)
    path = tmp_path / ENDED_OWNERS_NAME
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path, "ab") as f:
        f.write(b"\x09\x00\x00")  # a write cut short
    ended.refresh()
    assert ended.owners == {1, 2**63 + 5}
    assert ended.positions([owned(1), b"plain", owned(3), owned(2**63 + 5)]) == [0, 3]
    add_ended_owner(str(tmp_path), 3)  # the torn tail is cut first: no id after it is read shifted
    ended.refresh()
    assert ended.owners == {1, 2**63 + 5, 3} and os.path.getsize(path) == 24
    assert EndedOwners(None).positions([owned(1)]) == []  # a consumer that serves no data directory yet


def test_positions_match_a_reference_over_random_batches(tmp_path) -> None:
    rng = random.Random(5)
    ended_ids: set[int] = set()
    ended = EndedOwners(str(tmp_path))
    for _step in range(200):
        if rng.random() < 0.2:
            owner = rng.randrange(16)
            add_ended_owner(str(tmp_path), owner)
            ended_ids.add(owner)
        ended.refresh()
        payloads = [owned(rng.randrange(16)) if rng.random() < 0.8 else rng.randbytes(rng.randrange(20))
                    for _ in range(rng.randrange(10))]
        expected = [k for k, p in enumerate(payloads)
                    if len(p) >= 16 and p[:4] == OWNED_PAYLOAD_MAGIC and int.from_bytes(p[8:16], "little") in ended_ids]
        assert ended.positions(payloads) == expected
