"""A batch job as a workload: its requests made into items in the producer processes.

The launcher forks its producers with the workload; each producer takes a round-robin share
of the requests to submit and makes their items itself: it loads the model directory's
tokenizer once (in its own process: a tokenizer is the producer's business, and the broker
never sees text), renders each chat request through the chat template, tokenizes it, and
cuts the prompt into its shape's components (`chat.py`). A request whose prompt cannot be
made (the template refused the conversation) is written to the producer's rejection log
(`job.py`) and answered with an error line at the end; every other one becomes one item
whose payload is its request index, with its generation parameters.

    workload = JobWorkload(batch_file, indices=[0, 2, 5], model_dir="/models/x", data_dir=data)
    len(workload)  # 3: what the producers will submit
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np

from pipeline.batchjob.chat import ChatTokenizer
from pipeline.batchjob.job import RejectionLog, request_payload
from pipeline.batchjob.requests import BatchFile, BatchRequest
from pipeline.producer.workload import WorkItem, Workload
from pipeline.wire.errors import BadInputError

# The one model id a job's items use (a job runs one served model).
JOB_MODEL = 0


class JobWorkload(Workload):
    """The requests of `batch_file` named by `indices`, made into items on demand.

    Owner: the job runner; the producer processes each iterate their share (fork-shared,
    read-only: each makes its own tokenizer and rejection log). `total_tokens` is 0: tokens
    are known only once the producers have tokenized."""

    def __init__(self, batch_file: BatchFile, indices: Sequence[int], model_dir: str, data_dir: str) -> None:
        super().__init__(f"{batch_file.path} (job)", len(indices), self._unused, total_tokens=0, models=(JOB_MODEL,))
        self.batch_file = batch_file
        self.indices = list(indices)
        self.model_dir = model_dir
        self.data_dir = data_dir

    @staticmethod
    def _unused(_k: int) -> WorkItem:
        raise AssertionError("a job's items are made by `items`, with the producer's tokenizer")

    def items(self, producer_index: int = 0, producer_count: int = 1) -> Iterator[WorkItem]:
        """Producer `producer_index`'s share of the requests, made into items in file order;
        rejected requests are logged and left out."""
        if producer_count < 1 or not 0 <= producer_index < producer_count:
            raise ValueError(f"producer {producer_index} of {producer_count}: need 0 <= index < count")
        tokenizer = ChatTokenizer.load(self.model_dir)
        log: RejectionLog | None = None
        try:
            for k in range(producer_index, len(self.indices), producer_count):
                request = self.batch_file.requests[self.indices[k]]
                try:
                    yield make_item(tokenizer, request)
                except BadInputError as exc:
                    if log is None:
                        log = RejectionLog(self.data_dir, f"p{producer_index}-{os.getpid()}")
                    log.reject(request.index, str(exc))
        finally:
            if log is not None:
                log.close()

    def __repr__(self) -> str:
        return f"BatchJob({self.batch_file.path!r}, {len(self.indices)} requests to submit)"


def make_item(tokenizer: ChatTokenizer, request: BatchRequest) -> WorkItem:
    """One request's item: its prompt's components and the rest, its index as the payload,
    its generation parameters. BadInputError where no prompt can be made of it."""
    if request.kind == "chat":
        prompt = tokenizer.chat_prompt(request.messages)
    else:
        prompt = tokenizer.completion_prompt(request.prompt)
    prefix = sum(len(c) for c in prompt.components)
    suffix = np.asarray(prompt.tokens[prefix:], dtype=np.int32)
    if prompt.tokens.shape[0] == 0:
        raise BadInputError(f"request {request.custom_id!r} (line {request.line}): the prompt is empty")
    return WorkItem(model=JOB_MODEL, components=list(prompt.components), suffix=suffix,
                    payload=request_payload(request.index), timestamp_ms=None, line=request.line,
                    params=request.params)
