"""`pipeline run-batch --input-scan`: the batch service's scan of an input at upload, adopted
by a new job instead of reading the input again, its line digests the job's own; an input
changed since that scan (the same size) stops the job with nothing written."""

from __future__ import annotations

import os

import pytest

from pipeline.batchjob.prescan import keep_scan, kept_paths
from pipeline.batchjob.scan import scan_input
from tests.support.jobs import build_model, check_output, run_batch, write_requests
from tools.make_batch_example import requests as example_requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def kept_scan_of(source, where) -> str:
    """`source`'s scan, kept as the service keeps an upload's."""
    os.makedirs(where)
    scan = scan_input(str(source), str(where / "scan"), str(where / "lines.bin"))
    keep_scan(scan, str(where / "lines.bin"), str(where / "file-1"))
    return str(where / "file-1")


def test_a_kept_scan_is_adopted_and_a_changed_input_stops_the_job(tmp_path, model_dir):
    records = example_requests(12, "tiny-llama")
    source = write_requests(tmp_path / "in.jsonl", records)
    prefix = kept_scan_of(source, tmp_path / "kept")
    out, data = tmp_path / "out.jsonl", tmp_path / "data"
    done = run_batch("-i", str(source), "-o", str(out), "--model", model_dir, "--data-dir", str(data),
                     "--keep-data-dir", "--input-scan", prefix)
    assert done.returncode == 0, done.stderr
    assert "checking" not in done.stderr  # no scan's progress: the input was not read again to check it
    assert os.stat(data / "job" / "lines.bin").st_ino == os.stat(kept_paths(prefix)[1]).st_ino
    assert {row["response"]["status_code"] for row in check_output(out, records)} == {200}

    text = source.read_bytes()
    at = text.index(b'"custom_id": "') + len(b'"custom_id": "')
    changed = text[:at] + (b"X" if text[at:at + 1] != b"X" else b"Y") + text[at + 1:]  # the same size
    source.write_bytes(changed)
    again = run_batch("-i", str(source), "-o", str(tmp_path / "again.jsonl"), "--model", model_dir,
                      "--data-dir", str(tmp_path / "data2"), "--input-scan", prefix)
    assert again.returncode != 0 and "the input file changed" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr and not (tmp_path / "again.jsonl").exists()
