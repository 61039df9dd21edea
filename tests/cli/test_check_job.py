"""`pipeline tools check-job` on a real job: `run-batch` with the sim engine on the tiny model,
with an error file in input order and with errors inline in completion order, passes with a
one-line verdict; damaged copies of its output (a line dropped, one duplicated, two swapped, an
unknown custom_id, a last line cut short, a 500 moved into the output, a wrong model, a
summary that disagrees) each fail, naming the problem at its file and line; a file that
cannot be read is a one-line error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pipeline.cli import main
from tests.support.jobs import build_model, chat, completion, run_batch, write_requests

pytestmark = pytest.mark.integration

REQUESTS = [chat(f"chat-{k}", content=f"Hello {k}") for k in range(8)] + [
    chat("two", n=2, temperature=1.0), completion("story"), chat("bad-param", top_k="many"),
    chat("other-model", model="nope"), *(completion(f"text-{k}", prompt=f"Once {k}") for k in range(6))]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    """Two finished jobs of REQUESTS: "split" (an error file, input order) and "inline"
    (completion order); each directory holds in.jsonl, out.jsonl and the job's summary."""
    model = build_model(tmp_path_factory.mktemp("model") / "tiny-llama")
    made = {}
    for name, flags in (("split", ["--error-file"]), ("inline", ["--output-order", "completion"])):
        where = tmp_path_factory.mktemp(name)
        source = write_requests(where / "in.jsonl", REQUESTS)
        args = [*flags, str(where / "err.jsonl")] if name == "split" else flags
        done = run_batch("-i", str(source), "-o", str(where / "out.jsonl"), "--model", model, *args)
        assert done.returncode == 0, done.stderr
        made[name] = where
    return made


def check_job(*args: str) -> Result:
    return CliRunner().invoke(main, ["tools", "check-job", *args])


def test_a_finished_job_passes_with_its_summary_in_one_line(jobs: dict[str, Path]) -> None:
    split = jobs["split"]
    result = check_job("-i", str(split / "in.jsonl"), "-o", str(split / "out.jsonl"), "--error-file",
                       str(split / "err.jsonl"))
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1
    assert result.output.startswith(f"check-job: OK: {len(REQUESTS)} requests, each answered once: "
                                    f"{len(REQUESTS) - 2} completed, 2 failed (2 with status 400); usage ")
    assert result.output.rstrip().endswith("; in input order; the summary agrees")
    inline = jobs["inline"]
    result = check_job("-i", str(inline / "in.jsonl"), "-o", str(inline / "out.jsonl"), "--output-order",
                       "completion", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["ok"] and found["answered"] == len(REQUESTS) and found["by_status"] == {
        "200": len(REQUESTS) - 2, "400": 2}
    assert found["usage"]["total_tokens"] == found["usage"]["prompt_tokens"] + found["usage"]["completion_tokens"] > 0


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _position(lines: list[str], custom_id: str) -> int:
    return next(k for k, line in enumerate(lines) if json.loads(line)["custom_id"] == custom_id)


def _as_500(line: str) -> str:
    row = json.loads(line)
    row["response"]["status_code"] = 500
    row["response"]["body"]["error"]["type"] = "server_error"
    return json.dumps(row) + "\n"


def _damaged(job: Path) -> dict[str, tuple[list[str], list[str], str, str, int]]:
    """Damaged copies of the split job's files: (output lines, error lines, the kind named,
    which file ("in", "out" or "err") and line it names first)."""
    out, err = _lines(job / "out.jsonl"), _lines(job / "err.jsonl")
    ids = [r["custom_id"] for r in REQUESTS]
    line_of = {custom_id: k + 1 for k, custom_id in enumerate(ids)}
    stranger = json.loads(out[0])
    stranger["custom_id"] = "stranger"
    wrong = json.loads(out[3])
    wrong["response"]["body"]["model"] = "other-model"
    failed = _position(err, "bad-param")
    at = _position(out, "text-0")  # where input order puts bad-param among the successes
    moved = out[:at] + [_as_500(err[failed])] + out[at:]
    return {
        "dropped": (out[:4] + out[5:], err, "missing", "in", line_of[json.loads(out[4])["custom_id"]]),
        "duplicated": (out[:6] + [out[2]] + out[6:], err, "duplicated", "out", 7),
        "swapped": (out[:5] + [out[6], out[5]] + out[7:], err, "order", "out", 7),
        "unknown": (out + [json.dumps(stranger) + "\n"], err, "unexpected", "out", len(out) + 1),
        "cut": (out[:-1] + [out[-1][:len(out[-1]) // 2]], err, "malformed", "out", len(out)),
        "moved": (moved, err[:failed] + err[failed + 1:], "misplaced", "out", at + 1),
        "wrong model": (out[:3] + [json.dumps(wrong) + "\n"] + out[4:], err, "body", "out", 4),
    }


@pytest.mark.parametrize("damage", ["dropped", "duplicated", "swapped", "unknown", "cut", "moved", "wrong model"])
def test_each_damage_to_a_jobs_output_is_named_at_its_file_and_line(jobs: dict[str, Path], tmp_path: Path,
                                                                   damage: str) -> None:
    job = jobs["split"]
    out_lines, err_lines, kind, file, line = _damaged(job)[damage]
    shutil.copy(job / "in.jsonl", tmp_path / "in.jsonl")
    (tmp_path / "out.jsonl").write_text("".join(out_lines))
    (tmp_path / "err.jsonl").write_text("".join(err_lines))
    result = check_job("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--error-file",
                       str(tmp_path / "err.jsonl"))
    assert result.exit_code == 1, result.output
    assert result.output.startswith("check-job: FAILED: ") and "Traceback" not in result.output
    said = result.output.splitlines()
    title = next(k for k, text in enumerate(said) if text.startswith(f"{kind} ("))
    assert said[title + 1].startswith(f"  {tmp_path / (file + '.jsonl')}:{line}: "), result.output


def test_a_summary_that_disagrees_with_the_files_is_named(jobs: dict[str, Path], tmp_path: Path) -> None:
    job = jobs["split"]
    for name in ("in.jsonl", "out.jsonl", "err.jsonl"):
        shutil.copy(job / name, tmp_path / name)
    summary = json.loads((job / "out.jsonl.summary.json").read_text())
    summary["job"]["request_counts"]["failed"] = 3
    (tmp_path / "out.jsonl.summary.json").write_text(json.dumps(summary))
    result = check_job("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--error-file",
                       str(tmp_path / "err.jsonl"))
    assert result.exit_code == 1
    assert f"  {tmp_path / 'out.jsonl.summary.json'}: request_counts.failed is 3, the files hold 2\n" in result.output


def test_a_file_that_cannot_be_read_is_a_one_line_error(jobs: dict[str, Path], tmp_path: Path) -> None:
    job = jobs["split"]
    result = check_job("-i", str(job / "in.jsonl"), "-o", str(tmp_path / "absent.jsonl"))
    assert result.exit_code == 1
    assert result.output == f"Error: output file {tmp_path / 'absent.jsonl'}: does not exist\n"
    result = check_job("-i", str(job / "in.jsonl"), "-o", str(job / "out.jsonl"), "--summary-file",
                       str(tmp_path / "none.json"))
    assert result.output == f"Error: summary {tmp_path / 'none.json'}: does not exist\n"
