"""`pipeline serve`'s process: the store opened (resuming what it holds), the scheduler and
its executor, the API served by uvicorn on one socket bound before anything starts.

SIGTERM or Ctrl-C stops it gracefully: uvicorn finishes the requests in flight, then the
scheduler stops every job (each keeps what it answered, JOB_STOP_WAIT_S at most) and the
next start on the same data directory resumes them. A kill -9 leaves the same to the next
start: each job gets SIGTERM from the kernel as its parent dies.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from pipeline.service.app import ServiceConfig, make_app
from pipeline.service.auth import Tenants, check_host
from pipeline.service.limits import REQUESTS_STOP_WAIT_S
from pipeline.runtime.node import NodeSpec
from pipeline.service.runner import RunBatchExecutor
from pipeline.service.scheduler import Scheduler
from pipeline.service.states import TERMINAL
from pipeline.service.store import Store
from pipeline.wire.errors import SettingsError

log = logging.getLogger("pipeline.service")


@dataclass(slots=True)
class ServeOptions:
    data_dir: str
    host: str
    port: int
    tenants: Tenants | None
    job_args: list[str]  # run-batch's options for every job (model, engine, flags)
    max_concurrent: int
    api: ServiceConfig
    node: NodeSpec | None  # the broker and consumers every job runs on (`runner.node_spec`)
    verbose: bool = False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (SettingsError in one line where it cannot be had)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise SettingsError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    sock.set_inheritable(False)
    return sock


def serve(options: ServeOptions, say) -> None:
    """Serve until stopped (the module's doc); `say`: a line to the user."""
    import uvicorn

    check_host(options.host, options.tenants)
    sock = bind(options.host, options.port)
    store = Store.open(options.data_dir)
    try:
        scheduler = Scheduler(store, RunBatchExecutor(options.job_args, options.node), options.max_concurrent)
        app = make_app(store, scheduler, options.tenants, options.api)
        batches = store.all_batches()
        unfinished = sum(1 for b in batches if b.life.status not in TERMINAL)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        if options.tenants is None:
            log.warning("no --api-keys: every request is the one local tenant's, and only this machine is served")
        say(f"pipeline serve: {len(store.files):,} files, {len(batches):,} batches ({unfinished:,} not ended: "
            f"resumed) in {store.data_dir}; {len(options.tenants or ()) or 'no'} API keys; "
            f"http://{shown}:{port}/v1")
        config = uvicorn.Config(app, log_level="info" if options.verbose else "warning",
                                access_log=options.verbose, lifespan="on",
                                timeout_graceful_shutdown=REQUESTS_STOP_WAIT_S)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        store.close()
        sock.close()
