"""A data directory pinned by identity: the folder a run checked, told apart from whatever its
path leads to later.

The processes of a run reach their data directory by path (the broker its segments and
quarantine, the consumers the segments they read, a batch job its own files). Were the
folder, or one above it, moved away mid-run and a link or another folder put at its name,
each of them would go on by path into that other place: make folders and files there, or
take the files it no longer finds for damage. So each pins the folder when it starts
(`DirPin.take`: the (st_dev, st_ino) its path leads to then) and, before it makes, removes or
opens anything by path where that matters, checks that the path still leads there
(`check`: DataDirMovedError, naming the path and what it leads to now). The run then stops;
nothing it holds is lost (what it wrote is in the folder it pinned), and the same command
continues once the folder is back at its path.

    data_dir = real_parent(given)   # the folders above it resolved once, at the start
    pin = DirPin.take(data_dir)     # OSError if the path leads to nothing now
    pin.check()                     # DataDirMovedError once it leads elsewhere
    pin.moved()                     # the same, in words, or "" while it is the folder

NOTE: a check then a use by path leaves a window between the two (a rename lands between
them); what removes files works through directory descriptors instead
(`pipeline.runtime.madefiles`). The check is one stat, so it stands before every path
operation that makes or removes something, and at each watch of a run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.wire.errors import DataDirMovedError


@dataclass(frozen=True, slots=True)
class DirPin:
    """The folder `path` led to when it was pinned: its (device, inode)."""

    path: str
    device: int
    inode: int

    @classmethod
    def take(cls, path: str) -> DirPin:
        info = os.stat(path)
        return cls(path, info.st_dev, info.st_ino)

    @property
    def identity(self) -> tuple[int, int]:
        return self.device, self.inode

    def moved(self) -> str:
        """What the path leads to now, in words, when that is not the pinned folder; ""
        while it is."""
        try:
            info = os.stat(self.path)
        except OSError as exc:
            return f"it leads to nothing now ({exc.strerror})"
        if (info.st_dev, info.st_ino) == self.identity:
            return ""
        real = os.path.realpath(self.path)
        return f"it leads to another folder now ({real})" if real != self.path else "another folder is there now"

    def check(self) -> None:
        """DataDirMovedError when the path no longer leads to the pinned folder."""
        now = self.moved()
        if now:
            raise DataDirMovedError(moved_message(self.path, now))


def real_parent(path: str) -> str:
    """`path` with the folders above it resolved to where they are (links followed), its own
    name kept as it is: a run that passes this to its processes goes on in the folder it
    checked when a link above it is pointed elsewhere meanwhile. The name itself is never
    followed: a data directory that is a link is refused where it is checked."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(parent), name)


def moved_message(path: str, now: str) -> str:
    return (f"the data directory {path} is not the folder this run started in any more: {now} (the folder, or one "
            f"above it, was moved, or something was put at its name); the run stopped and wrote nothing there. Put "
            f"the folder back at {path} and the same command continues")
