"""pipeline.batchjob.manifest: a job is pinned to everything its answers depend on; a run that
changes any of it is refused naming each change, and a change of resources only is not one."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pipeline.batchjob.manifest import (
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    MODEL_FILES,
    RESOURCE_OPTIONS,
    JobManifest,
    depends_on,
    differences,
    load_manifest,
    manifest_path,
    mismatch_error,
    snapshot_model_files,
    write_manifest,
)
from pipeline.consumer.engines import EngineBatch, SimConfig, make_engine
from pipeline.wire.errors import JobMismatchError, JobPathError

ENGINE_OPTIONS = {"seed": 1, "max_model_len": 2048, "dtype": "float16", "cpu_threads": 4,
                  "gpu_memory_utilization": 0.9}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (path / "config.json").write_text('{"max_position_embeddings": 2048}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    (path / "README.md").write_text("not part of the job")
    return path


def manifest(model_dir: Path, engine: str = "sim", options: dict | None = None, max_input_len: int | None = 1024,
             chat_template: str | None = None, **fields: object) -> JobManifest:
    base = dict(job_id=7, created_s=1_700_000_000, input_path="/jobs/a.jsonl", input_bytes=1000,
                input_xxh3="ab" * 16, requests=10, served_model="tiny", output_path="/jobs/out.jsonl",
                output_order="input", error_file=None,
                depends_on=depends_on(str(model_dir), engine, ENGINE_OPTIONS if options is None else options,
                                      max_input_len, chat_template))
    base.update(fields)
    return JobManifest(**base)


def _rewrite(name: str, text: str) -> Callable[[Path], None]:
    return lambda model: (model / name).write_text(text)


def _grow_weights(model: Path) -> None:
    with open(model / "model.safetensors", "ab") as f:
        f.write(b"\0")


def _touch_weights(model: Path) -> None:
    info = os.stat(model / "model.safetensors")
    os.utime(model / "model.safetensors", ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))


def _directory_for(name: str) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        (model / name).unlink()
        (model / name).mkdir()
    return change


MODEL_CHANGES = [
    ("tokenizer", _rewrite("tokenizer.json", '{"model": {"vocab": {"b": 0}}}'), "model file tokenizer.json: xxh3 "),
    ("template", _rewrite("chat_template.jinja", "{{ messages }}"), "model file chat_template.jinja: xxh3 "),
    ("tokenizer config", _rewrite("tokenizer_config.json", "{}"), "model file tokenizer_config.json"),
    ("model config", _rewrite("config.json", '{"max_position_embeddings": 4096}'), "model file config.json"),
    ("a model file added", _rewrite("generation_config.json", "{}"),
     "model file generation_config.json: absent then, xxh3 "),
    ("a model file removed", lambda model: (model / "tokenizer_config.json").unlink(),
     "model file tokenizer_config.json: xxh3 "),
    ("a model file made a directory", _directory_for("chat_template.jinja"),
     "model file chat_template.jinja: xxh3 "),
    ("weights' size", _grow_weights, "model weights: xxh3 "),
    ("weights' mtime", _touch_weights, "model weights: xxh3 "),
    ("weights added", lambda model: (model / "extra.bin").write_bytes(b"1"), "model weights: xxh3 "),
    ("weights removed", lambda model: (model / "model.safetensors").unlink(), "then, none now"),
]


@pytest.mark.parametrize(("change", "words"), [(c, w) for _, c, w in MODEL_CHANGES], ids=[n for n, *_ in MODEL_CHANGES])
def test_a_changed_model_directory_is_named(model_dir: Path, change: Callable[[Path], None], words: str) -> None:
    have = manifest(model_dir)
    change(model_dir)
    changed = differences(have, manifest(model_dir))
    assert len(changed) == 1, changed
    assert words in changed[0] and " then, " in changed[0] and changed[0].endswith(" now")


def test_files_of_the_model_directory_that_make_no_answer_are_not_the_jobs(model_dir: Path) -> None:
    have = manifest(model_dir)
    (model_dir / "README.md").write_text("edited")
    (model_dir / "notes.txt").write_text("new")
    assert differences(have, manifest(model_dir)) == []
    assert set(have.depends_on) == {f"model file {name}" for name in MODEL_FILES} | {
        "model weights", "engine", "max input length", "engine option seed", "engine option max_model_len",
        "engine option dtype"}


JOB_CHANGES = [
    ("input", dict(input_bytes=1001, input_xxh3="cd" * 16, input_path="/jobs/b.jsonl"),
     "the input file changed since the job started: it was 1,000 bytes with xxh3 abababababababab... "
     "(/jobs/a.jsonl), it is 1,001 bytes with xxh3 cdcdcdcdcdcdcdcd... (/jobs/b.jsonl)"),
    ("input, same size", dict(input_xxh3="cd" * 16),
     "the input file changed since the job started: it was 1,000 bytes with xxh3 abababababababab... "
     "(/jobs/a.jsonl), it is 1,000 bytes with xxh3 cdcdcdcdcdcdcdcd... (/jobs/a.jsonl)"),
    ("served model", dict(served_model="big"), "served model: 'tiny' then, 'big' now"),
    ("output path", dict(output_path="/elsewhere.jsonl"),
     "output path: '/jobs/out.jsonl' then, '/elsewhere.jsonl' now"),
    ("output order", dict(output_order="completion"), "output order: 'input' then, 'completion' now"),
    ("error file", dict(error_file="/jobs/errors.jsonl"), "error file: None then, '/jobs/errors.jsonl' now"),
    ("engine", dict(engine="vllm"), "engine: sim then, vllm now"),
    ("an answer's option", dict(options={**ENGINE_OPTIONS, "seed": 2}), "engine option seed: 1 then, 2 now"),
    ("an option added", dict(options={**ENGINE_OPTIONS, "quantization": "fp8"}),
     "engine option quantization: absent then, \"fp8\" now"),
    ("an option removed", dict(options={k: v for k, v in ENGINE_OPTIONS.items() if k != "dtype"}),
     "engine option dtype: \"float16\" then, absent now"),
    ("max input length", dict(max_input_len=None), "max input length: 1024 then, None now"),
]


@pytest.mark.parametrize(("fields", "words"), [(f, w) for _, f, w in JOB_CHANGES], ids=[n for n, *_ in JOB_CHANGES])
def test_each_change_of_the_job_is_named(model_dir: Path, fields: dict, words: str) -> None:
    assert differences(manifest(model_dir), manifest(model_dir, **fields)) == [words]


def test_every_change_is_named_at_once(model_dir: Path) -> None:
    have = manifest(model_dir)
    (model_dir / "tokenizer.json").write_text("{}")
    wanted = manifest(model_dir, engine="vllm", served_model="big", input_xxh3="00" * 16)
    changed = differences(have, wanted)
    assert len(changed) == 4
    assert changed[0].startswith("the input file changed") and changed[1].startswith("served model")
    assert [line.split(":")[0] for line in changed[2:]] == ["engine", "model file tokenizer.json"]


@pytest.mark.parametrize("option", sorted(RESOURCE_OPTIONS))
def test_an_option_of_resources_only_is_no_change(model_dir: Path, option: str) -> None:
    have = manifest(model_dir)
    for value in (12345, "elsewhere", None):
        assert differences(have, manifest(model_dir, options={**ENGINE_OPTIONS, option: value})) == []
    assert differences(have, manifest(model_dir, options={k: v for k, v in ENGINE_OPTIONS.items() if k != option})) \
        == []


@pytest.mark.parametrize("option", sorted(RESOURCE_OPTIONS & set(SimConfig.__dataclass_fields__)))
def test_a_sim_option_of_resources_only_changes_no_answer(option: str) -> None:
    """What the resume rule trusts, checked against the sim itself: its answers (tokens and
    finish reasons) are the same whatever the option's value."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1000, n, dtype=np.int32) for n in (7, 40, 130)]
    batch = EngineBatch(prompts, 130, [0, 32, 64])
    default = getattr(SimConfig(), option)
    changed = {int: lambda v: v * 2 + 16, float: lambda v: v + 1e-9}[type(default)](default)
    answers = [make_engine("sim", **({option: value} if value is not None else {})).run(batch)
               for value in (None, changed)]
    assert answers[0].outputs == answers[1].outputs and answers[0].finish_reasons == answers[1].finish_reasons


def test_the_sims_block_size_is_part_of_what_answers_depend_on(model_dir: Path) -> None:
    have = manifest(model_dir, options={**ENGINE_OPTIONS, "block_size_tokens": 16})
    assert differences(have, manifest(model_dir, options={**ENGINE_OPTIONS, "block_size_tokens": 32})) == [
        "engine option block_size_tokens: 16 then, 32 now"]


def test_llm_kwargs_are_judged_one_by_one(model_dir: Path) -> None:
    """vLLM's flags without a VllmOptions field land in llm_kwargs: a resource among them
    (--max-num-seqs) may change on a resume, one that changes answers (--quantization) may not."""
    def options(**kwargs: object) -> dict:
        return {**ENGINE_OPTIONS, "llm_kwargs": kwargs}

    have = manifest(model_dir, options=options(max_num_seqs=8, quantization="fp8"))
    assert differences(have, manifest(model_dir, options=options(max_num_seqs=64, quantization="fp8"))) == []
    assert differences(have, manifest(model_dir, options=options(max_num_seqs=8))) == [
        'engine option llm_kwargs.quantization: "fp8" then, absent now']


def test_vllms_flags_as_typed_are_judged_one_by_one_where_vllm_puts_them(model_dir: Path) -> None:
    """vLLM's flags travel as typed (`vllm_flags`); each is pinned as the option vLLM's parser
    makes of it, so a job started with --dtype pins what the same option given otherwise
    pins, a resource flag may change on a resume, and a spelling of the same flag is no change."""
    def flags(*words: str) -> dict:
        return {**ENGINE_OPTIONS, "vllm_flags": list(words)}

    have = manifest(model_dir, options=flags("--max-num-seqs", "8", "--quantization", "fp8", "--enforce-eager"))
    assert have.depends_on["engine option llm_kwargs.quantization"] == '"fp8"'
    assert "engine option vllm_flags" not in have.depends_on
    same = manifest(model_dir, options=flags("--max_num_seqs=64", "--quantization=fp8", "--no-enforce-eager",
                                             "--gpu-memory-utilization", "0.5"))
    assert differences(have, same) == []
    assert differences(have, manifest(model_dir, options=flags("--max-num-seqs", "8"))) == [
        'engine option llm_kwargs.quantization: "fp8" then, absent now']
    dtype = manifest(model_dir, options={k: v for k, v in flags("--dtype", "bfloat16").items() if k != "dtype"})
    assert dtype.depends_on["engine option dtype"] == \
        manifest(model_dir, options={**ENGINE_OPTIONS, "dtype": "bfloat16"}).depends_on["engine option dtype"]


def test_the_chat_template_flag_counts_by_content(model_dir: Path) -> None:
    have = manifest(model_dir, chat_template="{{ messages }}")
    assert have.depends_on["chat template (--chat-template)"].startswith("xxh3 ")
    assert differences(have, manifest(model_dir, chat_template="{{ messages }}")) == []
    changed = differences(have, manifest(model_dir, chat_template="{{ messages[0] }}"))
    assert len(changed) == 1 and changed[0].startswith("chat template (--chat-template): xxh3 ")
    assert differences(have, manifest(model_dir)) == [
        f"chat template (--chat-template): {have.depends_on['chat template (--chat-template)']} then, absent now"]
    assert "chat template (--chat-template)" not in manifest(model_dir).depends_on  # a job without it resumes


def test_where_the_input_is_and_when_a_run_started_are_no_change(model_dir: Path) -> None:
    have = manifest(model_dir)
    assert differences(have, manifest(model_dir, input_path="/moved/a.jsonl", created_s=1, job_id=9)) == []


def test_the_refusal_names_the_changes_and_what_to_do(model_dir: Path) -> None:
    have = manifest(model_dir)
    changed = [f"change {k}" for k in range(12)]
    error = mismatch_error("/data/job-1", have, changed)
    assert isinstance(error, JobMismatchError)
    text = str(error)
    assert "/data/job-1 holds a job this run would change" in text
    assert "change 9" in text and "change 10" not in text
    assert "run it as it was started" in text and "give another --data-dir" in text
    assert "the 10-request job in /data/job-1 stays as it is" in text


def test_a_long_value_is_shortened_in_a_change(model_dir: Path) -> None:
    changed = differences(manifest(model_dir), manifest(model_dir, options={**ENGINE_OPTIONS, "seed": "x" * 500}))
    assert len(changed) == 1 and len(changed[0]) < 200 and "..." in changed[0]


# --- the manifest file ------------------------------------------------------------------------


def test_a_manifest_is_written_owner_only_and_reads_back(model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert load_manifest(str(data)) is None
    wanted = manifest(model_dir)
    write_manifest(str(data), wanted)
    assert load_manifest(str(data)) == wanted
    assert os.stat(manifest_path(str(data))).st_mode & 0o777 == 0o600
    assert os.stat(data / "job").st_mode & 0o777 == 0o700


def test_new_jobs_have_their_own_ids(model_dir: Path) -> None:
    fields = {k: v for k, v in dataclasses.asdict(manifest(model_dir)).items() if k not in ("job_id", "version")}
    ids = {JobManifest.new(**fields).job_id for _ in range(20)}
    assert len(ids) == 20 and all(0 <= job_id < 1 << 63 for job_id in ids)
    assert JobManifest.new(**fields).id_tag == "ab" * 6


def _written(tmp_path: Path, text: bytes) -> str:
    path = Path(manifest_path(str(tmp_path)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return str(tmp_path)


@pytest.mark.parametrize(("text", "words"), [
    (b"{not json", "not a job manifest of this version"),
    (b"[1, 2]", "not a job manifest of this version"),
    (b'{"version": 1}', f"version 1, this program reads {MANIFEST_VERSION}"),
    (json.dumps({"version": MANIFEST_VERSION, "job_id": 1}).encode(), "not a job manifest of this version"),
    (b"\xff\xfe", "not a job manifest of this version"),
])
def test_a_manifest_that_is_not_ours_is_refused(tmp_path: Path, text: bytes, words: str) -> None:
    with pytest.raises(JobMismatchError, match=words):
        load_manifest(_written(tmp_path, text))


def test_a_manifest_at_the_size_limit_is_read_and_one_byte_more_is_refused(model_dir: Path, tmp_path: Path) -> None:
    raw = json.dumps(dataclasses.asdict(manifest(model_dir))).encode()
    data = _written(tmp_path, raw + b" " * (MAX_MANIFEST_BYTES - len(raw)))
    assert load_manifest(data) == manifest(model_dir)
    data = _written(tmp_path, raw + b" " * (MAX_MANIFEST_BYTES + 1 - len(raw)))
    with pytest.raises(JobMismatchError, match=f"longer than {MAX_MANIFEST_BYTES:,} bytes"):
        load_manifest(data)


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_manifest_that_is_not_a_regular_file_is_refused(model_dir: Path, tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    path = Path(manifest_path(str(data)))
    path.parent.mkdir(parents=True)
    if kind == "symlink":
        real = tmp_path / "real.json"
        real.write_text(json.dumps(dataclasses.asdict(manifest(model_dir))))
        path.symlink_to(real)
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)  # no writer: refused, not waited on
    with pytest.raises(JobMismatchError, match="use another --data-dir"):
        load_manifest(str(data))


def test_each_lora_adapter_is_pinned_by_its_files_contents(tmp_path, model_dir):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\1" * 64)
    options = {"lora_modules": [{"name": "sql", "path": str(adapter)}]}
    before = depends_on(str(model_dir), "vllm", options, 2047)
    assert before["LoRA adapter sql"].startswith("xxh3 ")
    assert depends_on(str(model_dir), "vllm", options, 2047) == before  # read again: the same
    (adapter / "adapter_model.safetensors").write_bytes(b"\2" * 64)  # new weights of the same size and name
    after = depends_on(str(model_dir), "vllm", options, 2047)
    assert after["LoRA adapter sql"] != before["LoRA adapter sql"]
    assert {k: v for k, v in after.items() if k != "LoRA adapter sql"} == \
        {k: v for k, v in before.items() if k != "LoRA adapter sql"}


def test_the_model_directory_and_adapters_are_pinned_by_content_not_by_how_their_path_is_spelled(
        tmp_path, model_dir, monkeypatch):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    monkeypatch.chdir(tmp_path)
    spelled = [str(model_dir), "model", "model/", "./model/../model", str(model_dir) + "/"]
    seen = {json.dumps(depends_on(path, "sim", {"tokenizer": path, "lora_modules": [
        {"name": "sql", "path": str(adapter) if k % 2 else "adapter/"}]}, 2047), sort_keys=True)
        for k, path in enumerate(spelled)}
    assert len(seen) == 1
    moved = tmp_path / "moved"
    os.rename(model_dir, moved)  # the same files elsewhere: the same job
    again = depends_on(str(moved), "sim", {"tokenizer": str(moved), "lora_modules": [
        {"name": "sql", "path": "adapter"}]}, 2047)
    assert json.dumps(again, sort_keys=True) in seen
    other = depends_on(str(moved), "sim", {"tokenizer": str(tmp_path / "elsewhere"), "lora_modules": [
        {"name": "sql", "path": "adapter"}]}, 2047)
    assert other["engine option tokenizer"] != again["engine option tokenizer"]  # another tokenizer: named


def test_the_copy_of_the_models_files_is_made_anew_and_a_file_of_the_users_in_it_stays(tmp_path: Path,
                                                                                      model_dir: Path) -> None:
    into = str(tmp_path / "job" / "model")
    os.makedirs(into)
    assert snapshot_model_files(str(model_dir), into) == into
    assert sorted(os.listdir(into)) == sorted(name for name in MODEL_FILES if (model_dir / name).exists())
    Path(into, "notes.txt").write_text("mine")
    assert snapshot_model_files(str(model_dir), into) == into  # the same bytes: kept as it is
    (model_dir / "tokenizer_config.json").write_text('{"bos_token": "<b>"}')  # another file: made anew
    with pytest.raises(JobPathError, match=r"model holds notes.txt, which the job did not make"):
        snapshot_model_files(str(model_dir), into)
    assert Path(into, "notes.txt").read_text() == "mine"


def test_a_digest_that_lost_its_trailing_zero_bytes_is_read_whole(tmp_path: Path, model_dir: Path) -> None:
    data = tmp_path / "data"
    os.makedirs(data / "job")
    write_manifest(str(data), manifest(model_dir, input_xxh3="ab" * 15))  # a string field dropped a zero byte
    assert load_manifest(str(data)).input_xxh3 == "ab" * 15 + "00"
    write_manifest(str(data), manifest(model_dir, input_xxh3="ab" * 16))
    assert load_manifest(str(data)).input_xxh3 == "ab" * 16  # a whole one as it is
