"""Named crash points for the crash tests (tests/storage/test_disk_crash.py): a process ends
with os._exit at a chosen step boundary of the disk tier, exactly as kill -9 would leave it
there.

Free in production: every call site is guarded by the module-level flag,

    if crashpoints.ARMED:
        crashpoints.hit("segment.after_write")

which costs one attribute load and a branch while nothing is armed. A test arms a point in
the child process it is about to crash (`arm(name, skip)`: pass the point `skip` times, die
at the next), or sets PIPELINE_CRASH_POINT=name[:skip] in a subprocess's environment.

Points (where each sits is named after the step it follows):
    segment.after_write        a group is written, the readable boundary not yet moved
    sync.before_fdatasync      `power`: appended groups not yet fdatasync'ed (the log's
                               boundary must still be the last synced one)
    sync.after_fdatasync       `power`: fdatasync'ed, the boundary not yet recorded
    create.after_rename        a new segment renamed into place, its CREATED record not
                               yet written (recovery adopts it)
    commit.after_verify        commit step 1 done, cursors not advanced
    commit.after_advance       cursors advanced, the pending map not yet told
    tombstone.before_record    entries marked completed in memory, their log records not
                               yet written (the completion is lost: redelivered)
    delete.before_unlink       a sealed segment's last entry tombstoned and its deletion
                               recorded in the store log, the file not deleted
    rotate.after_seal          a full segment sealed, its successor not yet created
"""

from __future__ import annotations

import os

# Exit status of a process ended at a crash point (distinct from errors and signals).
CRASH_EXIT_CODE = 77
POINTS = (
    "segment.after_write",
    "sync.before_fdatasync",
    "sync.after_fdatasync",
    "create.after_rename",
    "commit.after_verify",
    "commit.after_advance",
    "tombstone.before_record",
    "delete.before_unlink",
    "rotate.after_seal",
)

ARMED = False
_name = ""
_skip = 0


def arm(name: str, skip: int = 0) -> None:
    """Die at the (skip + 1)-th time `name` is passed. Only in a process meant to crash."""
    global ARMED, _name, _skip
    assert name in POINTS, name
    ARMED, _name, _skip = True, name, skip


def hit(name: str) -> None:
    global _skip
    if name != _name:
        return
    if _skip:
        _skip -= 1
        return
    os._exit(CRASH_EXIT_CODE)


def _arm_from_environment() -> None:
    spec = os.environ.get("PIPELINE_CRASH_POINT")
    if spec:
        name, _, skip = spec.partition(":")
        arm(name, int(skip or 0))


_arm_from_environment()
