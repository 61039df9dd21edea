"""Process entry points: what they set up before their loops."""

from __future__ import annotations

import subprocess
import sys


def test_quiet_gc_freezes_start_up_objects_and_raises_the_young_threshold():
    # In a fresh interpreter: the test runner's own collector settings stay as they are.
    code = (
        "import gc\n"
        "from pipeline.runtime.processes import GC_YOUNG_THRESHOLD, quiet_gc\n"
        "assert gc.get_freeze_count() == 0\n"
        "quiet_gc()\n"
        "assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD > 700, gc.get_threshold()\n"
        "assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()  # numpy, the package\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
