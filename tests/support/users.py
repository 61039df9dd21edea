"""A second local user for the tests that need one (SPEC §7, §12): made with useradd for one
test, removed with userdel after it. Skipped, with the reason, where it cannot be made (not
root, no useradd or setpriv, no system Python).

The hostile side runs as that user with the system's Python (the test's virtual environment
may not be readable by others), under setpriv, which execs in place: the process a test
kills is the hostile one itself (runuser forks, and killing it would leave its child
running, and the user undeletable). A check that runs in-process takes that user's
effective ids for a block instead (`effective`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

# An interpreter every user can run (the test's own may live under root's home).
SYSTEM_PYTHON = "/usr/bin/python3"
# A hang guard for one hostile snippet (each takes well under a second).
SNIPPET_TIMEOUT_S = 30

# A hostile snippet (`OtherUser.run(CREATE_SEMAPHORE, name)`): a POSIX semaphore created
# under `name` by that user, as a squatter would plant it.
CREATE_SEMAPHORE = """
import ctypes, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.sem_open.restype = ctypes.c_void_p
libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
if not libc.sem_open(sys.argv[1].encode(), os.O_CREAT | os.O_EXCL, 0o600, 0):
    sys.exit(f"sem_open: {os.strerror(ctypes.get_errno())}")
"""


def python_for(uid: int, gid: int, imports: str = "sys", cwd: str | None = None) -> str:
    """An interpreter that user `uid` can run and `import {imports}` with (from `cwd`): this
    test's own, else the system's; pytest.skip naming why where neither (a home or a root
    directory others cannot traverse, as on some CI machines)."""
    why = []
    for python in dict.fromkeys([sys.executable, SYSTEM_PYTHON]):
        probe = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", python, "-c",
                                f"import {imports}"], capture_output=True, text=True, cwd=cwd,
                               timeout=SNIPPET_TIMEOUT_S, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        if probe.returncode == 0:
            return python
        why.append(f"{python}: {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}")
    pytest.skip(f"uid {uid} can run no Python that imports {imports} ({'; '.join(why)})")


@dataclass
class OtherUser:
    name: str
    uid: int
    gid: int

    def command(self, code: str, *args: str) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--",
                SYSTEM_PYTHON, "-c", code, *args]

    def run(self, code: str, *args: str) -> str:
        done = subprocess.run(self.command(code, *args), capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        return done.stdout


@contextmanager
def other_user() -> Iterator[OtherUser]:
    """A throwaway local user for the block (pytest.skip where none can be made)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user (useradd)")
    if not (shutil.which("useradd") and shutil.which("setpriv") and os.access(SYSTEM_PYTHON, os.X_OK)):
        pytest.skip(f"needs useradd, setpriv and {SYSTEM_PYTHON}")
    name = f"sbrk{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd refused: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        user = OtherUser(name, entry.pw_uid, entry.pw_gid)
        probe = subprocess.run(user.command("print('ok')"), capture_output=True, text=True,
                               timeout=SNIPPET_TIMEOUT_S)
        if probe.stdout.strip() != "ok":
            pytest.skip(f"cannot run {SYSTEM_PYTHON} as {name}: {probe.stderr.strip()}")
        yield user
    finally:
        removed = subprocess.run(["userdel", name], capture_output=True, text=True)
        assert removed.returncode == 0, f"userdel {name}: {removed.stderr.strip()}"


@contextmanager
def effective(user: OtherUser) -> Iterator[None]:
    """This process's effective user and group those of `user` (no supplementary groups) for
    the block, without a fork: what it may open or create there is what that user may. For a
    check that runs in-process (a path's permissions); root only, as `other_user` is."""
    uid, gid, groups = os.geteuid(), os.getegid(), os.getgroups()
    os.setgroups([])
    os.setegid(user.gid)
    os.seteuid(user.uid)
    try:
        yield
    finally:
        os.seteuid(uid)
        os.setegid(gid)
        os.setgroups(groups)
