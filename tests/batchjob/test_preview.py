"""pipeline.batchjob.preview: a batch file's requests as the job's producers make them, in
one pass: the same items a job submits, the requests a producer answers itself counted with
their lines, a file run-batch refuses refused the same way, a limit, progress."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.batchjob import preview as preview_module
from pipeline.batchjob.manifest import JobManifest
from pipeline.batchjob.preview import BatchPreview
from pipeline.batchjob.scan import scan_input
from pipeline.batchjob.workload import JobInput, JobWorkload, PromptLimits
from pipeline.producer.workload import WorkItem
from pipeline.wire.errors import BatchFileError, ModelDirError
from tests.support.jobs import SERVED, build_model, chat, completion, embedding, write_requests

# The tiny model's context (config.json's max_position_embeddings), as run-batch reads it.
TINY_CONTEXT = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("model") / SERVED)


def preview(path: Path, model_dir: str, **run) -> tuple[list[tuple[WorkItem, int]], preview_module.PreviewCounts]:
    made: list[tuple[WorkItem, int]] = []
    counts = BatchPreview(str(path), model_dir).run(lambda item, line: made.append((item, line)), **run)
    return made, counts


def job_items(tmp_path: Path, path: Path, model_dir: str) -> list[WorkItem]:
    """What a job's producers submit for the file (`JobWorkload.items`, run-batch's limits)."""
    scan = scan_input(str(path), str(tmp_path / "scan"), str(tmp_path / "lines.bin"))
    manifest = JobManifest.new(created_s=0, input_path=str(path), input_bytes=scan.input_bytes,
                               input_xxh3=scan.input_xxh3, requests=scan.requests, served_model=SERVED,
                               output_path=str(tmp_path / "out"), output_order="input", error_file=None)
    job_input = JobInput(str(path), scan.requests, scan.index, str(tmp_path / "lines.bin"))
    skip = np.zeros((scan.requests + 7) // 8, dtype=np.uint8)
    limits = PromptLimits(max_prompt_tokens=TINY_CONTEXT - 1, context_tokens=TINY_CONTEXT)
    return list(JobWorkload(job_input, skip, manifest, model_dir, str(tmp_path), limits).items())


def test_the_items_are_those_a_job_submits(tmp_path, model_dir):
    records = [chat(f"a{k}", f"question {k}") for k in range(3)]
    records += [chat(f"b{k}", f"question {k}", system="You answer in French, at length.") for k in range(2)]
    records += [chat("c", "no system prompt", system=None), completion("d"), completion("e", [5, 6, 7]),
                chat("f", "a longer one", temperature=0.5, max_tokens=9)]
    path = write_requests(tmp_path / "in.jsonl", records)
    made, counts = preview(path, model_dir)
    expected = job_items(tmp_path, path, model_dir)
    assert (counts.requests, counts.made, counts.refused) == (9, 9, 0) and len(expected) == 9
    assert [line for _, line in made] == list(range(1, 10))
    for (item, _), want in zip(made, expected):
        assert [c.tolist() for c in item.components] == [c.tolist() for c in want.components]
        assert item.suffix.tolist() == want.suffix.tolist()
        assert (item.model, item.signature, item.params) == (want.model, want.signature, want.params)
    assert len({item.signature for item, _ in made[:5]}) == 2  # two system prompts, two shapes


def test_requests_a_producer_answers_itself_are_counted_with_their_lines(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(preview_module, "MAX_EXAMPLES", 2)
    records = [chat("a"), chat("b", model="gpt-4o"), embedding("c"), chat("d"), chat("e", temperature=3)]
    made, counts = preview(write_requests(tmp_path / "in.jsonl", records), model_dir)
    assert [line for _, line in made] == [1, 4]
    assert (counts.requests, counts.made, counts.refused) == (5, 2, 3)
    ((first, model_message), (second, endpoint_message)) = counts.examples
    assert (first, second) == (2, 3)
    assert "The model `gpt-4o` does not exist" in model_message
    assert endpoint_message == "Model does not support endpoint: /v1/embeddings"


def test_the_served_model_and_chat_template_are_run_batchs(tmp_path, model_dir):
    path = write_requests(tmp_path / "in.jsonl", [chat("a", "hi", model="other")])
    made: list[WorkItem] = []
    counts = BatchPreview(str(path), model_dir, served_model="other", chat_template="{{ messages[-1]['content'] }}!"
                          ).run(lambda item, _line: made.append(item))
    assert counts.made == 1
    (item,) = made
    from pipeline.batchjob.chat import ChatTokenizer

    assert item.tokens.tolist() == ChatTokenizer.load(model_dir).encode("hi!", add_special_tokens=False)
    with pytest.raises(ModelDirError, match="--chat-template no-such-file: looks like a file's path"):
        BatchPreview(str(path), model_dir, chat_template="no-such-file")


def test_a_file_run_batch_refuses_is_refused_naming_its_lines(tmp_path, model_dir):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (chat("a"), chat("b"))) + "{not json\n"
                    + json.dumps(chat("a")) + "\n")
    made: list[int] = []
    with pytest.raises(BatchFileError) as error:
        BatchPreview(str(path), model_dir).run(lambda _item, line: made.append(line))
    message = str(error.value)
    assert f"{path}:3: not JSON" in message and f"{path}:4: custom_id 'a' is used by line 1 too" in message
    assert made == [1, 2]  # nothing is made past the first bad line


def test_a_limit_makes_the_first_requests_and_checks_the_whole_file(tmp_path, model_dir):
    path = write_requests(tmp_path / "in.jsonl", [chat(f"r{k}") for k in range(6)])
    made, counts = preview(path, model_dir, limit=2)
    assert [line for _, line in made] == [1, 2] and (counts.requests, counts.made) == (6, 2)
    with open(path, "a") as f:
        f.write("[]\n")
    with pytest.raises(BatchFileError, match=r"in\.jsonl:7: a request must be a JSON object"):
        preview(path, model_dir, limit=2)


def test_progress_is_bytes_read_and_requests(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(preview_module, "PROGRESS_EVERY_REQUESTS", 2)
    path = write_requests(tmp_path / "in.jsonl", [completion(f"r{k}") for k in range(5)])
    calls: list[tuple[int, int]] = []
    preview(path, model_dir, on_progress=lambda read, requests: calls.append((read, requests)))
    line_bytes = len(path.read_text().splitlines()[0]) + 1
    assert calls == [(line_bytes, 2), (3 * line_bytes, 4)]  # the offset of the line being read
