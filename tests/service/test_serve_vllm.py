"""`pipeline serve --engine vllm` on the tiny model (marked `vllm`), with the official
`openai` client: one batch end to end on the server's node with a real engine, each answer
vLLM's, and the requests that share a system prompt served from vLLM's prefix cache."""

from __future__ import annotations

import pytest

from tests.support.service import Server, ended, one_line_per_request, requests_file, upload, wait_batch
from tests.support.tiny_vllm import MODEL_DIR

openai = pytest.importorskip("openai")

# The node's engine starting on 2 busy cores (an engine core and a worker: 1 to 3 minutes),
# then the batch.
BATCH_TIMEOUT_S = 900
REQUESTS = 24
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8


@pytest.mark.vllm
def test_one_batch_end_to_end_on_vllm(tmp_path):
    from tools.tiny_llama import build

    build(MODEL_DIR)
    server = Server(tmp_path, str(MODEL_DIR), "--engine", "vllm", "--served-model-name", "tiny-llama",
                    "--load-format", "dummy", "--max-model-len", "2K", "--kv-cache-memory-bytes", "8M",
                    "--max-num-seqs", "16").start()
    try:
        client = server.client()
        records = [{"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny-llama", "max_tokens": 4, "temperature": 0,
                             "messages": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": f"question {k}"}]}}
                   for k in range(REQUESTS)]
        source = upload(client, requests_file(tmp_path / "in.jsonl", records))
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        done = wait_batch(client, batch.id, ended, "the batch to end", timeout_s=BATCH_TIMEOUT_S)
        assert done.status == "completed", server.log()[-5000:]
        assert (done.request_counts.completed, done.request_counts.failed) == (REQUESTS, 0)
        output, errors = one_line_per_request(client, done, records)
        assert errors == []
        bodies = [row["response"]["body"] for row in output]
        assert {row["response"]["status_code"] for row in output} == {200}
        assert all(isinstance(b["choices"][0]["message"]["content"], str) for b in bodies)
        assert all(0 < b["usage"]["completion_tokens"] <= 4 for b in bodies)
        cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
        assert cached > 0 and done.usage.input_tokens_details.cached_tokens == cached
    finally:
        server.close()
