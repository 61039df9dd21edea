"""A file layer (pipeline.wire.fileops) that records what it makes durable, for the tests of
what a consumer fsyncs."""

from __future__ import annotations

import os

from pipeline.wire import fileops


class Recording(fileops.FileIO):
    """Straight to the OS, noting the path of every fsync'ed descriptor."""

    def __init__(self) -> None:
        self.fsynced: list[str] = []

    def fsync(self, fd: int) -> None:
        self.fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        super().fsync(fd)
