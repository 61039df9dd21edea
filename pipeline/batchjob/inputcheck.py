"""A resumed job's check that its input holds the bytes its scan read, made beside the run.

    check = InputCheck(input_path, manifest)   # the input's size is the manifest's
    check.start()                  # the digest read on a thread (after the job's processes fork)
    check.error(data_dir)          # None, or the JobMismatchError that refuses the job

The input's xxh3-128 is a read of the whole file (gigabytes at ten million requests): done
before the run, it delayed a resume's first batch by as long. Beside the run it costs no
answer: every line a producer reads is checked against the digest the scan took of it
(`linedigests.py`), and every answer against its request's line (`collect.py`), so what the
run answers meanwhile is the job's; a digest that differs stops the run (`BatchJob._poll`),
and no output is written without the digest matching (`BatchJob.finish` waits for it). A
file of another size is refused before anything runs, as it always was.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from pipeline.batchjob.manifest import JobManifest, differences, mismatch_error
from pipeline.batchjob.scan import input_digest
from pipeline.wire.errors import JobMismatchError, PipelineError


class InputCheck:
    """See the module's doc. Owner: the job's main thread; the digest is the thread's alone
    until `error` joins it."""

    def __init__(self, path: str, manifest: JobManifest) -> None:
        self.path = path
        self.manifest = manifest
        self._thread: threading.Thread | None = None
        self._found: tuple[int, str] | None = None
        self._failed: PipelineError | OSError | None = None
        self.said = False  # the error was raised once already (the run stopped on it)

    def start(self) -> None:
        """Read the digest on a thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._digest, name="input-digest", daemon=True)
            self._thread.start()

    def _digest(self) -> None:
        try:
            self._found = input_digest(self.path)
        except (PipelineError, OSError) as exc:  # the input became unreadable: said as the check's error
            self._failed = exc

    def error(self, data_dir: str, wait: bool = True) -> JobMismatchError | None:
        """The refusal of the job when the input is not the bytes it scanned; None when it is,
        or (`wait` False) when the digest is not read yet."""
        self.start()
        assert self._thread is not None
        if wait:
            self._thread.join()
        elif self._thread.is_alive():
            return None
        if self._failed is not None:
            return JobMismatchError(f"{self.path}: the job's input could not be read again to check it is the file "
                                    f"the job started on: {self._failed}")
        assert self._found is not None
        size, digest = self._found
        now = replace(self.manifest, input_bytes=size, input_xxh3=digest, input_path=self.path)
        changed = differences(self.manifest, now)
        return mismatch_error(data_dir, self.manifest, changed) if changed else None
