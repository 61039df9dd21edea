"""`pipeline run-batch`: an OpenAI Batch file through the pipeline, resumable, into one
output file with exactly one line per request.

    plan = plan_job(batch_file, data_dir, served_model, now_s=time.time())
    outcome = Launcher(settings, JobWorkload(batch_file, plan.to_submit, ...)).run()  # if any
    summary = finish_job(batch_file, read_answers(data_dir), ...)  # writes the output file

A job runs on a data directory (`--data-dir`, by default the output file's name with
`.run`): the broker's store, the results of every run, and the job's own state
(`pipeline/batchjob/job.py`). The same command after a crash, a kill -9 of any process or
a Ctrl-C plans again from what is there: answered requests are not run again, requests
still in the store or in a producer ring are delivered by the broker (not submitted
again), and only the rest are submitted.

The output is assembled at the end, from the answers, and written whole (a temporary file,
fsync, rename): a crash never leaves a torn or duplicated line in it, and it is written only
once every request has its answer.
NOTE: appending each answer to the output as it arrives was rejected: a consumer's results
file already is that append log (whole batches or nothing, torn tails terminated), and a
second log would need its own torn-line and duplicate handling, while `--output-order input`
(the default, as `vllm run-batch` writes) needs every answer before the first line anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.batchjob.chat import ChatTokenizer
from pipeline.batchjob.job import Answers, JobManifest, pending_requests, read_answers
from pipeline.batchjob.output import (
    HTTP_BAD_REQUEST,
    HTTP_OK,
    HTTP_SERVER_ERROR,
    Usage,
    error_line,
    row_line,
    usage_totals,
    write_output,
)
from pipeline.batchjob.requests import BatchFile, BatchRequest
from pipeline.runtime.inventory import pending_payloads, producer_ring_names
from pipeline.wire.generation import decode_payload

OUTPUT_ORDERS = ("input", "completion")


@dataclass(slots=True)
class JobPlan:
    """What a run of a job has to do: the requests to submit, and what is already there."""

    manifest: JobManifest
    answers: Answers
    pending: set[int]  # requests an earlier run left in the store or a ring
    to_submit: list[int]  # request indices, in file order


def plan_job(batch_file: BatchFile, data_dir: str, served_model: str, now_s: float) -> JobPlan:
    """Read the data directory's state of the job (a fresh one is a new job) and what this
    run must submit. JobMismatchError if the directory holds another job."""
    wanted = JobManifest(batch_file.sha256, batch_file.path, served_model, len(batch_file.requests), int(now_s))
    manifest = JobManifest.load_or_create(data_dir, wanted)
    answers = read_answers(data_dir)
    answered = answers.answered()
    payloads = pending_payloads(data_dir, producer_ring_names(data_dir))
    pending = pending_requests(decode_payload(p)[1] for p in payloads.values()) - answered
    to_submit = [r.index for r in batch_file.requests
                 if r.error is None and r.index not in answered and r.index not in pending]
    return JobPlan(manifest, answers, pending, to_submit)


@dataclass(slots=True)
class JobSummary:
    """What a job answered: requests completed (status 200) and failed, by status code, and
    the usage summed over the completions."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    failed_by_status: dict[int, int] = field(default_factory=dict)
    unanswered: list[int] = field(default_factory=list)  # request indices, when not finished
    usage: Usage = field(default_factory=Usage)
    output_written: bool = False


def finish_job(batch_file: BatchFile, answers: Answers, tokenizer: ChatTokenizer, manifest: JobManifest,
               output_path: str, order: str) -> JobSummary:
    """Write the output file if every request has its answer; the job's summary either way."""
    assert order in OUTPUT_ORDERS, order
    requests = batch_file.requests
    summary = JobSummary(requests=len(requests))
    answered = answers.answered()
    summary.unanswered = [r.index for r in requests if r.error is None and r.index not in answered]
    if summary.unanswered:
        return summary
    lines: dict[int, str] = {}
    for request in requests:
        lines[request.index], status = _answer(request, answers, tokenizer, manifest)
        if status == HTTP_OK:
            summary.completed += 1
        else:
            summary.failed += 1
            summary.failed_by_status[status] = summary.failed_by_status.get(status, 0) + 1
    summary.usage = usage_totals(answers.rows[r.index] for r in requests if r.index in answers.rows)
    write_output(output_path, (lines[k] for k in _output_order(batch_file, answers, order)))
    summary.output_written = True
    return summary


def _output_order(batch_file: BatchFile, answers: Answers, order: str) -> list[int]:
    """Request indices in the output's order: the file's, or the order answers came (those
    answered without running first: bad requests, rejections)."""
    if order == "input":
        return [r.index for r in batch_file.requests]
    ran = set(answers.order)
    return [r.index for r in batch_file.requests if r.index not in ran] + answers.order


def _answer(request: BatchRequest, answers: Answers, tokenizer: ChatTokenizer,
            manifest: JobManifest) -> tuple[str, int]:
    """One request's output line and its status code."""
    job = manifest.input_sha256
    if request.error is None and request.index in answers.rejected:
        return error_line(request, HTTP_BAD_REQUEST, answers.rejected[request.index], job_hash=job), HTTP_BAD_REQUEST
    row = answers.rows.get(request.index)
    text = None
    if row is not None and row.get("status") == "ok":
        text = row["text"] if isinstance(row.get("text"), str) else tokenizer.decode(row["output"])
    line = row_line(request, row, text, served_model=manifest.served_model, created=manifest.created_s,
                    job_hash=job)
    if request.error is not None or row is None:
        return line, HTTP_BAD_REQUEST
    return line, {"ok": HTTP_OK, "too_long": HTTP_BAD_REQUEST}.get(str(row.get("status")), HTTP_SERVER_ERROR)
