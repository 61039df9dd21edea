"""Named POSIX objects: per-run names, name checks, doorbell wake-ups across processes."""

from __future__ import annotations

import pytest

from shm.objects import MAX_NAME_LENGTH, Doorbell, check_name, object_name
from shm.errors import ObjectExistsError, ObjectMissingError, ShmError


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
