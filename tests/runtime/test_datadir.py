"""Who may touch a data directory (SPEC §12): everything the product creates is owner-only
whatever the umask, and a data directory another user could change is refused, by every
command, before anything is read or written there.

Another user is played by a process that drops to an unused uid with `setpriv` (no account
is needed); those tests run only as root, where they can.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.runtime.datadir import (
    check_data_dir,
    check_not_shared,
    hold_for_launch,
    launch_lock_path,
    lock_holder,
    prepare_data_dir,
    release_launch,
)
from pipeline.wire.errors import DataDirError, DataDirInUseError
from tests.support.commands import RUN_TIMEOUT_S
from tests.support.repo import ROOT
from tests.support.users import python_for

# A uid no account uses here: "another local user".
OTHER_UID = 54321
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None,
                                reason="playing another user needs root and setpriv")


def pipeline(*args: str, umask: int = -1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT, umask=umask)


def modes(root) -> dict[str, int]:
    """Permission bits of every directory and file under `root` (and of `root`)."""
    found = {str(root): stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@pytest.mark.integration
def test_everything_a_run_creates_is_owner_only_even_under_umask_000(tmp_path):
    """Under umask 000 the earlier code made a 0777 data directory and 0666 results and
    state files; under the default umask 0755 and 0644."""
    data, report = tmp_path / "data", tmp_path / "report.json"
    done = pipeline("launch", "--items", "300", "--data-dir", str(data), "--report", str(report), umask=0)
    assert done.returncode == 0, done.stderr
    found = modes(data)
    assert len(found) > 5  # the data directory, run/, results/, its run, files...
    wrong = {path: f"{mode:04o}" for path, mode in found.items()
             if mode != (0o700 if os.path.isdir(path) else 0o600)}
    assert wrong == {}
    assert stat.S_IMODE(os.stat(report).st_mode) == 0o600


@pytest.mark.integration
def test_detached_stages_write_owner_only_logs_and_pid_files(tmp_path):
    data = tmp_path / "data"
    try:
        started = pipeline("broker", "start", "--data-dir", str(data), "--detach", umask=0)
        assert started.returncode == 0, started.stderr
        run = data / "run"
        assert {name: f"{stat.S_IMODE(os.stat(run / name).st_mode):04o}" for name in os.listdir(run)
                if not name.endswith(".sock")} == {name: "0600" for name in os.listdir(run) if not name.endswith(".sock")}
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    finally:
        pipeline("broker", "stop", "--data-dir", str(data))


@pytest.mark.integration
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_data_directory_others_can_write_is_refused_by_every_command(tmp_path, mode):
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, mode)
    for args in (["launch", "--items", "10", "--data-dir", str(data)], ["broker", "start", "--data-dir", str(data)],
                 ["consumer", "start", "--data-dir", str(data)], ["status", "--data-dir", str(data)],
                 ["produce", __file__, "--data-dir", str(data)]):
        done = pipeline(*args)
        assert done.returncode == 1, (args, done.stderr)
        assert f"chmod 700 {data}" in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    assert os.listdir(data) == []  # nothing was created in it


def test_a_subdirectory_others_can_write_is_refused(tmp_path):
    data = tmp_path / "data"
    prepare_data_dir(str(data))
    (data / "results").mkdir()
    os.chmod(data / "results", 0o777)
    with pytest.raises(DataDirError, match="results has mode 0777"):
        check_data_dir(str(data))
    (data / "results").chmod(0o700)
    (data / "segments" / "m00000").mkdir(parents=True)
    os.chmod(data / "segments" / "m00000", 0o757)
    check_data_dir(str(data))  # a client looks only at what it uses
    with pytest.raises(DataDirError, match="m00000 has mode 0757"):
        prepare_data_dir(str(data))  # the broker's start checks the whole tree


def test_a_data_directory_of_ours_readable_by_others_is_tightened(tmp_path):
    data = tmp_path / "data"
    (data / "run").mkdir(parents=True)
    os.chmod(data, 0o755)
    os.chmod(data / "run", 0o755)
    prepare_data_dir(str(data))
    assert stat.S_IMODE(os.stat(data).st_mode) == stat.S_IMODE(os.stat(data / "run").st_mode) == 0o700


def test_a_directory_above_that_others_can_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(DataDirError, match="rename the data directory away"):
        prepare_data_dir(str(shared / "data"))
    assert not (shared / "data").exists()
    os.chmod(shared, 0o1777)  # like /tmp: others cannot rename what is ours
    prepare_data_dir(str(shared / "data"))


@pytest.mark.parametrize("mode", [0o1777, 0o1773, 0o1757])
def test_a_shared_sticky_directory_is_refused_as_a_data_directory_with_a_subdirectory_advised(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    for check in (check_data_dir, prepare_data_dir, check_not_shared):
        with pytest.raises(DataDirError) as caught:
            check(str(shared))
        assert f"such as {shared / 'run1'}" in str(caught.value) and "chmod" not in str(caught.value)
    assert stat.S_IMODE(os.stat(shared).st_mode) == mode and os.listdir(shared) == []
    os.chmod(shared, mode & ~stat.S_ISVTX & ~0o002 if mode & 0o002 else mode & ~stat.S_ISVTX)
    check_not_shared(str(shared))  # not sticky, or not everyone's: the other checks judge it


@pytest.mark.integration
def test_the_root_directory_and_the_systems_tmp_are_refused_as_data_directories(tmp_path):
    with pytest.raises(DataDirError, match="is the root directory: give a directory of your own"):
        check_data_dir("/")
    tmp = tempfile.gettempdir()
    if stat.S_IMODE(os.stat(tmp).st_mode) & 0o1002 == 0o1002:
        done = pipeline("status", "--data-dir", tmp)
        assert done.returncode == 1 and f"such as {os.path.join(os.path.realpath(tmp), 'run1')}" in done.stderr
        assert "chmod" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.integration
@needs_root
def test_a_data_directory_owned_by_another_user_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, OTHER_UID, OTHER_UID)
    done = pipeline("status", "--data-dir", str(data))
    assert done.returncode == 1 and f"owned by uid {OTHER_UID}" in done.stderr, done.stderr
    done = pipeline("launch", "--items", "10", "--data-dir", str(data))
    assert done.returncode == 1 and f"owned by uid {OTHER_UID}" in done.stderr, done.stderr


@pytest.mark.integration
@needs_root
def test_another_user_cannot_pose_as_the_broker_of_an_open_data_directory(request):
    """What the hostile run did: with a 0777 data directory, another user replaced run/ and
    served a fake socket that the owner's `status` and `produce` talked to. Now the data
    directory is refused before any socket is opened, and the fake one never hears from us."""
    # pytest's own directories are 0700: the other user needs a path it can reach.
    base = tempfile.mkdtemp(prefix="sbrk-test-open-")
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    os.chmod(base, 0o755)
    data = Path(base) / "data"
    (data / "run").mkdir(parents=True)
    os.chmod(data, 0o777)
    fake = subprocess.Popen(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
         python_for(OTHER_UID, OTHER_UID, "os, shutil, socket"), "-c",
         "import os, shutil, socket, sys; run = sys.argv[1]; shutil.move(run, run + '.old'); os.mkdir(run); "
         "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(run, 'broker.sock')); s.listen(); "
         "print('ready', flush=True); s.settimeout(20); c, _ = s.accept(); print('TALKED', flush=True)",
         str(data / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline().strip() == "ready"
        for args in (["status", "--data-dir", str(data)], ["produce", __file__, "--data-dir", str(data)]):
            done = pipeline(*args)
            assert done.returncode == 1 and "has mode 0777" in done.stderr, done.stderr
        fake.kill()
        assert "TALKED" not in fake.communicate()[0]
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()


def test_a_directory_of_ours_linked_from_the_data_directory_is_checked_where_it_points(tmp_path):
    """results/ may live on another disk through a symbolic link of ours: the target must be
    owner-only like the data directory itself."""
    data, elsewhere = tmp_path / "data", tmp_path / "other-disk" / "results"
    prepare_data_dir(str(data))
    elsewhere.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "other-disk", 0o700)
    (data / "results").symlink_to(elsewhere)
    check_data_dir(str(data))
    prepare_data_dir(str(data))
    os.chmod(elsewhere, 0o777)
    with pytest.raises(DataDirError, match="links to .* has mode 0777"):
        check_data_dir(str(data))


@needs_root
def test_a_symbolic_link_another_user_placed_is_refused(tmp_path):
    data = tmp_path / "data"
    prepare_data_dir(str(data))
    (data / "results").symlink_to(tmp_path)
    os.lchown(data / "results", OTHER_UID, OTHER_UID)
    with pytest.raises(DataDirError, match=f"symbolic link owned by uid {OTHER_UID}"):
        check_data_dir(str(data))


def test_shared_memory_names_are_not_derived_from_the_path(tmp_path):
    """A fresh data directory gets a random namespace, in a file of its own (0600), kept
    across restarts and moves; one a broker ran on before the file existed keeps its path's
    hash (the objects its runs left carry it)."""
    from pipeline.broker.peers import NAMESPACE_FILE, _path_namespace, ensure_namespace, namespace_for

    fresh, other = str(tmp_path / "fresh"), str(tmp_path / "other")
    for path in (fresh, other):
        prepare_data_dir(path)
    assert namespace_for(fresh) == _path_namespace(fresh)  # nothing made yet: nothing named yet
    chosen = ensure_namespace(fresh, ran_before=False)
    assert chosen != _path_namespace(fresh) and chosen != ensure_namespace(other, ran_before=False)
    assert stat.S_IMODE(os.stat(os.path.join(fresh, NAMESPACE_FILE)).st_mode) == 0o600
    assert ensure_namespace(fresh, ran_before=False) == namespace_for(fresh) == chosen  # made once
    os.rename(fresh, tmp_path / "moved")
    assert namespace_for(str(tmp_path / "moved")) == chosen
    legacy = str(tmp_path / "legacy")
    prepare_data_dir(legacy)
    assert ensure_namespace(legacy, ran_before=True) == _path_namespace(legacy)


@pytest.mark.integration
@needs_root
def test_objects_another_user_made_under_a_path_derived_name_do_not_stop_a_run(tmp_path):
    """Another user who knows the data directory's path creates shared memory and semaphores
    under the names its hash gave (the first scheme): the run does not see them (its names
    are random), completes, and fails on none of them."""
    from pipeline.broker.peers import _path_namespace, object_prefix

    data = str(tmp_path / "data")
    prefix = object_prefix(_path_namespace(data))
    names = [f"{prefix}p0", f"{prefix}g1-c0", f"sem.{prefix}bell", f"sem.{prefix}p0.d", f"sem.{prefix}p0.s"]
    made = subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", python_for(OTHER_UID, OTHER_UID),
         "-c",
         "import sys\nfor n in sys.argv[1:]:\n    open('/dev/shm/' + n, 'wb').write(b'\\0' * 4096)", *names],
        capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    try:
        done = pipeline("launch", "--items", "200", "--data-dir", data, "--report", str(tmp_path / "r.json"))
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
    finally:
        for name in names:
            os.unlink(f"/dev/shm/{name}")


def test_one_launch_at_a_time_holds_a_data_directory_and_a_second_is_told_who(tmp_path):
    data = str(tmp_path / "data")
    assert lock_holder(launch_lock_path(data)) is None  # no file: nobody, and none made
    assert not os.path.exists(launch_lock_path(data))
    held = hold_for_launch(data)
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(launch_lock_path(data))).st_mode) == 0o700
        assert lock_holder(launch_lock_path(data)) == str(os.getpid())
        # Another open of the file is another holder, in this process too (flock).
        with pytest.raises(DataDirInUseError, match=f"another run is using the data directory {data}: "
                                                    f"pid {os.getpid()} holds {launch_lock_path(data)}"):
            hold_for_launch(data)
        assert lock_holder(launch_lock_path(data)) == str(os.getpid())  # the refused one changed nothing
    finally:
        release_launch(held)
    assert lock_holder(launch_lock_path(data)) is None
    release_launch(hold_for_launch(data))  # free again


def _wait(running, done) -> None:
    running.set()  # after the fork's hooks: the child has closed what it must by now
    done.wait(30)


@pytest.mark.integration
def test_a_launch_hold_is_the_launchers_alone_not_its_forked_childrens(tmp_path, ctx):
    data = str(tmp_path / "data")
    held = hold_for_launch(data)
    running, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_wait, args=(running, done))
    child.start()
    try:
        assert running.wait(30)
        release_launch(held)
        assert child.is_alive() and lock_holder(launch_lock_path(data)) is None  # the child never held it
    finally:
        done.set()
        child.join(30)
