"""The service's durable state in its data directory: every file and batch, each a small
JSON record written whole or not at all (`replace_file`: a new file fsynced, renamed over,
its directory fsynced), and the files' contents.

    DATA_DIR/server.lock            one server per data directory (its pid)
    DATA_DIR/files/ID.json          a file's record (objects.FileRecord)
    DATA_DIR/files/ID.jsonl         its content (an upload, or a batch's output or errors)
    DATA_DIR/files/ID.index, .lines an upload's scan, which its batches' jobs adopt (`prescan.py`)
    DATA_DIR/batches/ID.json        a batch's record (objects.BatchRecord)
    DATA_DIR/jobs/SEQ/              the executor's folder of batch SEQ (`runner.py`)
    DATA_DIR/uploads/               uploads being received (emptied at start)

A content file (and an upload's scan) is renamed into place before its record is written,
and a record removed before its content: a record always has its content, and a content
without a record (a kill in between) is removed at the next start. A record without its
scan (a store older than the scans) has its jobs scan the input themselves. Opening reads
the records only (a few hundred bytes each), never an input: a restart takes milliseconds
per thousand objects.

Every object has its tenant (`owner`); lookups take the caller's tenant, and another
tenant's object is "not found", as a missing one. Owner: the server process; every method
takes the store's lock (the API's threads and the scheduler's share it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import BinaryIO

from pipeline.batchjob.manifest import LINES_NAME
from pipeline.batchjob.paths import replace_file
from pipeline.batchjob.prescan import INDEX_SUFFIX, LINES_SUFFIX, keep_scan, kept_paths
from pipeline.batchjob.scan import InputScan, envelope, scan_input
from pipeline.runtime.datadir import describe_holder, hold_lock, prepare_data_dir, release_lock
from pipeline.service.limits import MAX_FILENAME_CHARS
from pipeline.service.objects import (
    HTTP_BAD_REQUEST,
    HTTP_TOO_LARGE,
    HTTP_TOO_MANY,
    PURPOSE_BATCH,
    BatchCreate,
    BatchRecord,
    FileRecord,
    batch_record,
    check_endpoint_of_lines,
    file_record,
    not_found,
)
from pipeline.service.states import TERMINAL, Lifecycle
from pipeline.wire import fileops
from pipeline.wire.errors import ApiError, BatchFileError, DataDirError, DataDirInUseError

LOCK_NAME = "server.lock"
FILES_DIR = "files"
BATCHES_DIR = "batches"
JOBS_DIR = "jobs"
UPLOADS_DIR = "uploads"
NODE_DIR = "node"  # the broker's and consumers' data directory, every job's (`runner.py`)
SERVICE_NAMES = frozenset({LOCK_NAME, FILES_DIR, BATCHES_DIR, JOBS_DIR, UPLOADS_DIR, NODE_DIR})
RECORD_SUFFIX = ".json"
CONTENT_SUFFIX = ".jsonl"
# An upload's kept scan (`prescan.py`): its index and line digests.
SCAN_SUFFIXES = (INDEX_SUFFIX, LINES_SUFFIX)
# The most bytes of a record read: a batch's record with its metadata and errors is ~3 KiB.
MAX_RECORD_BYTES = 1 << 20
# Distinct urls kept of an input's lines: a batch takes one endpoint, and a second url is
# all it takes to show the file mixes them.
MAX_RECORDED_URLS = 2
# Bytes copied at a time from an upload.
COPY_CHUNK_BYTES = 1 << 20


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Store:
    """See the module's doc."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.lock = threading.RLock()
        self.files: dict[str, FileRecord] = {}
        self.batches: dict[str, BatchRecord] = {}
        self.stored_bytes: dict[str, int] = {}  # by tenant
        self._reserved_bytes: dict[str, int] = {}  # uploads being received, by tenant
        self._next_seq = 1
        self._next_file_seq = 1
        self._lock_fd = -1

    @classmethod
    def open(cls, data_dir: str) -> Store:
        """The store on `data_dir` (made owner-only where missing), locked for this process;
        DataDirError where it holds what is not the service's, or another server has it."""
        data_dir = prepare_data_dir(data_dir)
        foreign = sorted(set(os.listdir(data_dir)) - SERVICE_NAMES)
        if foreign:
            raise DataDirError(f"data directory {data_dir} holds {', '.join(foreign[:5])}, which a batch service "
                               f"does not make: give a directory of its own (or an empty one)")
        store = cls(data_dir)
        held = hold_lock(os.path.join(data_dir, LOCK_NAME))
        if isinstance(held, str):
            raise DataDirInUseError(f"another server uses {data_dir}: {describe_holder(held)} holds "
                                    f"{os.path.join(data_dir, LOCK_NAME)}")
        store._lock_fd = held
        for name in (FILES_DIR, BATCHES_DIR, JOBS_DIR, UPLOADS_DIR):
            os.makedirs(os.path.join(data_dir, name), mode=0o700, exist_ok=True)
        store._load()
        return store

    def close(self) -> None:
        if self._lock_fd >= 0:
            release_lock(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------ loading

    def _load(self) -> None:
        for name in os.listdir(self._dir(UPLOADS_DIR)):  # what a killed upload left
            _remove_tree(os.path.join(self._dir(UPLOADS_DIR), name))
        self.load_batches()
        contents, scans = set(), set()
        for name in os.listdir(self._dir(FILES_DIR)):
            if name.endswith(CONTENT_SUFFIX):
                contents.add(name.removesuffix(CONTENT_SUFFIX))
            elif name.endswith(SCAN_SUFFIXES):
                scans.add(os.path.splitext(name)[0])
        for record in self._records(FILES_DIR):
            found = self._parsed(record, file_record)
            if found.id not in contents:
                raise DataDirError(f"{record}: the record of a file whose content "
                                   f"{self.content_path(found.id)} is gone; remove the record to drop the file")
            self.files[found.id] = found
            self._next_file_seq = max(self._next_file_seq, found.seq + 1)
            self.stored_bytes[found.owner] = self.stored_bytes.get(found.owner, 0) + found.bytes
        for orphan in contents - set(self.files):  # renamed in, its record never written
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.content_path(orphan))
        for orphan in scans - set(self.files):
            self._remove_scan(orphan)

    def load_batches(self) -> None:
        """The batches' records (read-only: `pipeline status` reads them beside a server)."""
        for record in self._records(BATCHES_DIR):
            batch = self._parsed(record, batch_record)
            self.batches[batch.id] = batch
            self._next_seq = max(self._next_seq, batch.seq + 1)

    def _records(self, folder: str) -> Iterator[str]:
        for name in sorted(os.listdir(self._dir(folder))):
            if name.endswith(RECORD_SUFFIX) and not name.startswith("."):
                yield os.path.join(self._dir(folder), name)

    @staticmethod
    def _parsed(path: str, parse):
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"longer than {MAX_RECORD_BYTES:,} bytes")
            return parse(json.loads(raw))
        except (OSError, ValueError, TypeError, AssertionError) as exc:
            raise DataDirError(f"{path}: a damaged record ({exc}); the service writes records whole, so something "
                               f"else changed it: restore it or move it away") from None

    # ------------------------------------------------------------------ paths

    def _dir(self, name: str) -> str:
        return os.path.join(self.data_dir, name)

    def content_path(self, file_id: str) -> str:
        return os.path.join(self._dir(FILES_DIR), file_id + CONTENT_SUFFIX)

    def _scan_prefix(self, file_id: str) -> str:
        return os.path.join(self._dir(FILES_DIR), file_id)

    def kept_scan(self, file_id: str) -> str | None:
        """The prefix of the scan an upload kept (`prescan.py`), if it has one."""
        prefix = self._scan_prefix(file_id)
        return prefix if all(os.path.exists(path) for path in kept_paths(prefix)) else None

    def _remove_scan(self, file_id: str) -> None:
        for path in kept_paths(self._scan_prefix(file_id)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def work_dir(self, batch: BatchRecord) -> str:
        """The executor's folder for `batch` (short: a job's broker socket lies inside it)."""
        return os.path.join(self._dir(JOBS_DIR), str(batch.seq))

    def _save_file(self, record: FileRecord) -> None:
        replace_file(os.path.join(self._dir(FILES_DIR), record.id + RECORD_SUFFIX),
                     [json.dumps(record.as_json()).encode()])

    def save_batch(self, record: BatchRecord) -> None:
        """Write the batch's record (its status changed): whole, fsynced."""
        record.life.check_invariants()
        with self.lock:
            replace_file(os.path.join(self._dir(BATCHES_DIR), record.id + RECORD_SUFFIX),
                         [json.dumps(record.as_json()).encode()])

    def step(self, record: BatchRecord, event: str, now: int) -> None:
        """Apply a status event to the batch and save it; where the save fails (a full
        disk), the batch stays as it was, in memory as on disk, and the error is raised."""
        with self.lock:
            before = replace(record.life)
            record.life.step(event, now)
            try:
                self.save_batch(record)
            except BaseException:
                record.life = before
                raise

    # ------------------------------------------------------------------ files

    def upload(self, owner: str, filename: str, source: BinaryIO, size: int, max_bytes: int, quota_bytes: int,
               now: int) -> FileRecord:
        """A batch input file from `source` (`size` bytes), checked by the rules run-batch
        checks a file by (`scan_input`: ApiError 400 naming its bad lines), stored."""
        if size > max_bytes:
            raise ApiError(HTTP_TOO_LARGE, f"the file is {size:,} bytes; this server takes files of at most "
                                           f"{max_bytes:,} bytes (--max-upload-bytes)", "file", "file_too_large")
        self._reserve(owner, size, quota_bytes)
        file_id = new_id("file-")
        work = os.path.join(self._dir(UPLOADS_DIR), file_id)
        saved = False
        try:
            os.makedirs(work, mode=0o700)
            received = os.path.join(work, "content")
            copied = _copy(source, received, max_bytes)
            scan, urls = _scan(received, work, filename)
            record = FileRecord(file_id, owner, filename[:MAX_FILENAME_CHARS], PURPOSE_BATCH, copied, now,
                                scan.requests, urls, scan.input_xxh3)
            keep_scan(scan, os.path.join(work, LINES_NAME), self._scan_prefix(file_id))
            fileops.rename(received, self.content_path(file_id))
            fileops.fsync_directory(self._dir(FILES_DIR))
            with self.lock:
                record.seq, self._next_file_seq = self._next_file_seq, self._next_file_seq + 1
                self._save_file(record)
                self.files[file_id] = record
                self.stored_bytes[owner] = self.stored_bytes.get(owner, 0) + copied
            saved = True
            return record
        finally:
            with self.lock:
                self._reserved_bytes[owner] -= size
            _remove_tree(work)
            if not saved:  # what it put in place goes with it (a start removes it, where a kill came first)
                self._remove_scan(file_id)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.content_path(file_id))

    def _reserve(self, owner: str, size: int, quota_bytes: int) -> None:
        with self.lock:
            used = self.stored_bytes.get(owner, 0) + self._reserved_bytes.get(owner, 0)
            if used + size > quota_bytes:
                raise ApiError(HTTP_TOO_MANY, f"this key stores {used:,} bytes, and {size:,} more would pass its "
                                              f"{quota_bytes:,} (--key-max-stored-bytes): delete files first",
                               "file", "insufficient_quota", type="insufficient_quota")
            self._reserved_bytes[owner] = self._reserved_bytes.get(owner, 0) + size

    def add_output(self, owner: str, batch_id: str, file_id: str, filename: str, size: int, now: int) -> FileRecord:
        """The record of a batch's output or error file, its content already in place."""
        record = FileRecord(file_id, owner, filename, "batch_output", size, now, batch_id=batch_id)
        with self.lock:
            record.seq, self._next_file_seq = self._next_file_seq, self._next_file_seq + 1
            self._save_file(record)
            if file_id not in self.files:
                self.stored_bytes[owner] = self.stored_bytes.get(owner, 0) + size
            self.files[file_id] = record
        return record

    def file(self, owner: str, file_id: str) -> FileRecord:
        return self._owned(self.files, owner, file_id, "file")

    def list_files(self, owner: str, purpose: str | None, ascending: bool) -> list[FileRecord]:
        with self.lock:
            mine = [f for f in self.files.values() if f.owner == owner and purpose in (None, f.purpose)]
        mine.sort(key=lambda f: (f.created_at, f.seq, f.id), reverse=not ascending)
        return mine

    def delete_file(self, owner: str, file_id: str) -> None:
        """Remove a file (its record first); ApiError 400 for the input of a batch that has
        not ended (it is read again where the batch resumes)."""
        with self.lock:
            found = self.file(owner, file_id)
            user = next((b for b in self.batches.values()
                         if b.input_file_id == file_id and b.life.status not in TERMINAL), None)
            if user is not None:
                raise ApiError(HTTP_BAD_REQUEST, f"file {file_id} is the input of batch {user.id}, which has not "
                                                 f"ended: cancel it first", "file_id")
            fileops.unlink(os.path.join(self._dir(FILES_DIR), file_id + RECORD_SUFFIX))
            fileops.fsync_directory(self._dir(FILES_DIR))
            del self.files[file_id]
            self.stored_bytes[owner] -= found.bytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.content_path(file_id))
        self._remove_scan(file_id)

    # ------------------------------------------------------------------ batches

    def create_batch(self, owner: str, create: BatchCreate, model: str, window_s: int, max_active: int,
                     now: int) -> BatchRecord:
        """A new batch (validating) of an input file of the caller's whose every line is for
        its endpoint; ApiError 404 for another's file, 429 past the key's active batches."""
        with self.lock:
            source = self._owned(self.files, owner, create.input_file_id, "file", "input_file_id")
            if source.purpose != PURPOSE_BATCH:
                raise ApiError(HTTP_BAD_REQUEST, f"file {source.id} has purpose {source.purpose!r}; a batch's input "
                                                 f"is uploaded with purpose 'batch'", "input_file_id")
            check_endpoint_of_lines(source.urls, create.endpoint)
            active = sum(1 for b in self.batches.values() if b.owner == owner and b.life.status not in TERMINAL)
            if active >= max_active:
                raise ApiError(HTTP_TOO_MANY, f"this key has {active} batches not ended, its limit "
                                              f"(--key-max-active-batches): wait for one to end or cancel one",
                               None, "rate_limit_exceeded", type="requests")
            batch = BatchRecord(new_id("batch_"), owner, self._next_seq, source.id, create.endpoint, model,
                                Lifecycle.new(now, window_s), source.requests, create.metadata,
                                create.completion_window)
            self.save_batch(batch)
            self._next_seq += 1
            self.batches[batch.id] = batch
            return batch

    def batch(self, owner: str, batch_id: str) -> BatchRecord:
        return self._owned(self.batches, owner, batch_id, "batch")

    def _owned(self, table: dict, owner: str, object_id: str, kind: str, param: str = ""):
        """The `kind` of id `object_id` if it is `owner`'s; the 404 of a missing one if not,
        naming `param` (the request's field; `{kind}_id`, the path's, by default)."""
        with self.lock:
            found = table.get(object_id)
            if found is None or found.owner != owner:
                raise not_found(kind, object_id, param or f"{kind}_id")
            return found

    def list_batches(self, owner: str) -> list[BatchRecord]:
        """The tenant's batches, newest first (OpenAI's order)."""
        with self.lock:
            mine = [b for b in self.batches.values() if b.owner == owner]
        mine.sort(key=lambda b: b.seq, reverse=True)
        return mine

    def unfinished(self) -> list[BatchRecord]:
        """Every batch not ended, in submission order (the scheduler's)."""
        with self.lock:
            return sorted((b for b in self.batches.values() if b.life.status not in TERMINAL), key=lambda b: b.seq)

    def all_batches(self) -> list[BatchRecord]:
        with self.lock:
            return list(self.batches.values())


def _copy(source: BinaryIO, path: str, max_bytes: int) -> int:
    """`source` into a new file at `path`, fsynced; its bytes (ApiError 413 past `max_bytes`)."""
    fd = fileops.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    copied = 0
    try:
        while chunk := source.read(COPY_CHUNK_BYTES):
            copied += len(chunk)
            if copied > max_bytes:
                raise ApiError(HTTP_TOO_LARGE, f"the file is more than {max_bytes:,} bytes (--max-upload-bytes)",
                               "file", "file_too_large")
            fileops.write_all(fd, chunk)
        fileops.fsync(fd)
    finally:
        os.close(fd)
    return copied


def _scan(path: str, work: str, filename: str) -> tuple[InputScan, list[str]]:
    """run-batch's check of a batch file (ApiError 400 with its bad lines, named by the
    upload's file name): the scan (its line digests at `work`/LINES_NAME) and the
    file's first distinct urls."""
    urls: list[str] = []

    def seen(_index: int, _line: int, _offset: int, raw: bytes) -> None:
        if len(urls) < MAX_RECORDED_URLS:
            url = envelope(raw).url
            if url not in urls:
                urls.append(url)

    try:
        scan = scan_input(path, os.path.join(work, "scan"), os.path.join(work, LINES_NAME), on_request=seen)
    except BatchFileError as exc:
        raise ApiError(HTTP_BAD_REQUEST, str(exc).replace(path, filename[:MAX_FILENAME_CHARS]), "file",
                       "invalid_batch_file") from None
    return scan, urls


def _remove_tree(path: str) -> None:
    """A folder of what an upload left (files and one level of folders), or a file."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    for name in os.listdir(path):
        _remove_tree(os.path.join(path, name))
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)
