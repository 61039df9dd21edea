"""A batch file's /v1/embeddings requests, and which endpoints a job's engine serves.

    {"custom_id": "doc-17", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "e5", "input": ["first passage", "second passage"],
              "encoding_format": "float"}}

The body is OpenAI's embeddings request as vLLM's server takes it: `input` one string, a
list of strings, one list of token ids or a list of them (at most MAX_EMBEDDING_INPUTS);
`encoding_format` "float" (the default) or "base64" (little-endian float32, as vLLM encodes
it); `dimensions` only for a model that supports Matryoshka embeddings, refused otherwise
with vLLM's message; `user` ignored. The answer (`output.embedding_line`) is OpenAI's list
of embeddings, one per input in order, with usage.

One request is one item: its inputs' token ids back to back, their lengths in the item's
envelope (`GenerationParams.input_lengths`), each input embedded on its own by the engine.
NOTE: an item per input was rejected: the inputs of one request land in different length
lanes and may be dispatched a whole job apart, so answering them in one line would need a
store of partial answers outside the answer log, kept across restarts, growing with the
requests in that state. A request's inputs are what its client batched together; the
broker's lanes still group requests by their length.

Which endpoints a job serves (`job_runner`) follows vLLM: an engine either generates or
pools, by `--runner` (vLLM's flag: auto, generate, pooling); auto takes the model's
architecture as vLLM does (a sentence-transformers model, or an architecture named like a
pooling model: pooling; else generate). A request to an endpoint the runner does not serve
is answered 400 with vLLM's run-batch message ("Model does not support endpoint: URL"), as
`vllm run-batch` answers it: a file mixing chat and embeddings requests for one model runs
one kind and refuses the other, request by request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.batchjob.modelfiles import read_model_text
from pipeline.batchjob.params import Refused, not_an_integer, whole_number
from pipeline.batchjob.scan import invalid_type, invalid_value, show
from pipeline.producer.signature import INT32_MAX
from pipeline.wire.errors import ModelDirError
from pipeline.wire.generation import MAX_EMBEDDING_INPUTS

EMBEDDINGS_URL = "/v1/embeddings"
KIND_EMBEDDING = "embedding"
# OpenAI's and vLLM's encodings of an embedding in the answer ("bytes" is vLLM's own
# binary response, which a JSON line cannot hold).
ENCODING_FORMATS = ("float", "base64")
# The keys of an embeddings body besides the ignored ones (requests.IGNORED_PARAMS: user...).
EMBEDDING_KEYS = frozenset({"model", "input", "encoding_format", "dimensions"})
RUNNER_AUTO, RUNNER_GENERATE, RUNNER_POOLING = "auto", "generate", "pooling"
RUNNERS = (RUNNER_AUTO, RUNNER_GENERATE, RUNNER_POOLING)
# vLLM's architecture suffixes and the runner each means, in its order (the first match
# wins; `Model` last, so the others take priority).
# NOTE: a copy of vLLM's table (vllm/config/model.py, _SUFFIX_TO_DEFAULTS) rather than
# vLLM's config code: the sim engine runs without vLLM, and vLLM's registry answers for
# every architecture it knows as these suffixes do.
ARCHITECTURE_RUNNERS = (("ForCausalLM", RUNNER_GENERATE), ("ForConditionalGeneration", RUNNER_GENERATE),
                        ("ChatModel", RUNNER_GENERATE), ("LMHeadModel", RUNNER_GENERATE),
                        ("ForTextEncoding", RUNNER_POOLING), ("EmbeddingModel", RUNNER_POOLING),
                        ("ForSequenceClassification", RUNNER_POOLING), ("ForTokenClassification", RUNNER_POOLING),
                        ("ClassificationModel", RUNNER_POOLING),
                        ("ForRewardModeling", RUNNER_POOLING), ("RewardModel", RUNNER_POOLING),
                        ("Model", RUNNER_POOLING))
# A sentence-transformers model's module list: vLLM runs such a model as a pooling model
# whatever its architecture.
SENTENCE_TRANSFORMERS_FILE = "modules.json"
CONFIG_FILE = "config.json"
# A model's config.json is a few KB; 16 MiB bounds a file that is not one.
MAX_CONFIG_BYTES = 16 << 20


@dataclass(slots=True, frozen=True)
class EmbeddingInputs:
    """An embeddings request's inputs (each a text or token ids) and answer's form."""

    inputs: tuple[str | list[int], ...]
    encoding_format: str = "float"
    dimensions: int | None = None


@dataclass(slots=True, frozen=True)
class EmbeddingFacts:
    """What the model says of its embeddings, as vLLM reads its config: the size of one, and
    whether it may be cut (Matryoshka: `is_matryoshka`, or the sizes it may be cut to)."""

    size: int | None = None
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def load(cls, model_dir: str) -> EmbeddingFacts:
        config = _config(model_dir)
        size = config.get("embedding_size", config.get("hidden_size"))
        dims = config.get("matryoshka_dimensions")
        dims = tuple(d for d in dims if isinstance(d, int)) if isinstance(dims, list) else None
        return cls(size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None,
                   bool(dims) or config.get("is_matryoshka") is True, dims or None)

    def check(self, dimensions: int | None, served_model: str) -> None:
        """Refused with vLLM's message where the model cannot give `dimensions`."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise Refused(f"Model {served_model!r} does not support Matryoshka embeddings; dimensions must be unset "
                          f"(received dimensions={dimensions}).", "dimensions")
        if self.size is not None and not 1 <= dimensions <= self.size:
            raise Refused(f"Model {served_model!r} only supports dimensions in range [1, {self.size}], got "
                          f"{dimensions}.", "dimensions")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise Refused(f"Model {served_model!r} only supports Matryoshka dimensions "
                          f"{list(self.matryoshka_dimensions)}, got {dimensions}.", "dimensions")


def embedding_inputs(given: dict[str, Any]) -> EmbeddingInputs:
    """An embeddings body's inputs and answer form (its keys checked by the caller), or
    Refused naming the parameter."""
    form = given.get("encoding_format", "float")
    if not isinstance(form, str):
        raise Refused(invalid_type("encoding_format", "a string", form), "encoding_format")
    if form not in ENCODING_FORMATS:
        raise Refused(invalid_value(form, ENCODING_FORMATS), "encoding_format")
    dimensions = given.get("dimensions")
    if dimensions is not None:
        count = whole_number(dimensions)
        if count is None:
            raise Refused(not_an_integer("dimensions", dimensions), "dimensions")
        if count < 1:
            raise Refused(f"dimensions must be at least 1, got {count}.", "dimensions")
        dimensions = count
    return EmbeddingInputs(_inputs(given.get("input")), form, dimensions)


def _inputs(raw: object) -> tuple[str | list[int], ...]:
    if raw is None:
        raise Refused("Missing required parameter: 'input'.", "input")
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list) or not raw:
        raise Refused(f"input must be a string, an array of strings, an array of token ids or an array of arrays "
                      f"of token ids, got {show(raw)}", "input")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raw = [raw]  # one list of token ids: one input
    if len(raw) > MAX_EMBEDDING_INPUTS:
        raise Refused(f"{len(raw):,} inputs: an embeddings request takes at most {MAX_EMBEDDING_INPUTS:,} (split it "
                      f"into several requests)", "input")
    out: list[str | list[int]] = []
    for k, one in enumerate(raw):
        if isinstance(one, str):
            out.append(one)
            continue
        if not isinstance(one, list) or not one:
            raise Refused(f"input[{k}] must be a string or a non-empty array of token ids, got {show(one)}", "input")
        for token in one:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
                raise Refused(f"input[{k}] holds {show(token)}, not a token id (an integer from 0 to {INT32_MAX})",
                              "input")
        out.append(list(one))
    return tuple(out)


def job_runner(engine_options: dict[str, Any], model_dir: str) -> str:
    """RUNNER_GENERATE or RUNNER_POOLING: what the job's engine does (module doc)."""
    runner = engine_options.get("runner", RUNNER_AUTO)
    if runner != RUNNER_AUTO:
        return runner
    if (Path(model_dir) / SENTENCE_TRANSFORMERS_FILE).is_file():
        return RUNNER_POOLING
    architectures = _config(model_dir).get("architectures")
    for arch in architectures if isinstance(architectures, list) else ():
        for suffix, kind in ARCHITECTURE_RUNNERS:
            if isinstance(arch, str) and arch.endswith(suffix):
                return kind
    return RUNNER_GENERATE


def served_by(engine_options: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """What a job's manifest says it serves: its runner, and its LoRA adapters' names in order
    (`--lora-modules`: a request naming adapter k runs on the broker's model k + 1)."""
    return {"runner": job_runner(engine_options, model_dir),
            "adapters": [module["name"] for module in engine_options.get("lora_modules") or ()]}


def endpoint_refusal(url: str, kind: str | None, runner: str) -> str | None:
    """vLLM's run-batch message for a request the job's runner does not serve, or None."""
    if kind is None or (kind == KIND_EMBEDDING) == (runner == RUNNER_POOLING):
        return None
    return f"Model does not support endpoint: {url}"


def _config(model_dir: str) -> dict[str, Any]:
    try:
        config = json.loads(read_model_text(Path(model_dir) / CONFIG_FILE, MAX_CONFIG_BYTES, CONFIG_FILE))
    except (ModelDirError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
