"""A LoRA adapter through `pipeline run-batch --engine vllm --lora-modules` on vLLM's CPU build
with the tiny model (marked `vllm`): an adapter made at test time (PEFT's files written
directly: adapter_config.json and adapter_model.safetensors with random A and B matrices for
q_proj and v_proj), a greedy answer on it that differs from the base model's, and both equal
to what vLLM's own `LLM.generate` answers with and without the adapter's LoRARequest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.jobs import ROOT, build_model, completion, rows_by_id, write_requests

RUN_TIMEOUT_S = 900
RANK = 8
# B's scale: large enough that the adapter moves the tiny model's dummy weights' greedy answer
# (PEFT initialises B at zero: an adapter that changes nothing).
B_STD = 50.0
PROMPT = [1, 50, 60, 70, 80, 90]
ENGINE_FLAGS = ("--load-format", "dummy", "--max-model-len", "2K", "--kv-cache-memory-bytes", "8M", "--dtype",
                "float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_model(tmp_path_factory.mktemp("model") / "tiny-llama"))


def make_adapter(path: Path, base: Path) -> Path:
    """A PEFT LoRA adapter of the tiny model: rank RANK on every layer's q_proj and v_proj."""
    from safetensors.numpy import save_file

    from tools.tiny_llama import HEAD_DIM, HIDDEN_SIZE, NUM_KV_HEADS, NUM_LAYERS

    path.mkdir()
    rng = np.random.default_rng(7)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module, out in (("q_proj", HIDDEN_SIZE), ("v_proj", NUM_KV_HEADS * HEAD_DIM)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 1, (RANK, HIDDEN_SIZE)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, B_STD, (out, RANK)).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False,
        "base_model_name_or_path": str(base)}))
    return path


@pytest.mark.vllm
def test_an_adapters_greedy_answer_differs_from_the_base_models_as_vllms_own(tmp_path, model_dir, monkeypatch):
    adapter = make_adapter(tmp_path / "adapter", model_dir)
    records = [completion("base", PROMPT, temperature=0, max_tokens=8, model="tiny-llama"),
               completion("tuned", PROMPT, temperature=0, max_tokens=8, model="tuned")]
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "-i",
                           str(write_requests(tmp_path / "r.jsonl", records)), "-o", str(out), "--model",
                           str(model_dir), "--served-model-name", "tiny-llama", "--engine", "vllm", "--consumers", "2",
                           "--lora-modules", f"tuned={adapter}", *ENGINE_FLAGS],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = rows_by_id(out)
    bodies = {name: row["response"]["body"] for name, row in rows.items()}
    assert {row["response"]["status_code"] for row in rows.values()} == {200}, bodies
    assert (bodies["base"]["model"], bodies["tuned"]["model"]) == ("tiny-llama", "tuned")
    ours = {name: body["choices"][0]["text"] for name, body in bodies.items()}
    assert ours["base"] != ours["tuned"]

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = vllm.LLM(model=str(model_dir), load_format="dummy", enable_lora=True, max_model_len=2048,
                   kv_cache_memory_bytes=8 << 20, dtype="float32")
    greedy = SamplingParams(max_tokens=8, temperature=0)
    prompt = [TokensPrompt(prompt_token_ids=PROMPT)]
    theirs = {"base": llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text,
              "tuned": llm.generate(prompt, greedy, lora_request=LoRARequest("tuned", 1, str(adapter)),
                                    use_tqdm=False)[0].outputs[0].text}
    assert ours == theirs
