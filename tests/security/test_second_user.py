"""A second local user against a live run made under umask 000 (SPEC §7, §12): it cannot
open, connect to, replace or delete anything the run made, in the data directory or in
/dev/shm; and `pipeline tools cleanup` leaves alone what that user made under our names.

The data directory's parent is open to everyone (0755), so what keeps that user out is the
data directory's own 0700 and each object's 0600, nothing above them. Each attempt must
fail with EACCES or EPERM. Run as a throwaway user (`tests/support/users.py`); skipped, with the
reason, where none can be made.
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from pipeline.runtime.cleanup import apply_cleanup, held_run_lock, plan_cleanup
from pipeline.runtime.datadir import prepare_data_dir
from pipeline.wire.client import broker_status
from shm.objects import DEV_SHM, object_path, semaphore_path, unlink_quietly
from tests.pipeline.harness import wait_until
from tests.security.live import SERVED_ITEMS, live_run, submit
from tests.support.users import CREATE_SEMAPHORE
from tests.support.users import other_user as make_other_user

pytestmark = pytest.mark.integration

# Every way to get at a path the hostile user tries, and what it prints: {path: {try: outcome}}
# (an errno name, or "ok" where the attempt worked). Its own scratch files are removed.
TRY_EVERYTHING = r"""
import errno, json, os, socket, stat, sys
targets = json.loads(sys.argv[1])
outcomes = {}

def attempt(function):
    try:
        function()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def write(path):
    os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW))

def replace(path):
    # A file of ours renamed onto theirs: in /dev/shm (which we may write) or from /tmp.
    scratch = os.path.join(os.path.dirname(path) if path.startswith("/dev/shm/") else "/tmp",
                           f"hostile-{os.getpid()}")
    with open(scratch, "w") as file:
        file.write("hostile")
    try:
        os.rename(scratch, path)
    finally:
        if os.path.lexists(scratch):
            os.unlink(scratch)

def connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    finally:
        sock.close()

for path, kind in targets.items():
    tries = {"read": lambda: os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)),
             "delete": lambda: (os.rmdir if kind == "dir" else os.unlink)(path),
             "replace": lambda: replace(path)}
    if kind == "dir":
        tries["list"] = lambda: os.listdir(path)
        tries["create in"] = lambda: os.close(os.open(os.path.join(path, "planted"), os.O_WRONLY | os.O_CREAT, 0o666))
    elif kind == "socket":
        tries["connect"] = lambda: connect(path)
    else:
        tries["write"] = lambda: write(path)
    outcomes[path] = {name: attempt(function) for name, function in tries.items()}
print(json.dumps(outcomes))
"""

REFUSED = {"EACCES", "EPERM"}


@pytest.fixture
def other_user():
    with make_other_user() as user:
        yield user


def kind_of(path: str) -> str:
    mode = os.lstat(path).st_mode
    return "dir" if stat.S_ISDIR(mode) else "socket" if stat.S_ISSOCK(mode) else "file"


@pytest.mark.parametrize("storage", ["disk", "memory"])
def test_another_user_cannot_open_connect_replace_or_delete_anything(other_user, storage):
    with live_run(0o000, storage) as run:
        targets = {path: kind_of(path) for path in run.data_paths() + run.shm_paths()}
        assert "socket" in targets.values() and any(path.startswith(DEV_SHM) for path in targets)
        outcomes = json.loads(other_user.run(TRY_EVERYTHING, json.dumps(targets)))
        worked = {path: {name: got for name, got in tries.items() if got not in REFUSED}
                  for path, tries in outcomes.items()}
        assert {path: tries for path, tries in worked.items() if tries} == {}
        assert len(outcomes) == len(targets) and all(os.path.lexists(path) for path in targets)
        # ...and the run still serves its own user: one more item goes through.
        submit(run.producer, 0, 1, seed=3)
        wait_until(lambda: broker_status(run.socket_path).items_completed == SERVED_ITEMS + 1, 60, "one more")


def test_cleanup_leaves_what_another_user_made_under_our_names(other_user, tmp_path):
    data = str(tmp_path / "data")
    prepare_data_dir(data)
    os.makedirs(os.path.join(data, "run"), mode=0o700)
    with held_run_lock(data):
        prefix = plan_cleanup(data).prefix
    theirs = f"/{prefix}bell"
    other_user.run(CREATE_SEMAPHORE, theirs)
    assert os.stat(semaphore_path(theirs)).st_uid == other_user.uid
    try:
        open(object_path(f"/{prefix}stray"), "w").close()  # one of ours beside it
        with held_run_lock(data):
            plan = plan_cleanup(data)
            removed = apply_cleanup(plan)
        assert [found.path for found in removed] == [object_path(f"/{prefix}stray")]
        (kept,) = plan.keep
        assert kept.path == semaphore_path(theirs) and f"belongs to uid {other_user.uid}, not to you" in kept.why
        assert os.path.exists(semaphore_path(theirs))
    finally:
        unlink_quietly([f"/{prefix}stray"], [theirs])
