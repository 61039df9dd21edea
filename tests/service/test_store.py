"""The service's records on disk: an upload checked by run-batch's rules, the tenants' limits
at and past them, another tenant's object missing, what a kill leaves between a content and
its record, and the scan an upload keeps for its batches' jobs."""

from __future__ import annotations

import io
import json
import os

import pytest

from pipeline.service.objects import BatchCreate
from pipeline.service.store import Store
from pipeline.wire.errors import ApiError, DataDirError

NOW = 1_000_000
BIG = 1 << 30


def batch_file(count: int, url: str = "/v1/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": url, "body": {}}) + "\n"
                   for k in range(count)).encode()


def put(store: Store, data: bytes, owner: str = "a", quota: int = BIG, max_bytes: int = BIG):
    return store.upload(owner, "in.jsonl", io.BytesIO(data), len(data), max_bytes, quota, NOW)


@pytest.fixture
def store(tmp_path):
    opened = Store.open(str(tmp_path / "d"))
    yield opened
    opened.close()


def test_an_upload_keeps_what_listing_and_batches_need(store):
    record = put(store, batch_file(3))
    assert (record.requests, record.urls, record.bytes) == (3, ["/v1/completions"], len(batch_file(3)))
    assert len(record.digest) == 32  # xxh3-128, hex: the job's id tag is its start
    with open(store.content_path(record.id), "rb") as f:
        assert f.read() == batch_file(3)
    assert os.stat(store.content_path(record.id)).st_mode & 0o777 == 0o600


def test_a_bad_file_is_refused_naming_its_lines_by_the_uploads_name(store):
    with pytest.raises(ApiError) as refused:
        put(store, batch_file(1) + b"{}\n")
    assert refused.value.status == 400 and "in.jsonl:2:" in refused.value.message
    assert store.files == {} and os.listdir(os.path.join(store.data_dir, "uploads")) == []


@pytest.mark.parametrize("extra, ok", [(0, True), (1, False)])
def test_the_upload_size_and_the_tenants_bytes_at_their_limits_and_past_them(store, extra, ok):
    data = batch_file(2)
    if ok:
        put(store, data, max_bytes=len(data))
        put(store, data, quota=2 * len(data))
        return
    with pytest.raises(ApiError) as refused:
        put(store, data, max_bytes=len(data) - extra)
    assert refused.value.status == 413
    put(store, data)
    with pytest.raises(ApiError) as refused:
        put(store, data, quota=2 * len(data) - extra)
    assert refused.value.status == 429 and refused.value.code == "insufficient_quota"
    assert store.stored_bytes["a"] == len(data) and store._reserved_bytes["a"] == 0


@pytest.mark.parametrize("active, ok", [(2, True), (3, False)])
def test_a_tenants_active_batches_at_the_limit_and_past_it(store, active, ok):
    source = put(store, batch_file(1))
    create = BatchCreate(source.id, "/v1/completions", None)
    for _ in range(active - 1):
        store.create_batch("a", create, "m", 60, 2, NOW)
    if ok:
        store.create_batch("a", create, "m", 60, 2, NOW)
    else:
        with pytest.raises(ApiError) as refused:
            store.create_batch("a", create, "m", 60, 2, NOW)
        assert refused.value.status == 429


def test_another_tenants_objects_are_missing_and_an_input_in_use_stays(store):
    source = put(store, batch_file(1))
    batch = store.create_batch("a", BatchCreate(source.id, "/v1/completions", None), "m", 60, 5, NOW)
    for call in (lambda: store.file("b", source.id), lambda: store.batch("b", batch.id),
                 lambda: store.delete_file("b", source.id),
                 lambda: store.create_batch("b", BatchCreate(source.id, "/v1/completions", None), "m", 60, 5, NOW)):
        with pytest.raises(ApiError) as refused:
            call()
        assert refused.value.status == 404
    assert refused.value.param == "input_file_id"  # the create's own field, not the path's
    assert store.list_files("b", None, ascending=False) == [] and store.list_batches("b") == []
    with pytest.raises(ApiError, match="cancel it first"):
        store.delete_file("a", source.id)


def test_files_made_within_one_second_list_in_the_order_they_were_made_across_a_restart(store):
    made = [put(store, batch_file(1)).id for _ in range(6)]  # one second (NOW) for all: ids are random
    with open(store.content_path("file-out"), "wb"):  # an output's content is in place before its record
        pass
    made.append(store.add_output("a", "batch_x", "file-out", "out.jsonl", 0, NOW).id)
    assert [f.id for f in store.list_files("a", None, ascending=True)] == made
    assert [f.id for f in store.list_files("a", None, ascending=False)] == made[::-1]
    store.close()
    again = Store.open(store.data_dir)
    try:
        assert [f.id for f in again.list_files("a", None, ascending=True)] == made
        assert put(again, batch_file(1)).id == again.list_files("a", None, ascending=False)[0].id  # after the rest
    finally:
        again.close()


def test_a_restart_has_every_record_and_drops_a_content_without_one(tmp_path, store):
    source = put(store, batch_file(2))
    batch = store.create_batch("a", BatchCreate(source.id, "/v1/completions", {"k": "v"}), "m", 60, 5, NOW)
    orphan = store.content_path("file-orphan")
    with open(orphan, "wb") as f:
        f.write(b"renamed in, its record never written\n")
    store.close()
    again = Store.open(store.data_dir)
    try:
        assert again.file("a", source.id) == source and again.batch("a", batch.id) == batch
        assert not os.path.exists(orphan)
        assert again.stored_bytes == {"a": source.bytes}
        assert again.kept_scan(source.id) is not None
    finally:
        again.close()


def test_an_upload_keeps_its_scan_and_a_delete_removes_it(store):
    source = put(store, batch_file(3))
    prefix = store.kept_scan(source.id)
    assert prefix is not None
    assert {os.stat(prefix + suffix).st_mode & 0o777 for suffix in (".index", ".lines")} == {0o600}
    assert os.path.getsize(prefix + ".lines") == 3 * 8  # a digest a request
    store.delete_file("a", source.id)
    assert store.kept_scan(source.id) is None
    assert sorted(os.listdir(os.path.join(store.data_dir, "files"))) == []


def test_a_restart_drops_a_kept_scan_without_its_record(store):
    source = put(store, batch_file(2))
    prefix = store.kept_scan(source.id)
    os.unlink(os.path.join(store.data_dir, "files", source.id + ".json"))  # as if killed before the record
    os.unlink(store.content_path(source.id))
    store.close()
    again = Store.open(store.data_dir)
    try:
        assert again.files == {} and not os.path.exists(prefix + ".index") and not os.path.exists(prefix + ".lines")
    finally:
        again.close()


def test_a_damaged_record_and_a_foreign_folder_are_refused(tmp_path, store):
    source = put(store, batch_file(1))
    store.close()
    with open(os.path.join(store.data_dir, "files", source.id + ".json"), "w") as f:
        f.write("{")
    with pytest.raises(DataDirError, match="damaged record"):
        Store.open(store.data_dir)
    os.makedirs(tmp_path / "other" / "mine")
    with pytest.raises(DataDirError, match="mine"):
        Store.open(str(tmp_path / "other"))


def test_a_file_record_whose_sequence_is_not_a_whole_number_is_refused_by_name(tmp_path, store):
    source = put(store, batch_file(1))
    store.close()
    path = os.path.join(store.data_dir, "files", source.id + ".json")
    with open(path) as f:
        record = json.load(f)
    record["seq"] = "7"
    with open(path, "w") as f:
        json.dump(record, f)
    with pytest.raises(DataDirError, match=source.id):
        Store.open(store.data_dir)
