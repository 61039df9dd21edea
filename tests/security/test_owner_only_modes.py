"""Everything a live run makes is owner-only whatever the umask (SPEC §7, §12): under umask
000, 022 and 077, with the disk tier and the memory tier, every directory of the data
directory is 0700 and every file 0600 (the socket included), every shared-memory object
and named semaphore in /dev/shm is 0600 and the memory tier's directory 0700, and all of
them belong to this user. Walked while the run serves, not after it stopped: the rings,
semaphores and socket exist only then."""

from __future__ import annotations

import os
import stat

import pytest

from tests.security.live import live_run

pytestmark = pytest.mark.integration

# Every object kind a serving run holds in /dev/shm: at least the producer ring, the
# descriptor ring, two semaphores of each, and the doorbell.
MIN_SHM_OBJECTS = 7


def wrong_modes(paths: list[str]) -> dict[str, str]:
    """Each path whose owner is not us or whose mode is not 0700 (directory) / 0600 (else)."""
    wrong = {}
    for path in paths:
        info = os.lstat(path)
        want = 0o700 if stat.S_ISDIR(info.st_mode) else 0o600
        mode = stat.S_IMODE(info.st_mode)
        if mode != want or info.st_uid != os.geteuid():
            wrong[path] = f"{stat.filemode(info.st_mode)} uid {info.st_uid}"
    return wrong


@pytest.mark.parametrize("mask, storage", [(0o000, "disk"), (0o022, "disk"), (0o077, "disk"), (0o000, "memory")])
def test_every_object_of_a_live_run_is_owner_only(mask, storage):
    with live_run(mask, storage) as run:
        data, shm = run.data_paths(), run.shm_paths()
        kinds = {os.path.relpath(path, run.data_dir).split(os.sep)[0] for path in data}
        assert {"run", "results"} <= kinds
        assert stat.S_ISSOCK(os.lstat(run.socket_path).st_mode)
        assert os.path.exists(os.path.join(run.data_dir, "results", "c0.jsonl"))
        if storage == "disk":  # the unserved model's items are live in segment files
            assert any(path.endswith(".seg") for path in data), data
        else:
            assert any(path.endswith(".seg") for path in shm), shm
        names = [os.path.basename(path) for path in shm]
        assert sum(name.startswith("sem.") for name in names) >= 5 and len(shm) >= MIN_SHM_OBJECTS, names
        assert wrong_modes(data + shm) == {}
