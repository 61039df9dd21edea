"""What a job's data directory is for, and everything its answers depend on.

    DATA_DIR/job/manifest.json   written once, when the job is created (whole or not at all)
    DATA_DIR/job/model/          the model's files of MODEL_FILES as this run found them

A run copies the model directory's small files into the job (`snapshot_model_files`), and
its producers and answers read the copies: a model directory edited while a job runs (a
template saved, a tokenizer replaced) changes nothing mid-run, a restarted producer included;
the next run compares the new copies with the manifest and refuses if they differ.
NOTE: checking digests at each producer's load was rejected: a file may change between the
check and the load; a copy hashed as it is made cannot.

A job is its input file (by size and xxh3-128 of its bytes), its served model name, and what
turns a request into an answer: the model directory's tokenizer, chat template and configs
(by content), the model's weights (by name, size and modification time: hashing gigabytes at
every start costs more than it guards), the engine and its options that change answers, and
the longest prompt run. A run on a data directory whose manifest disagrees on any of them is
refused, naming what changed and what the user can do: answers made one way are never mixed
with answers made another, and an output line is never decoded with another tokenizer than
the one that made its tokens. Where the output goes (its path, order and error file) is part
of the job too: with `--output-order completion` the output file is the job's answer log.

The job's id (`job_id`, 64 random bits drawn at creation) is in every item's payload
(`layout.py`): an answer is matched to its own request of its own job, never by position.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from dataclasses import asdict, dataclass, field, replace

import xxhash

from pipeline.batchjob.paths import replace_file
from pipeline.batchjob.scan import MAX_BATCH_REQUESTS
from pipeline.batchjob.tools import ToolCalling
from pipeline.runtime.madefiles import Made, named, remove_made
from pipeline.runtime.settings import engine_option_items
from pipeline.wire.errors import JobMismatchError, JobPathError
from pipeline.wire.textfiles import read_small_file

JOB_DIR = "job"
MANIFEST_NAME = "manifest.json"
MODEL_COPY_DIR = "model"
# The next copy is made beside the current one under its name plus this, then renamed over it.
MODEL_COPY_NEW_SUFFIX = ".new"
# The job directory's other files (`job.py`, `scan.py`, `jobstatus.py`).
LOCK_NAME = "lock"
STATUS_NAME = "status.json"
INDEX_NAME = "input.idx"
LINES_NAME = "lines.bin"
SCAN_DIR = "scan"
# What a producer that read a changed line leaves (its message), read by `jobstatus.py`.
INPUT_CHANGED_NAME = "input-changed"
MANIFEST_VERSION = 2
# The manifest is small: anything longer is not ours.
MAX_MANIFEST_BYTES = 1 << 20
# An input's digest in a manifest: xxh3-128 in hex.
INPUT_DIGEST_HEX_CHARS = 32
# Files of a model directory that make its prompts and answers (read by content: all are
# small but the tokenizer, whose 2-35 MB hash in milliseconds).
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
               "generation_config.json", "special_tokens_map.json")
# A model's weights, known by name, size and mtime: a new checkpoint in place changes them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# What the job's copy of the model holds: copies of MODEL_FILES, nothing else.
MODEL_COPY_MADE = Made(files=named(*MODEL_FILES))
# Engine options that change how fast or where a job runs, never what it answers: a resume
# may change them (more GPU memory, another cache directory, the sim's cost model, more GPUs
# per engine: tensor parallel reorders sums as another batch's composition does). Not the
# sim's block size: its made-up answers come from its block hashes.
RESOURCE_OPTIONS = frozenset({"cpu_threads", "cache_dir", "gpu_memory_utilization", "kv_cache_memory_bytes",
                              "enforce_eager", "cost_s_per_padded_token", "cost_s_per_batch", "capacity_tokens",
                              "block_size", "tensor_parallel_size", "pipeline_parallel_size", "in_process",
                              *(f"llm_kwargs.{key}" for key in ("max_num_seqs", "max_num_batched_tokens", "swap_space",
                                                                "cpu_offload_gb", "distributed_executor_backend"))})
# Bytes of a model file hashed at a time.
HASH_CHUNK_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class JobManifest:
    job_id: int
    created_s: int  # Unix time of the job's first run: every response's `created`
    input_path: str
    input_bytes: int
    input_xxh3: str
    requests: int
    served_model: str
    output_path: str
    output_order: str
    error_file: str | None
    depends_on: dict[str, str] = field(default_factory=dict)
    version: int = MANIFEST_VERSION
    # vLLM's --tool-call-parser and --enable-auto-tool-choice: how tool calls are read
    # (absent in the manifests of jobs made before them: no parser).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # What the engine does, generate or pool (`embeddings.job_runner`): which endpoints the
    # job answers (absent in manifests of jobs made before embeddings: generate).
    runner: str = "generate"
    # vLLM's --lora-modules names, in order: a request whose model names adapter k runs on
    # the broker's model k + 1 (absent in manifests of jobs made before adapters: none).
    adapters: list[str] = field(default_factory=list)

    @classmethod
    def new(cls, **fields) -> JobManifest:
        return cls(job_id=secrets.randbits(63), **fields)

    @property
    def log_mark(self) -> bytes:
        """What the job's completion-order logs carry (`outfiles.LOG_MARK_XATTR`): its id."""
        return f"{self.job_id:016x}".encode()

    @property
    def tool_calling(self) -> ToolCalling:
        return ToolCalling(self.tool_call_parser, self.enable_auto_tool_choice)

    @property
    def id_tag(self) -> str:
        """What makes the job's output ids (`batch_req_<tag>_<index>`): its input's digest."""
        return self.input_xxh3[:12]


def manifest_path(data_dir: str) -> str:
    return os.path.join(data_dir, JOB_DIR, MANIFEST_NAME)


def load_manifest(data_dir: str) -> JobManifest | None:
    """The data directory's job manifest; None where there is none; JobMismatchError for
    one that is not ours (unreadable, another version)."""
    path = manifest_path(data_dir)
    try:
        raw = read_small_file(path, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise JobMismatchError(f"{path}: cannot read the job manifest ({exc.strerror}); use another "
                               f"--data-dir") from exc
    if raw is None:
        return None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise JobMismatchError(f"{path}: longer than {MAX_MANIFEST_BYTES:,} bytes, not a job manifest; use another "
                               f"--data-dir")
    try:
        fields = json.loads(raw)
        if fields.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {fields.get('version')!r}, this program reads {MANIFEST_VERSION}")
        return _checked(JobManifest(**fields))
    except JobMismatchError as exc:
        raise JobMismatchError(f"{path}: damaged ({exc}); use another --data-dir") from None
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise JobMismatchError(f"{path}: not a job manifest of this version ({exc}); finish that job with the "
                               f"version that started it, or use another --data-dir") from None


def _checked(manifest: JobManifest) -> JobManifest:
    """The manifest, if its numbers and texts are of their types (a damaged file's are not)."""
    for name in ("job_id", "created_s", "input_bytes", "requests"):
        value = getattr(manifest, name)
        most = MAX_BATCH_REQUESTS if name == "requests" else (1 << 64) - 1
        if type(value) is not int or not (1 if name == "requests" else 0) <= value <= most:
            raise JobMismatchError(f"{name} {value!r:.40} is not a {'request count' if name == 'requests' else 'whole'}"
                                   f" number")
    for name in ("input_path", "input_xxh3", "served_model", "output_path", "output_order"):
        if not isinstance(getattr(manifest, name), str):
            raise JobMismatchError(f"{name} {getattr(manifest, name)!r:.40} is not a string")
    if not isinstance(manifest.depends_on, dict):
        raise JobMismatchError(f"depends_on {manifest.depends_on!r:.40} is not an object")
    if 0 < len(manifest.input_xxh3) < INPUT_DIGEST_HEX_CHARS and not len(manifest.input_xxh3) % 2:
        # An index kept as a string lost its digest's trailing zero bytes, and a job made from
        # it kept the shortened digest: those bytes were zeros, so they are put back.
        manifest = replace(manifest, input_xxh3=manifest.input_xxh3.ljust(INPUT_DIGEST_HEX_CHARS, "0"))
    return manifest


def write_manifest(data_dir: str, manifest: JobManifest) -> None:
    """Write a new job's manifest, whole or not at all."""
    path = manifest_path(data_dir)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    replace_file(path, [json.dumps(asdict(manifest), indent=1).encode() + b"\n"])


def differences(have: JobManifest, wanted: JobManifest) -> list[str]:
    """What `wanted` (this run) changes of the job `have` describes, in words; empty when
    this run may finish that job."""
    changed = []
    if (have.input_bytes, have.input_xxh3) != (wanted.input_bytes, wanted.input_xxh3):
        changed.append(f"the input file changed since the job started: it was {have.input_bytes:,} bytes with xxh3 "
                       f"{have.input_xxh3[:16]}... ({have.input_path}), it is {wanted.input_bytes:,} bytes with "
                       f"xxh3 {wanted.input_xxh3[:16]}... ({wanted.input_path})")
    for name in ("served_model", "output_path", "output_order", "error_file", "tool_call_parser",
                 "enable_auto_tool_choice"):
        if getattr(have, name) != getattr(wanted, name):
            changed.append(f"{name.replace('_', ' ')}: {getattr(have, name)!r} then, {getattr(wanted, name)!r} now")
    for key in sorted(set(have.depends_on) | set(wanted.depends_on)):
        was, now = have.depends_on.get(key, "absent"), wanted.depends_on.get(key, "absent")
        if was != now:
            changed.append(f"{key}: {_short(was)} then, {_short(now)} now")
    return changed


def mismatch_error(data_dir: str, have: JobManifest, changed: list[str]) -> JobMismatchError:
    """The refusal of a run that would change a job: what changed and what to do."""
    lines = "\n  ".join(changed[:10])
    return JobMismatchError(
        f"{data_dir} holds a job this run would change, so its answers would not all be made the same way:\n  "
        f"{lines}\nTo finish that job, run it as it was started (the same input, model directory, engine options "
        f"and output); to run this one from the start instead, give another --data-dir (the {have.requests:,}-"
        f"request job in {data_dir} stays as it is).")


def _short(value: str) -> str:
    return value if len(value) <= 70 else value[:67] + "..."


def depends_on(model_dir: str, engine: str, engine_options: dict[str, object], max_input_len: int | None,
               chat_template: str | None = None, files_dir: str | None = None) -> dict[str, str]:
    """Everything a job's answers depend on besides its input, as name -> digest or value
    (`chat_template`: --chat-template's text, by content; named only where given, so a job
    started without it resumes without it; `files_dir`: where the model's files are read,
    the job's copies of them, else `model_dir`)."""
    found: dict[str, str] = {}
    for name in MODEL_FILES:
        found[f"model file {name}"] = _file_digest(os.path.join(files_dir or model_dir, name))
    if chat_template is not None:
        found["chat template (--chat-template)"] = "xxh3 " + xxhash.xxh3_128_hexdigest(chat_template.encode("utf-8"))
    found["model weights"] = _weights_digest(model_dir)
    found["engine"] = engine
    for key, value in sorted(engine_option_items(engine_options).items()):
        if key not in RESOURCE_OPTIONS:
            found[f"engine option {key}"] = json.dumps(_by_content(value, model_dir), sort_keys=True, default=str)
    found["max input length"] = str(max_input_len)
    for module in engine_options.get("lora_modules") or ():  # type: ignore[union-attr]
        found[f"LoRA adapter {module['name']}"] = _adapter_digest(module["path"])
    return found


# What an engine option naming the model directory is recorded as: the directory's files are
# pinned by digest, so where it is and how its path is spelled change no answer.
MODEL_DIR_VALUE = "the model directory"


def _by_content(value: object, model_dir: str) -> object:
    """An option's value as answers depend on it: a path of the model directory (the sim's
    tokenizer, vLLM's model) as MODEL_DIR_VALUE, adapters without their paths (each adapter
    is pinned by digest, "LoRA adapter NAME")."""
    if isinstance(value, str) and value and os.path.realpath(value) == os.path.realpath(model_dir):
        return MODEL_DIR_VALUE
    if isinstance(value, list) and all(isinstance(v, dict) and "path" in v for v in value) and value:
        return [{k: v for k, v in module.items() if k != "path"} for module in value]
    return value


def _adapter_digest(path: str) -> str:
    """A LoRA adapter directory's files by name and content (adapters are MBs: read whole)."""
    try:
        names = sorted(e.name for e in os.scandir(path) if e.is_file())
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return "xxh3 " + xxhash.xxh3_128_hexdigest("\n".join(f"{n} {_file_digest(os.path.join(path, n))}"
                                                          for n in names).encode())


def snapshot_model_files(model_dir: str, into: str) -> str:
    """Copies of MODEL_FILES from `model_dir` (links followed: a hub cache links its files)
    made anew in the directory `into` (0700, replaced whole); `into`. A file absent, or not a
    regular file, is not copied (its digest says so, as the original's would). A copy that
    holds the same bytes already (a resume) is kept: a run whose disk is full then writes
    nothing here."""
    if os.path.isdir(into) and all(_copied(os.path.join(model_dir, name)) == _file_digest(os.path.join(into, name))
                                   for name in MODEL_FILES):
        return into
    fresh = into + MODEL_COPY_NEW_SUFFIX
    _clear_model_copy(fresh)
    os.mkdir(fresh, 0o700)
    for name in MODEL_FILES:
        try:
            source = open(os.path.join(model_dir, name), "rb")
        except OSError:
            continue
        with source:
            if not stat.S_ISREG(os.fstat(source.fileno()).st_mode):
                continue
            with open(os.path.join(fresh, name), "xb") as copy:
                os.fchmod(copy.fileno(), 0o600)
                shutil.copyfileobj(source, copy, HASH_CHUNK_BYTES)
    _clear_model_copy(into)
    os.rename(fresh, into)
    return into


def _copied(path: str) -> str:
    """The digest a copy of the model file at `path` has: what is not copied is absent."""
    digest = _file_digest(path)
    return digest if digest.startswith("xxh3 ") else "absent"


def _clear_model_copy(path: str) -> None:
    """Remove a copy of the model's files (`MODEL_COPY_MADE`): JobPathError naming what a
    user put there, which stays."""
    kept = remove_made(path, MODEL_COPY_MADE)
    if kept:
        raise JobPathError(f"{path} holds {', '.join(kept[:5])}, which the job did not make: the job keeps its "
                           f"copies of the model's files there; move them out and run the same command again")


def _file_digest(path: str) -> str:
    """xxh3-128 of a model file's bytes; "absent" for none."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return "not a regular file"
            hasher = xxhash.xxh3_128()
            while chunk := f.read(HASH_CHUNK_BYTES):
                hasher.update(chunk)
            return "xxh3 " + hasher.hexdigest()
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def _weights_digest(model_dir: str) -> str:
    """The weight files' names, sizes and modification times, digested; "none" without any."""
    rows = []
    try:
        entries = sorted(os.scandir(model_dir), key=lambda e: e.name)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    for entry in entries:
        if entry.name.endswith(WEIGHT_SUFFIXES):
            info = entry.stat()
            rows.append(f"{entry.name}:{info.st_size}:{info.st_mtime_ns}")
    return "xxh3 " + xxhash.xxh3_128_hexdigest("\n".join(rows).encode("utf-8", "surrogateescape")) if rows else "none"
