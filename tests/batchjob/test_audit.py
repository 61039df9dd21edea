"""pipeline.batchjob.audit: a job's output files against its input, on files made here as a job
writes them. Every damage is named by file and line; two custom_ids of one digest are told
apart by reading their lines, whether the digest groups them with others or pairs one request
with one answer; spilled records and buckets give the verdict unspilled ones give; every
limit holds at its value and refuses past it; a file that cannot be read is one typed error;
and memory does not grow with the files."""

from __future__ import annotations

import json
import os
import random
import tracemalloc
from pathlib import Path

import pytest

from pipeline.batchjob import audit as audit_module
from pipeline.batchjob import scan as scan_module
from pipeline.batchjob.audit import AuditResult, JobFiles, audit_job
from pipeline.batchjob.scan import custom_id_digest
from pipeline.wire.errors import AuditFileError
from tests.batchjob.batchfiles import answer, chat, completion, write

# A job of each kind of request, two of them failed (400, 500).
REQUESTS = [chat(f"c-{k}", n=1 + k % 3) for k in range(6)] + [completion(f"p-{k}") for k in range(4)]
FAILED = {3: 400, 7: 500}


def lines_of(requests: list[dict], failed: dict[int, int] | None = None) -> list[dict]:
    failed = FAILED if failed is None else failed
    return [answer(r, k, failed.get(k, 200)) for k, r in enumerate(requests)]


def make_job(tmp_path: Path, answers: list[object], errors: list[object] | None = None,
             requests: list[dict] = REQUESTS, summary: object = None) -> JobFiles:
    """A job's files: its input (with a blank line, which is no request), output and error file;
    a last answer given as bytes ends the output without its newline (cut short)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = write(tmp_path / "in.jsonl", requests[0], "", *requests[1:])
    output = tmp_path / "out.jsonl"
    if answers:
        write(output, *answers, last_newline=not isinstance(answers[-1], bytes))
    output.touch()
    error_file = None
    if errors is not None:
        error_file = write(tmp_path / "err.jsonl", *errors) if errors else tmp_path / "err.jsonl"
        error_file.touch()
    summary_file = None
    if summary is not None:
        summary_file = tmp_path / "out.jsonl.summary.json"
        summary_file.write_text(json.dumps(summary))
    return JobFiles(str(source), str(output), str(error_file) if error_file else None,
                    str(summary_file) if summary_file else None)


def check(files: JobFiles, order: str = "input", digest=custom_id_digest, work: Path | None = None) -> AuditResult:
    work = work or Path(files.output_path).parent / "work"
    result = audit_job(files, order, str(work), digest)
    assert not list(work.rglob("*")), "the audit's spills are removed"
    return result


def input_line(k: int) -> int:
    """The input line of request k (a blank line follows the first)."""
    return k + 1 if k == 0 else k + 2


def test_a_jobs_answers_inline_or_with_an_error_file_pass_and_are_counted(tmp_path: Path) -> None:
    answers = lines_of(REQUESTS)
    result = check(make_job(tmp_path / "inline", answers))
    assert result.ok, result.examples
    assert (result.requests, result.answered, result.lines) == (10, 10, {"output file": 10})
    assert result.tally.by_status == {200: 8, 400: 1, 500: 1}
    assert result.tally.prompt_tokens == 8 * 12 and result.tally.completion_tokens == 8 * 3
    assert result.line().startswith("OK: 10 requests, each answered once: 8 completed, 2 failed (1 with status "
                                    "400, 1 with status 500)")
    ok = [a for a in answers if a["response"]["status_code"] == 200]
    failed = [a for a in answers if a["response"]["status_code"] != 200]
    result = check(make_job(tmp_path / "split", ok, failed))
    assert result.ok and result.lines == {"output file": 8, "error file": 2}, result.examples
    shuffled = random.Random(5).sample(answers, len(answers))
    assert check(make_job(tmp_path / "any", shuffled), order="completion").ok
    assert check(make_job(tmp_path / "any-input", shuffled), order="input").counts.keys() == {"order"}


def test_a_job_without_requests_or_answers_is_audited(tmp_path: Path) -> None:
    files = make_job(tmp_path, [], requests=[chat("only")])
    result = check(files)
    assert result.counts == {"missing": 1} and result.examples["missing"] == [
        f"{files.input_path}:1: custom_id 'only' has no answer"]


def _moved(answers: list[dict], errors: list[dict]) -> tuple[list, list]:
    """The 500 of the error file moved into the output, and the first 200 into the error file,
    each where input order puts it."""
    return [*answers[1:6], errors[1], *answers[6:]], [answers[0], errors[0]]


def _damages(requests: list[dict]) -> dict:
    """Damaged copies of a job's answers: (output lines, error lines or None, kinds with their
    first example's file and line)."""
    answers = lines_of(requests)
    good, bad = [a for a in answers if a["response"]["status_code"] == 200], \
        [a for a in answers if a["response"]["status_code"] != 200]
    stranger = dict(answers[0], custom_id="stranger")
    wrong_model = json.loads(json.dumps(answers[4]))
    wrong_model["response"]["body"]["model"] = "other"
    return {
        "dropped": ([*answers[:2], *answers[3:]], None, {"missing": ("in", input_line(2))}),
        "duplicated": ([*answers[:5], answers[1], *answers[5:]], None, {"duplicated": ("out", 6)}),
        "swapped": ([*answers[:4], answers[5], answers[4], *answers[6:]], None, {"order": ("out", 6)}),
        "unknown": ([*answers, stranger], None, {"unexpected": ("out", 11)}),
        "cut": ([*answers[:-1], json.dumps(answers[-1]).encode()[:50]], None, {"malformed": ("out", 10),
                                                                      "missing": ("in", input_line(9))}),
        "moved": (*_moved(good, bad), {"misplaced": ("out", 6)}),
        "wrong model": ([*answers[:4], wrong_model, *answers[5:]], None, {"body": ("out", 5)}),
        "not json": ([*answers[:3], "{oops", *answers[4:]], None, {"malformed": ("out", 4),
                                                                   "missing": ("in", input_line(3))}),
    }


@pytest.mark.parametrize("damage", sorted(_damages(REQUESTS)))
@pytest.mark.parametrize("digest", ["xxh3", "all collide", "half collide"])
def test_each_damage_is_named_by_file_and_line_however_the_digests_fall(tmp_path: Path, damage: str,
                                                                        digest: str) -> None:
    answers, errors, expected = _damages(REQUESTS)[damage]
    files = make_job(tmp_path, answers, errors)
    digests = {"xxh3": custom_id_digest, "all collide": lambda custom_id: 42,
               "half collide": lambda custom_id: len(custom_id) % 2}[digest]
    result = check(files, digest=digests)
    assert set(result.counts) == set(expected), result.examples
    paths = {"in": files.input_path, "out": files.output_path}
    for kind, (file, line) in expected.items():
        assert result.counts[kind] == 1 + (kind == "misplaced"), result.examples
        assert result.examples[kind][0].startswith(f"{paths[file]}:{line}: "), result.examples[kind]
    assert result.line().startswith("FAILED: ")


def test_the_examples_say_what_each_problem_is(tmp_path: Path) -> None:
    damages = _damages(REQUESTS)
    said = {}
    for name in ("dropped", "duplicated", "swapped", "unknown", "cut", "moved", "wrong model"):
        answers, errors, _ = damages[name]
        said.update(check(make_job(tmp_path / name.replace(" ", "-"), answers, errors)).examples)
    out = "out.jsonl"
    assert said["missing"][0].endswith(":11: custom_id 'p-3' has no answer")  # the cut one's, the last
    assert said["duplicated"][0].endswith(f"{out}:6: custom_id 'c-1' is answered again (first at "
                                          f"{tmp_path / 'duplicated' / out}:2)")
    assert said["order"][0].endswith(f"{out}:6: custom_id 'c-4' (input line 6) comes after custom_id 'c-5' (input "
                                     f"line 7) at line 5: in input order, answers follow their requests")
    assert said["unexpected"][0].endswith(f"{out}:11: custom_id 'stranger' is the custom_id of no request in the input")
    assert said["malformed"][0].startswith(f"{tmp_path / 'cut' / out}:10: cut short: the file ends without a newline "
                                           f"(a job writes whole lines); not JSON (Unterminated string")
    assert said["misplaced"] == [f"{tmp_path / 'moved' / out}:6: status 500 in the output file: with an error file, "
                                 f"failures go there and successes to the output (as OpenAI's batches)",
                                 f"{tmp_path / 'moved' / 'err.jsonl'}:1: status 200 in the error file: with an "
                                 f"error file, failures go there and successes to the output (as OpenAI's batches)"]
    assert said["body"][0].endswith(f"{out}:5: custom_id 'c-4' (input line 6): model \"other\", the request asked for "
                                    f"\"tiny\"")


def test_an_answer_whose_digest_is_a_missing_requests_is_not_taken_for_its_answer(tmp_path: Path) -> None:
    """One request and one answer of one digest are paired by the join, then told apart by
    their custom_ids: the request has no answer, the answer is to no request."""
    requests = [chat("a"), chat("b"), chat("c")]
    answers = lines_of(requests, {})
    stranger = dict(answers[0], custom_id="x")
    files = make_job(tmp_path, [stranger, answers[1], answers[2]], requests=requests)
    collide = {"a": 1, "x": 1}
    result = check(files, digest=lambda custom_id: collide.get(custom_id, hash(custom_id) & 0xFFFF | 2))
    assert result.counts == {"missing": 1, "unexpected": 1} and result.answered == 2
    assert result.examples["missing"] == [f"{files.input_path}:1: custom_id 'a' has no answer"]
    assert result.examples["unexpected"] == [f"{files.output_path}:1: custom_id 'x' is the custom_id of no request "
                                             f"in the input"]
    assert check(make_job(tmp_path / "fine", answers, requests=requests),
                 digest=lambda custom_id: 1 if custom_id in "ab" else 2).ok


def test_a_custom_id_the_input_uses_twice_is_the_inputs_problem(tmp_path: Path) -> None:
    requests = [chat("a"), chat("b"), chat("a")]
    files = make_job(tmp_path, lines_of(requests[:2], {}), requests=requests)
    result = check(files)
    assert result.counts == {"input": 1}
    assert result.examples["input"] == [f"{files.input_path}:4: custom_id 'a' is used by line 1 too"]


def test_spilled_digests_and_many_buckets_give_the_same_verdict(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [chat(f"r-{k}", n=1 + k % 2) for k in range(300)]
    answers = lines_of(requests, {k: 400 for k in range(0, 300, 7)})
    del answers[40]
    answers.insert(100, answers[90])
    answers[200], answers[201] = answers[201], answers[200]
    files = make_job(tmp_path, [*answers, dict(answers[0], custom_id="nobody")], requests=requests)
    expected = check(files)
    assert expected.counts == {"missing": 1, "duplicated": 1, "order": 1, "unexpected": 1}
    monkeypatch.setattr(scan_module, "SPILL_BUFFER_RECORDS", 16)
    monkeypatch.setattr(audit_module, "PAIR_BUCKET_LINES", 7)
    spilled = check(files)
    assert (spilled.counts, spilled.examples, spilled.answered, spilled.tally) == (
        expected.counts, expected.examples, expected.answered, expected.tally)


def test_the_summary_beside_the_output_is_held_to_the_files(tmp_path: Path) -> None:
    summary = {"job": {"request_counts": {"total": 10, "completed": 8, "failed": 2},
                       "failed_by_status": {"400": 1, "500": 1},
                       "usage": {"prompt_tokens": 96, "completion_tokens": 24, "total_tokens": 120,
                                 "cached_tokens": 32},
                       "output_written": True}}
    result = check(make_job(tmp_path / "agrees", lines_of(REQUESTS), summary=summary))
    assert result.ok and result.line().endswith("; the summary agrees"), result.examples
    summary["job"]["request_counts"]["completed"] = 9
    files = make_job(tmp_path / "differs", lines_of(REQUESTS), summary=summary)
    assert check(files).examples == {"summary": [f"{files.summary_path}: request_counts.completed is 9, the files "
                                                 f"hold 8"]}
    Path(files.summary_path).write_text("{")
    assert check(files).examples["summary"][0].startswith(f"{files.summary_path}: not a job's summary")


# --- limits ---------------------------------------------------------------------------------------


def test_an_answer_line_at_the_length_limit_is_read_and_one_byte_more_is_not(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    answers = lines_of(REQUESTS, {})
    files = make_job(tmp_path, answers)
    longest = max(len(json.dumps(a)) for a in answers)
    monkeypatch.setattr(audit_module, "MAX_ANSWER_LINE_BYTES", longest)
    assert check(files).ok
    monkeypatch.setattr(audit_module, "MAX_ANSWER_LINE_BYTES", longest - 1)
    result = check(files)
    assert result.counts["malformed"] >= 1 and result.counts["missing"] == result.counts["malformed"]
    assert f"longer than {longest - 1:,} bytes: no job writes a line this long" in result.examples["malformed"][0]


def test_answer_lines_up_to_the_limit_are_read_and_one_more_stops_the_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_module, "MAX_ANSWER_LINES", 3)  # the real limit is 2**28 lines
    requests = REQUESTS[:3]
    answers = lines_of(requests, {})
    assert check(make_job(tmp_path / "at", answers, requests=requests)).ok
    files = make_job(tmp_path / "past", [*answers, answers[0], answers[1]], requests=requests)
    result = check(files)
    assert result.counts == {"malformed": 1} and result.lines == {"output file": 3}
    assert result.examples["malformed"] == [f"{files.output_path}:4: more than 3 lines, more than a job answers; "
                                            f"reading stopped here"]


def test_requests_up_to_the_limit_are_read_and_one_more_stops_the_input(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_module, "MAX_REQUESTS", 3)  # the real limit is 2**28 requests
    requests = REQUESTS[:4]
    answers = lines_of(requests, {})
    assert check(make_job(tmp_path / "at", answers[:3], requests=requests[:3])).ok
    files = make_job(tmp_path / "past", answers, requests=requests)
    result = check(files)
    assert result.counts == {"input": 1, "unexpected": 1} and result.requests == 3
    assert result.examples["input"] == [f"{files.input_path}:5: more than 3 requests, more than a job runs; reading "
                                        f"stopped here"]


def test_a_request_line_at_the_length_limit_is_read_and_one_byte_more_is_the_inputs_problem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = make_job(tmp_path, lines_of(REQUESTS, {}))
    longest = max(len(json.dumps(r)) for r in REQUESTS)
    monkeypatch.setattr(audit_module, "MAX_REQUEST_LINE_BYTES", longest)  # the scan's, 16 MiB
    assert check(files).ok
    monkeypatch.setattr(audit_module, "MAX_REQUEST_LINE_BYTES", longest - 1)
    result = check(files)
    assert result.counts["input"] == result.counts["unexpected"] >= 1
    assert f"longer than {longest - 1:,} bytes: no job reads it" in result.examples["input"][0]


def test_a_summary_at_the_length_limit_is_read_and_one_byte_more_is_not_a_jobs(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    summary = {"job": {"request_counts": {"total": 3, "completed": 3, "failed": 0}, "failed_by_status": {},
                       "usage": {"prompt_tokens": 36, "completion_tokens": 9, "total_tokens": 45, "cached_tokens": 12},
                       "output_written": True}}
    files = make_job(tmp_path, lines_of(REQUESTS[:3], {}), requests=REQUESTS[:3], summary=summary)
    size = Path(files.summary_path).stat().st_size
    monkeypatch.setattr(audit_module, "MAX_SUMMARY_BYTES", size)
    assert check(files).ok
    monkeypatch.setattr(audit_module, "MAX_SUMMARY_BYTES", size - 1)
    assert check(files).examples == {"summary": [f"{files.summary_path}: not a job's summary (longer than "
                                                 f"{size - 1:,} bytes)"]}


# --- files that cannot be read ------------------------------------------------------------------


def test_a_file_that_cannot_be_read_is_one_typed_error_naming_it(tmp_path: Path) -> None:
    files = make_job(tmp_path, lines_of(REQUESTS))
    absent = JobFiles(files.input_path, str(tmp_path / "nothing.jsonl"))
    with pytest.raises(AuditFileError, match=f"^output file {tmp_path / 'nothing.jsonl'}: does not exist$"):
        check(absent)
    with pytest.raises(AuditFileError, match=f"^input file {tmp_path}: a directory, not a regular file"):
        check(JobFiles(str(tmp_path), files.output_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AuditFileError, match="error file .*fifo: a pipe, not a regular file"):  # never waited on
        check(JobFiles(files.input_path, files.output_path, str(fifo)))
    with pytest.raises(AuditFileError, match="^summary .*none.json: does not exist$"):
        check(JobFiles(files.input_path, files.output_path, None, str(tmp_path / "none.json")))


# --- memory -------------------------------------------------------------------------------------

SMALL_REQUESTS = 1_000
LARGE_REQUESTS = 10_000
# Ten times the lines may cost at most this many times the peak (an audit that kept a set of
# custom_ids, or a line per request, would grow about tenfold).
GENEROUS_RATIO = 2.0


def _peak_bytes(tmp_path: Path, requests: int) -> int:
    tmp_path.mkdir()
    line = json.dumps(chat("ID", n=1))
    reply = json.dumps(answer(chat("ID"), 0))
    with open(tmp_path / "in.jsonl", "w") as source, open(tmp_path / "out.jsonl", "w") as out:
        for k in range(requests):
            source.write(line.replace('"ID"', f'"request-{k:09d}"') + "\n")
            out.write(reply.replace('"ID"', f'"request-{k:09d}"') + "\n")
    files = JobFiles(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    result = audit_job(files, "input", str(tmp_path / "work"))
    assert result.ok and result.answered == requests, result.examples
    return tracemalloc.get_traced_memory()[1] - before


def test_an_audits_memory_does_not_grow_with_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the read block, the spill buffer and the pair buckets smaller than both files
    (what bounds the audit's memory at any size), ten times the lines take no more memory."""
    monkeypatch.setattr(scan_module, "READ_BLOCK_BYTES", 32 << 10)
    monkeypatch.setattr(scan_module, "SPILL_BUFFER_RECORDS", 512)
    monkeypatch.setattr(audit_module, "PAIR_BUCKET_LINES", 512)
    tracemalloc.start()
    try:
        _peak_bytes(tmp_path / "warm", 50)  # imports and caches, once
        small = _peak_bytes(tmp_path / "small", SMALL_REQUESTS)
        large = _peak_bytes(tmp_path / "large", LARGE_REQUESTS)
    finally:
        tracemalloc.stop()
    assert 0 < large <= GENEROUS_RATIO * small, (small, large)
    assert large < os.path.getsize(tmp_path / "large" / "out.jsonl") / 4, large
