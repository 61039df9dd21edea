"""The batch service's HTTP API: OpenAI's Files and Batches endpoints, as the official
`openai` client calls them, and /health and /metrics.

    POST   /v1/files                      upload (multipart: file, purpose "batch")
    GET    /v1/files[?purpose&limit&order&after]
    GET    /v1/files/{id}                 DELETE /v1/files/{id}       GET /v1/files/{id}/content
    POST   /v1/batches                    {input_file_id, endpoint, completion_window ("24h"), metadata}
    GET    /v1/batches[?after&limit]      GET /v1/batches/{id}        POST /v1/batches/{id}/cancel
    GET    /health                        GET /metrics (Prometheus text)

Every /v1 request is a tenant's (`auth.py`: a Bearer key; without a key file, the one local
tenant); every refusal is OpenAI's error body with its status code (`objects.error_body`),
an unknown route's too. Handlers do the store's blocking work (fsyncs, an upload's scan) in
the server's thread pool; running batches is the scheduler's (`scheduler.py`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.service.auth import DEFAULT_TENANT, Tenants
from pipeline.service.limits import (
    BATCH_LIST_DEFAULT,
    BATCH_LIST_LIMIT_RANGE,
    FILE_LIST_DEFAULT,
    FILE_LIST_LIMIT_RANGE,
    MAX_JSON_BODY_BYTES,
)
from pipeline.service.metrics import ServiceCollector, render
from pipeline.service.objects import (
    HTTP_BAD_REQUEST,
    HTTP_TOO_LARGE,
    HTTP_UNAUTHORIZED,
    UPLOAD_PURPOSES,
    batch_object,
    check_limit,
    error_body,
    file_object,
    list_page,
    parse_batch_create,
    window_seconds,
)
from pipeline.service.scheduler import Scheduler
from pipeline.service.store import Store
from pipeline.wire.errors import ApiError

# Bytes of a multipart upload beyond its file's: the boundaries, headers and purpose field.
MULTIPART_OVERHEAD_BYTES = 64 << 10
HTTP_LENGTH_REQUIRED = 411
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Whose a request is (its tenant's name), or ApiError 401.
TenantOf = Callable[[Request], str]


@dataclass(slots=True)
class ServiceConfig:
    """What the command line set for the API."""

    model: str  # the served model's name (a batch object's `model`)
    endpoints: tuple[str, ...]
    test_window_s: int | None  # for tests: every batch's deadline, whatever its window
    max_upload_bytes: int
    key_max_stored_bytes: int
    key_max_active_batches: int


def make_app(store: Store, scheduler: Scheduler, tenants: Tenants | None, config: ServiceConfig) -> FastAPI:
    """The ASGI app; the scheduler runs from the app's start to its end (SIGTERM: every run
    stops gracefully, keeping what it answered)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="shape-broker batch service", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    _errors(app)

    def tenant(request: Request) -> str:
        if tenants is None:
            return DEFAULT_TENANT
        header = request.headers.get("authorization")
        found = tenants.tenant(header)
        if found is not None:
            return found
        if not header:
            raise ApiError(HTTP_UNAUTHORIZED, "You didn't provide an API key. You need to provide your API key in an "
                                              "Authorization header using Bearer auth (Authorization: Bearer KEY).")
        raise ApiError(HTTP_UNAUTHORIZED, "Incorrect API key provided.", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        """200 once the engines serve (the node started), 503 while they start, as vLLM's."""
        if not scheduler.executor.ready():
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        caller = tenant(request)  # with keys, a tenant's own batches and bytes only: names are not shared
        body = await run_in_threadpool(render, ServiceCollector(store, scheduler.clock,
                                                                None if tenants is None else caller))
        return Response(body, media_type=PROMETHEUS_TEXT)

    _files(app, store, scheduler, tenant, config)
    _batches(app, store, scheduler, tenant, config)
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return JSONResponse(error_body(ApiError(exc.status_code, message)), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        error = ApiError(HTTP_BAD_REQUEST, str(first.get("msg", "invalid request")), param)
        return JSONResponse(error_body(error), status_code=HTTP_BAD_REQUEST)


def _files(app: FastAPI, store: Store, scheduler: Scheduler, tenant: TenantOf, config: ServiceConfig) -> None:
    @app.post("/v1/files")
    async def upload(request: Request) -> dict:
        owner = tenant(request)
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            raise ApiError(HTTP_LENGTH_REQUIRED, "an upload needs its Content-Length")
        if int(length) > config.max_upload_bytes + MULTIPART_OVERHEAD_BYTES:
            raise ApiError(HTTP_TOO_LARGE, f"the upload is {int(length):,} bytes; this server takes files of at most "
                                           f"{config.max_upload_bytes:,} bytes (--max-upload-bytes)", "file",
                           "file_too_large")
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(HTTP_BAD_REQUEST, "file is required: the JSONL file, as multipart form data", "file")
            if purpose not in UPLOAD_PURPOSES:
                raise ApiError(HTTP_BAD_REQUEST, f"purpose {str(purpose)[:40]!r}: this server takes files for batches "
                                                 f"(purpose 'batch')", "purpose")
            size = upload.size if upload.size is not None else int(length)
            record = await run_in_threadpool(store.upload, owner, upload.filename or "upload.jsonl", upload.file,
                                             size, config.max_upload_bytes, config.key_max_stored_bytes,
                                             int(scheduler.clock()))
        return file_object(record)

    @app.get("/v1/files")
    async def list_files(request: Request) -> dict:
        owner = tenant(request)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(HTTP_BAD_REQUEST, f"order {order[:20]!r}: asc or desc", "order")
        limit = check_limit(_int(query, "limit"), FILE_LIST_DEFAULT, FILE_LIST_LIMIT_RANGE)
        found = store.list_files(owner, query.get("purpose"), ascending=order == "asc")
        return list_page([file_object(f) for f in found], query.get("after"), limit)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, request: Request) -> dict:
        return file_object(store.file(tenant(request), file_id))

    @app.get("/v1/files/{file_id}/content")
    async def content(file_id: str, request: Request) -> Response:
        record = store.file(tenant(request), file_id)
        return FileResponse(store.content_path(record.id), media_type="application/octet-stream",
                            filename=record.filename)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> dict:
        await run_in_threadpool(store.delete_file, tenant(request), file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def _batches(app: FastAPI, store: Store, scheduler: Scheduler, tenant: TenantOf, config: ServiceConfig) -> None:
    @app.post("/v1/batches")
    async def create(request: Request) -> dict:
        owner = tenant(request)
        body = await _json_body(request)
        wanted = parse_batch_create(body, config.endpoints)
        window_s = config.test_window_s or window_seconds(wanted.completion_window)
        batch = await run_in_threadpool(store.create_batch, owner, wanted, config.model, window_s,
                                        config.key_max_active_batches, int(scheduler.clock()))
        scheduler.wake()
        return batch_object(batch)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> dict:
        owner = tenant(request)
        query = request.query_params
        limit = check_limit(_int(query, "limit"), BATCH_LIST_DEFAULT, BATCH_LIST_LIMIT_RANGE)
        with store.lock:
            found = [batch_object(b) for b in store.list_batches(owner)]
        return list_page(found, query.get("after"), limit)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, request: Request) -> dict:
        with store.lock:
            return batch_object(store.batch(tenant(request), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> dict:
        owner = tenant(request)
        batch = await run_in_threadpool(scheduler.cancel, owner, batch_id)
        with store.lock:
            return batch_object(batch)


async def _json_body(request: Request) -> object:
    """The request's JSON body, at most MAX_JSON_BODY_BYTES (ApiError 400 otherwise)."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_JSON_BODY_BYTES:
            raise ApiError(HTTP_TOO_LARGE, f"the body is more than {MAX_JSON_BODY_BYTES:,} bytes")
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError(HTTP_BAD_REQUEST, "We could not parse the JSON body of your request.") from None


def _int(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError(HTTP_BAD_REQUEST, f"{name} {value[:20]!r} is not an integer", name) from None
