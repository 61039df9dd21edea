"""What `pipeline status` reads of a job's files, each checked: a damaged file is named in
one line (JobMismatchError), never read as numbers it does not hold.

    view = saved_view(path, requests)        # job/status.json, or a not-started view
    done = answered(records_path, requests)  # job/answers.bin's record count
    why = input_changed(data_dir, manifest)  # the input is no longer the job's: why, or None
"""

from __future__ import annotations

import fcntl
import json
import os
import stat

from pipeline.batchjob.answers import records_path
from pipeline.batchjob.layout import ANSWER_RECORD_SIZE_BYTES, valid_records
from pipeline.batchjob.manifest import INPUT_CHANGED_NAME, JOB_DIR, LOCK_NAME, STATUS_NAME, JobManifest, load_manifest
from pipeline.batchjob.scan import MAX_BATCH_REQUESTS
from pipeline.wire.errors import JobMismatchError
from pipeline.wire.textfiles import counted, read_small_file

# What a new job's run does before it has a manifest.
CHECKING = "checking its input"
# Every answer is in and the outputs are being written (a big job's merge takes a while).
WRITING = "writing its output"
# The most bytes of a saved view read: it is a few hundred.
MAX_STATUS_BYTES = 1 << 20
# The saved view's counts, each a whole number.
COUNTS = ("requests", "done", "failed", "to_do")
# Its rates and times, each a number or null.
FIGURES = ("eta_s", "requests_per_s")
# The most bytes of a producer's note that the input changed read: its message is a line.
MAX_NOTE_BYTES = 4096
# The largest rate or time a view may hold (a year of seconds, a billion requests a second):
# past it the file is damaged, not a figure to print.
MAX_FIGURE = 1e9


def saved_view(path: str, requests: int) -> dict:
    """The job's last saved view (job/status.json); a not-started one where the file is
    missing (a job that never ran); JobMismatchError naming the file where it is damaged."""
    try:
        raw = read_small_file(path, MAX_STATUS_BYTES)
    except OSError as exc:
        raise JobMismatchError(f"{path}: damaged, cannot read it ({exc.strerror}); the job's next run writes it "
                               f"again") from exc
    if raw is None:
        return {"state": "not started", "requests": requests, "done": 0, "failed": 0, "to_do": requests}
    try:
        saved = json.loads(raw)
    except (ValueError, RecursionError):
        saved = None
    why = _wrong(saved) if len(raw) <= MAX_STATUS_BYTES else f"longer than {MAX_STATUS_BYTES:,} bytes"
    if why:
        raise JobMismatchError(f"{path}: damaged ({why}); the job's answers are kept elsewhere, and its next run "
                               f"writes this file again")
    return saved


def _wrong(saved: object) -> str | None:
    if not isinstance(saved, dict):
        return "not a JSON object"
    if not isinstance(saved.get("state"), str):
        return f"state {saved.get('state')!r:.40} is not a word"
    for key in COUNTS:
        value = saved.get(key, 0)
        if type(value) is not int or not 0 <= value <= MAX_BATCH_REQUESTS:
            return f"{key} {value!r:.40} is not a count"
    for key in FIGURES:
        value = saved.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value <= MAX_FIGURE):
            return f"{key} {value!r:.40} is not a number"
    return None


def answered(path: str, requests: int) -> int | None:
    """How many answer records job/answers.bin holds (None: no file); JobMismatchError naming
    it where it is not whole records, holds more than the job's requests, or its first or
    last record fails its check (the file is read there only: a job's records may be many)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: not waited on
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JobMismatchError(f"{path}: cannot read the job's answer records ({exc.strerror})") from exc
    try:
        info = os.fstat(fd)
        size = info.st_size
        count = size // ANSWER_RECORD_SIZE_BYTES
        why = None
        if not stat.S_ISREG(info.st_mode):
            why = "not a regular file"
        elif size % ANSWER_RECORD_SIZE_BYTES:
            why = f"{size:,} bytes are not whole {ANSWER_RECORD_SIZE_BYTES}-byte records"
        elif count > requests:
            why = f"{counted(count, 'record')}, more than the job's {counted(requests, 'request')}"
        elif count:
            ends = (0, (count - 1) * ANSWER_RECORD_SIZE_BYTES)
            if any(valid_records(os.pread(fd, ANSWER_RECORD_SIZE_BYTES, at)).size != 1 for at in ends):
                why = "a record fails its check"
    finally:
        os.close(fd)
    if why:
        raise JobMismatchError(f"{path}: damaged ({why}); the next run-batch on this data directory recovers "
                               f"the records that check")
    return count


def input_changed_note(data_dir: str) -> str | None:
    """The note a producer left on finding a line of the input changed (INPUT_CHANGED_NAME),
    or None."""
    try:
        note = read_small_file(os.path.join(data_dir, JOB_DIR, INPUT_CHANGED_NAME), MAX_NOTE_BYTES)
    except OSError:
        return None
    return note[:MAX_NOTE_BYTES].decode("utf-8", errors="replace").strip() if note else None


def input_changed(data_dir: str, manifest: JobManifest) -> str | None:
    """Why the job's input is no longer the one it scanned, where that is known without
    reading it: a producer's note that a line changed while the job ran (INPUT_CHANGED_NAME,
    removed by the next run the input lets go on), or an input of another size now; None
    otherwise (the next run compares its digest; an input gone from its path may be given
    from wherever a copy of it is)."""
    note = input_changed_note(data_dir)
    if note is not None:
        return note
    try:
        size = os.stat(manifest.input_path).st_size
    except OSError:
        return None
    if size != manifest.input_bytes:
        return (f"the input file {manifest.input_path} is {size:,} bytes now; the job's was "
                f"{manifest.input_bytes:,} bytes")
    return None


def job_status(data_dir: str) -> dict | None:
    """What `pipeline status` says of the job on `data_dir` (None: no job there): its last
    saved view and state, with `running` from the job's lock (held by a live run or not),
    so a run killed without a word reads as stopped."""
    manifest = load_manifest(data_dir)
    if manifest is None:  # a new job's run checks its input (its manifest comes after), or no job
        return {"state": CHECKING, "running": True} if _lock_held(os.path.join(data_dir, JOB_DIR, LOCK_NAME)) \
            else None
    saved = saved_view(os.path.join(data_dir, JOB_DIR, STATUS_NAME), manifest.requests)
    saved["running"] = _lock_held(os.path.join(data_dir, JOB_DIR, LOCK_NAME))
    # The answer records are the count (the saved view lags by up to SAVE_INTERVAL_S).
    done = answered(records_path(data_dir), manifest.requests)
    done = saved.get("done", 0) if done is None else done
    if done != saved.get("done"):
        saved.update(done=done, to_do=manifest.requests - done, eta_s=None)
    if saved.get("state") in ("running", WRITING) and not saved["running"]:
        saved["state"] = "stopped"  # its process is gone without a word (kill -9, a power cut)
    saved.update(input=manifest.input_path, output=manifest.output_path, requests=manifest.requests,
                 input_changed=input_changed(data_dir, manifest) if not saved["running"] else None)
    return saved


def _lock_held(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
