"""pipeline.batchjob.linedigests: every digest read through a window is the file's, at the
window's edges (its last entry, one past it, the file's last), in order and out of order,
and the window never holds more than its size; a file of another size, or one cut since, is
refused naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.batchjob.layout import LINE_DIGEST_DTYPE
from pipeline.batchjob.linedigests import DIGEST_WINDOW_ENTRIES, LineDigests
from pipeline.wire.errors import JobMismatchError

WINDOW = 16


def _digests(tmp_path: Path, count: int) -> tuple[Path, np.ndarray]:
    values = np.random.default_rng(count).integers(0, 2**63, size=count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    path = tmp_path / "lines.bin"
    records = np.zeros(count, dtype=LINE_DIGEST_DTYPE)
    records["line_xxh3"] = values
    records.tofile(path)
    return path, values


@pytest.mark.parametrize("count", [WINDOW - 1, WINDOW, WINDOW + 1, 3 * WINDOW, 3 * WINDOW + 1])
def test_every_digest_read_in_order_is_the_files(tmp_path: Path, count: int) -> None:
    path, values = _digests(tmp_path, count)
    digests = LineDigests(str(path), count, window_entries=WINDOW)
    try:
        for index in range(count):
            assert digests[index] == int(values[index])
            first, held = digests.window
            assert first <= index < first + held <= count and held <= WINDOW
    finally:
        digests.close()


def test_the_window_is_read_again_exactly_one_past_its_last_entry(tmp_path: Path) -> None:
    path, values = _digests(tmp_path, 2 * WINDOW + 3)
    digests = LineDigests(str(path), 2 * WINDOW + 3, window_entries=WINDOW)
    assert digests[0] == int(values[0]) and digests.window == (0, WINDOW)
    assert digests[WINDOW - 1] == int(values[WINDOW - 1]) and digests.window == (0, WINDOW)  # at its size
    assert digests[WINDOW] == int(values[WINDOW]) and digests.window == (WINDOW, WINDOW)  # one past it
    assert digests[2 * WINDOW + 2] == int(values[-1]) and digests.window == (2 * WINDOW + 2, 1)  # the file's last
    assert digests[5] == int(values[5]) and digests.window == (5, WINDOW)  # back before the window
    digests.close()


def test_the_default_window_is_bounded_whatever_the_files_size(tmp_path: Path) -> None:
    count = DIGEST_WINDOW_ENTRIES + 1
    path, values = _digests(tmp_path, count)
    digests = LineDigests(str(path), count)
    assert digests[0] == int(values[0])
    assert digests[DIGEST_WINDOW_ENTRIES - 1] == int(values[DIGEST_WINDOW_ENTRIES - 1])
    assert digests.window == (0, DIGEST_WINDOW_ENTRIES)
    assert digests[DIGEST_WINDOW_ENTRIES] == int(values[DIGEST_WINDOW_ENTRIES])
    assert digests.window == (DIGEST_WINDOW_ENTRIES, 1)
    digests.close()


def test_a_file_of_another_jobs_size_is_refused_naming_it(tmp_path: Path) -> None:
    path, _values = _digests(tmp_path, 10)
    with pytest.raises(JobMismatchError, match="lines.bin: 80 bytes, not the line digests of this job's 11 requests"):
        LineDigests(str(path), 11)
    with pytest.raises(JobMismatchError, match="cannot read the job's line digests"):
        LineDigests(str(tmp_path / "absent.bin"), 1)


def test_a_file_cut_since_it_was_opened_is_refused_naming_where_it_ends(tmp_path: Path) -> None:
    path, values = _digests(tmp_path, 3 * WINDOW)
    digests = LineDigests(str(path), 3 * WINDOW, window_entries=WINDOW)
    assert digests[0] == int(values[0])
    with open(path, "r+b") as f:
        f.truncate((WINDOW + 2) * LINE_DIGEST_DTYPE.itemsize)
    with pytest.raises(JobMismatchError, match=f"ends at byte {(WINDOW + 2) * 8}, before the digest of request "
                                               f"{2 * WINDOW - 1}"):
        digests[WINDOW]
    digests.close()
