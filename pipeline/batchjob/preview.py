"""A batch file's requests as the job's producers would make them, without a job: what
`pipeline tools analyze FILE --model DIR` reads.

    preview = BatchPreview("requests.jsonl", "models/llama")
    counts = preview.run(on_item=lambda item, line: ..., on_progress=show)
    counts.requests, counts.made, counts.refused, counts.examples

One pass over the file: the job's scan (`scan.py`: every file-level rule, in memory bounded
independently of the file's length, bad lines named path:line in one BatchFileError at the
end) hands each request line, as it reads it, to a producer's item maker
(`workload.JobWorkload.make`): the body parsed and checked, the prompt rendered and
tokenized with the model's tokenizer and chat template, each shared prefix once per shape
(the tokenizer's memo), and the item's components, whose chain names its shape. So a
request's item here is the item a producer of the job submits, token for token; a request a
producer would answer 400 itself (a bad body, a prompt past the context) is counted as
refused, the first MAX_EXAMPLES with their line and message.

As run-batch's defaults: the served model is the directory's name unless given, the longest
prompt is the model's context (config.json) less one, the runner (generate or pool) is read
from the model directory, no LoRA adapters and no tool-call parser. Unlike a job, a request's
template and tokenizer run without the producer's time limit (its memory bound on one text
is kept: `ChatTokenizer.max_text_bytes`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from pipeline.batchjob.chat import TOKENIZE_BYTES_PER_TEXT_BYTE, ChatTokenizer
from pipeline.batchjob.embeddings import RUNNER_POOLING, job_runner
from pipeline.batchjob.layout import INDEX_ENTRY_DTYPE
from pipeline.batchjob.manifest import JobManifest
from pipeline.batchjob.scan import scan_input
from pipeline.batchjob.template import read_chat_template
from pipeline.batchjob.workload import DEFAULT_PROMPT_MEMORY_LIMIT_BYTES, JobInput, JobWorkload, PromptLimits
from pipeline.producer.workload import WorkItem

# Refused requests listed with their line and message (all are counted): enough to see
# what is wrong, few enough that a file of nothing but refusals does not bury the figures.
MAX_EXAMPLES = 5
# Requests between two calls of on_progress: the caller decides what to show and when.
PROGRESS_EVERY_REQUESTS = 4096

OnItem = Callable[[WorkItem, int], None]


@dataclass(slots=True)
class PreviewCounts:
    """What the pass saw: request lines, items made, requests a producer would answer
    itself (400), the first MAX_EXAMPLES of those as (line, message), and the bytes read."""

    requests: int = 0
    made: int = 0
    refused: int = 0
    examples: list[tuple[int, str]] = field(default_factory=list)
    input_bytes: int = 0


class _Refusals:
    """A producer's rejection log that counts, keeping the first MAX_EXAMPLES messages."""

    def __init__(self, counts: PreviewCounts) -> None:
        self.counts = counts
        self.line = 0  # the line of the request being made

    def reject(self, _where, _status: int, message: str, _param: str | None = None, _code: str | None = None) -> None:
        self.counts.refused += 1
        if len(self.counts.examples) < MAX_EXAMPLES:
            self.counts.examples.append((self.line, message))


class BatchPreview:
    """The producers' view of one batch file (module doc). Owner: one command. Making one
    reads the model directory (ModelDirError, SettingsError naming what is wrong), `run` the
    file."""

    def __init__(self, path: str, model_dir: str, served_model: str | None = None,
                 chat_template: str | None = None) -> None:
        from pipeline.runtime.settings import model_context_len

        self.path = path
        self.model_dir = model_dir
        self.served_model = served_model or os.path.basename(os.path.normpath(model_dir))
        self.chat_template = read_chat_template(chat_template) if chat_template is not None else None
        self.tokenizer = ChatTokenizer.load(model_dir, chat_template=self.chat_template)
        self.tokenizer.max_text_bytes = DEFAULT_PROMPT_MEMORY_LIMIT_BYTES // TOKENIZE_BYTES_PER_TEXT_BYTE
        self.runner = job_runner({}, model_dir)
        config = os.path.join(model_dir, "config.json")
        context = model_context_len(config) if os.path.exists(config) else None
        longest = context - 1 if context and self.runner != RUNNER_POOLING else None
        self.maker = _maker(path, model_dir, self.served_model, self.runner, self.chat_template,
                            PromptLimits(max_prompt_tokens=longest, context_tokens=context))

    def run(self, on_item: OnItem, limit: int | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> PreviewCounts:
        """Check the whole file and give `on_item(item, line)` the item of each of its first
        `limit` requests (all without a limit) that a producer makes, in file order;
        `on_progress(bytes_read, requests)` every PROGRESS_EVERY_REQUESTS requests.
        BatchFileError (path:line) for a file run-batch would refuse."""
        counts = PreviewCounts()
        refusals = _Refusals(counts)

        def on_request(index: int, line: int, offset: int, raw: bytes) -> None:
            counts.requests += 1
            if on_progress is not None and counts.requests % PROGRESS_EVERY_REQUESTS == 0:
                on_progress(offset, counts.requests)
            if limit is not None and index >= limit:
                return
            refusals.line = line
            where = (index, offset, len(raw), xxhash.xxh3_64_intdigest(raw))
            item = self.maker.make(raw, where, line, self.tokenizer, refusals)  # type: ignore[arg-type]
            if item is not None:
                counts.made += 1
                on_item(item, line)

        work_dir = tempfile.mkdtemp(prefix="pipeline-analyze-")
        try:
            scan = scan_input(self.path, os.path.join(work_dir, "scan"), None, on_request=on_request)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
        counts.requests, counts.input_bytes = scan.requests, scan.input_bytes
        return counts


def _maker(path: str, model_dir: str, served_model: str, runner: str, chat_template: str | None,
           limits: PromptLimits) -> JobWorkload:
    """A job's workload that only makes items (`JobWorkload.make`): no data directory, no
    index, nothing to skip; its manifest says what the job would serve."""
    manifest = JobManifest(job_id=0, created_s=0, input_path=path, input_bytes=0, input_xxh3="", requests=0,
                           served_model=served_model, output_path="", output_order="input", error_file=None,
                           runner=runner)
    nothing = JobInput(path, 0, np.zeros(0, dtype=INDEX_ENTRY_DTYPE), "")
    return JobWorkload(nothing, np.zeros(0, dtype=np.uint8), manifest, model_dir, "", limits, chat_template)
