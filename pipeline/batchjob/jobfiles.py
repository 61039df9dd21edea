"""A batch job's data directory: what it may hold when a job takes it, what the job makes in
it, and, at the end, the removal of exactly that.

- A job takes a data directory that is absent (created then), empty, or a job's own (it
  holds a job manifest). A directory of other files (the user's, or a store `pipeline
  launch` or `pipeline produce` made) is refused: its items and results are not this job's.
- What the product made there (`DATA_DIR_MADE`) is known by name, folder by folder
  (`pipeline.runtime.madefiles`): the run's (the store and its log, the broker's
  state and namespace, run/, results/, quarantine/, engine-cache/) and the job's own folder
  `job/` (`JOB_MADE`: its manifest, index, answers, status and lock, the files it replaces
  through a named temporary, its copy of the model's files, the scan's and the merge's work
  folders, the producers' refusals). A file named otherwise is the user's, in whatever
  folder it is.
- At the end the default data directory goes (`remove_data_dir`): what the product made,
  then each folder once empty, never through a link nor into another file system; a file of
  the user's stays, with the folders that hold it, and is named.
"""

from __future__ import annotations

import os
import stat

from pipeline.batchjob.answers import LOG_NAME, RECORDS_NAME
from pipeline.batchjob.assemble import MERGE_DIR, MERGE_MADE
from pipeline.batchjob.collect import COLLECTED_NAME
from pipeline.batchjob.manifest import (
    INDEX_NAME,
    JOB_DIR,
    LINES_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MODEL_COPY_DIR,
    MODEL_COPY_MADE,
    MODEL_COPY_NEW_SUFFIX,
    SCAN_DIR,
    STATUS_NAME,
)
from pipeline.batchjob.outfiles import OWN_FILES_NAME
from pipeline.batchjob.paths import PARTIAL_SUFFIX, path_kind, stat_or_none
from pipeline.batchjob.rejections import REJECTED_DIR, REJECTED_NAMES
from pipeline.batchjob.scan import SCAN_MADE
from pipeline.batchjob.workload import INPUT_CHANGED_NAME
from pipeline.runtime.datadir import check_not_shared
from pipeline.runtime.madefiles import RUN_MADE, Made, matching, named, remove_made
from pipeline.wire.errors import JobPathError
from pipeline.wire.textfiles import printable

# The job's files in job/, each also under the named temporary `replace_file` writes it
# through where the file system has no O_TMPFILE (.NAME.partial).
JOB_FILE_NAMES = (MANIFEST_NAME, LOCK_NAME, STATUS_NAME, INDEX_NAME, LINES_NAME, RECORDS_NAME, LOG_NAME,
                  COLLECTED_NAME, OWN_FILES_NAME, INPUT_CHANGED_NAME)
JOB_MADE = Made(
    files=lambda name: name in JOB_FILE_NAMES or (name.startswith(".") and name.endswith(PARTIAL_SUFFIX)
                                                  and name[1:-len(PARTIAL_SUFFIX)] in JOB_FILE_NAMES),
    folders=((named(MODEL_COPY_DIR, MODEL_COPY_DIR + MODEL_COPY_NEW_SUFFIX), MODEL_COPY_MADE),
             (named(SCAN_DIR), SCAN_MADE),
             (named(MERGE_DIR), MERGE_MADE),
             (named(REJECTED_DIR), Made(files=matching(REJECTED_NAMES)))))
DATA_DIR_MADE = RUN_MADE.with_folders((named(JOB_DIR), JOB_MADE))
# What a new job's prepare makes in its job directory before the manifest: the lock, the
# scan's work files, the input's index, the copy of the model's files.
UNFINISHED_SCAN_NAMES = frozenset({LOCK_NAME, SCAN_DIR, INDEX_NAME, LINES_NAME, f".{LINES_NAME}{PARTIAL_SUFFIX}",
                                   MODEL_COPY_DIR, f"{MODEL_COPY_DIR}{MODEL_COPY_NEW_SUFFIX}"})


# What a broker's store and state are made of: a directory holding one of these (and no job
# manifest) is another run's, not only not empty.
STORE_ENTRIES = frozenset({"segments", "store.log", "broker-state.json", "shm-namespace"})


def check_data_dir_is_the_jobs(data_dir: str, has_manifest: bool) -> None:
    """A data directory a job may use: absent, empty, or a job's own (`has_manifest`); never
    a shared system directory (/, /tmp: `check_not_shared`)."""
    check_not_shared(data_dir)
    info = stat_or_none(data_dir, follow=False)
    if info is None or has_manifest:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise JobPathError(f"data directory {data_dir} is {path_kind(info)}, not a directory")
    entries = sorted(os.listdir(data_dir))
    if entries:
        held = ", ".join(map(printable, entries[:5])) + (", ..." if len(entries) > 5 else "")
        store = ("; they are a store of another run (pipeline launch or produce), whose items are not this job's"
                 if STORE_ENTRIES & set(entries) else "")
        raise JobPathError(f"data directory {data_dir} is not empty and is not a batch job's data directory (it has "
                           f"no job manifest): it holds {held}{store}; give another --data-dir (a new or empty "
                           f"directory)")


def holds_unfinished_scan(data_dir: str) -> bool:
    """The data directory holds only what a new job's prepare makes before its manifest
    (UNFINISHED_SCAN_NAMES): a new job stopped there (kill -9), taken over by the same
    command once the lock is free."""
    try:
        return (os.listdir(data_dir) == [JOB_DIR]
                and set(os.listdir(os.path.join(data_dir, JOB_DIR))) <= UNFINISHED_SCAN_NAMES)
    except OSError:
        return False


def remove_data_dir(data_dir: str, identity: tuple[int, int] | None = None) -> list[str]:
    """Remove what the product made in `data_dir` (`DATA_DIR_MADE`), then the directory if
    nothing else is in it; what is left there (the user's), relative to it, for a warning.
    `identity`: the (st_dev, st_ino) the job pinned (DataDirMovedError, nothing removed,
    when the path leads elsewhere now)."""
    return remove_made(data_dir, DATA_DIR_MADE, identity)


def remove_job_dir(data_dir: str) -> list[str]:
    """Remove what a new job made in `data_dir/job` (`JOB_MADE`), then that folder once
    empty; what is left there."""
    return remove_made(os.path.join(data_dir, JOB_DIR), JOB_MADE)
