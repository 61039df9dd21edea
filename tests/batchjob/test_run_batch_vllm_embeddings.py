"""An embeddings job through `pipeline run-batch --engine vllm --runner pooling` on vLLM's CPU
build with the tiny model (marked `vllm`): every embedding equal, within float tolerance, to
what vLLM's own `LLM.embed` returns for the same inputs (the same dummy weights: vLLM seeds
them), with the inputs' token counts as usage. The tiny model is a decoder (LlamaForCausalLM):
vLLM's pooling runner converts it to an embedding model (last-token pooling, normalized)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.jobs import ROOT, build_model, embedding, rows_by_id, write_requests

RUN_TIMEOUT_S = 600
# vLLM's CPU attention takes blocks of a multiple of 32 tokens for a pooling model.
ENGINE_FLAGS = ("--load-format", "dummy", "--max-model-len", "2K", "--kv-cache-memory-bytes", "8M",
                "--block-size", "32")
# fp16 weights (vLLM's dtype auto on the CPU build) in batches of another composition than
# LLM.embed's: the same vectors to a few units of fp16's last place.
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_model(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.mark.vllm
def test_an_embeddings_job_on_vllm_equals_vllms_own_embed(tmp_path, model_dir, monkeypatch):
    texts = ["The quick brown fox", "def main():\n    return 0\n" * 6, "A third passage, of another length."]
    ids = [[5, 6, 7, 8, 9], list(range(100, 170))]
    records = [embedding("texts", texts), embedding("ids", ids), embedding("one", texts[0], encoding_format="base64"),
               embedding("shared", [texts[1], texts[1] + "more"])]
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "-i",
                           str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model",
                           str(model_dir), "--served-model-name", "tiny-llama", "--engine", "vllm", "--runner",
                           "pooling", *ENGINE_FLAGS],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = rows_by_id(out)
    assert {row["response"]["status_code"] for row in rows.values()} == {200}, rows
    ours = {name: [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
                   else np.array(d["embedding"], dtype=np.float32) for d in row["response"]["body"]["data"]]
            for name, row in rows.items()}
    assert not np.allclose(ours["texts"][0], ours["texts"][2], atol=TOLERANCE)  # inputs apart, answers apart

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=str(model_dir), load_format="dummy", runner="pooling", max_model_len=2048,
                   kv_cache_memory_bytes=8 << 20, block_size=32)
    asked = {"texts": texts, "ids": [TokensPrompt(prompt_token_ids=i) for i in ids], "one": [texts[0]],
             "shared": [texts[1], texts[1] + "more"]}
    for name, prompts in asked.items():
        theirs = llm.embed(prompts, use_tqdm=False)
        assert len(ours[name]) == len(theirs), name
        for mine, their in zip(ours[name], theirs):
            expected = np.array(their.outputs.embedding, dtype=np.float32)
            assert mine.shape == expected.shape and np.allclose(mine, expected, atol=TOLERANCE), name
        usage = rows[name]["response"]["body"]["usage"]
        assert usage["prompt_tokens"] == usage["total_tokens"] == sum(len(t.prompt_token_ids) for t in theirs)
