"""What goes into one vLLM request and comes out of it, besides the engine's bookkeeping
(`vllm.py`): a structured-output constraint's arguments, a sample's log probabilities, and
an item to embed's pooling requests and their embeddings, a LoRA adapter's request. Nothing here imports vLLM at
import time.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pipeline.consumer.engines.base import TokenLogprobs, embedding_inputs
from pipeline.wire.generation import LORA_FIRST_MODEL, GenerationParams

# vLLM's floor of a log probability in its answers (-inf is not JSON).
MIN_LOGPROB = -9999.0


def logprobs_of(found: Any) -> list[TokenLogprobs] | None:
    """A completion's sample logprobs as (token id, log probability, decoded token) per
    position, in vLLM's order (the sampled token first); None where none were asked for."""
    if found is None:
        return None
    out = []
    for position in found:
        out.append([(int(token), _floor(lp.logprob), lp.decoded_token if isinstance(lp.decoded_token, str) else None)
                    for token, lp in (position or {}).items()])
    return out


def _floor(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB) if logprob == logprob else MIN_LOGPROB  # NaN: the floor


def structured_args(kind: str, spec: str) -> dict[str, Any]:
    """StructuredOutputsParams' arguments of an envelope's constraint (generation.py)."""
    if kind == "json_object":
        return {"json_object": True}
    if kind in ("json", "choice"):
        return {kind: json.loads(spec)}
    return {kind: spec}


def pooling_requests(key: int, i: int, prompt: np.ndarray, params: GenerationParams) -> list[tuple[str, Any, Any]]:
    """An item to embed's vLLM requests, one per input: (request id "key.i.j", its prompt,
    vLLM's PoolingParams of the "embed" task with the item's dimensions); ValueError where
    its input lengths are not its prompt's."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    return [(f"{key}.{i}.{j}", TokensPrompt(prompt_token_ids=part.tolist()),
             PoolingParams(task="embed", dimensions=params.dimensions))
            for j, part in enumerate(embedding_inputs(prompt, params))]


def part_of(request_id: str) -> int:
    """The input an embedding request (`pooling_requests`) is of."""
    return int(request_id.rsplit(".", 2)[2])


def embedding_of(output: Any) -> np.ndarray:
    """A pooling request's embedding as float32 values, off the device."""
    return output.outputs.data.detach().float().cpu().numpy().astype(np.float32, copy=False)


def lora_request(modules: list[dict[str, str]], model: int) -> Any:
    """vLLM's LoRARequest of the adapter serving model id `model` (its id the model id), or
    None for the base model; ValueError for a model id no adapter serves."""
    if model < LORA_FIRST_MODEL:
        return None
    k = model - LORA_FIRST_MODEL
    if k >= len(modules):
        raise ValueError(f"model id {model} names LoRA adapter {k}, and the engine has {len(modules)} "
                         f"(lora_modules)")
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=modules[k]["name"], lora_int_id=model, lora_path=modules[k]["path"])
