"""What `pipeline status --data-dir D` says of a batch service's data directory, read-only
(the server may be running, or not): each batch's status and request counts, those of a
batch not ended from its job's own files (as the running server reads them), and whether a
server holds the directory.

    found = service_status(data_dir)    # None: not a service's data directory
"""

from __future__ import annotations

import os

from pipeline.runtime.datadir import lock_holder
from pipeline.service.objects import batch_object
from pipeline.service.runner import BatchRun, job_progress
from pipeline.service.states import TERMINAL
from pipeline.service.store import BATCHES_DIR, LOCK_NAME, Store


def service_status(data_dir: str) -> dict | None:
    """{"server": pid or None, "batches": [Batch objects, oldest first, with "owner"]}."""
    if not (os.path.isfile(os.path.join(data_dir, LOCK_NAME)) and os.path.isdir(os.path.join(data_dir,
                                                                                            BATCHES_DIR))):
        return None
    store = Store(data_dir)
    store.load_batches()
    found = []
    for batch in sorted(store.batches.values(), key=lambda b: b.seq):
        if batch.life.status not in TERMINAL:
            run = BatchRun(batch.id, "", store.work_dir(batch), batch.total)
            progress = job_progress(run)
            if progress.usage is not None:
                batch.completed, batch.failed = progress.done - progress.failed, progress.failed
        found.append({**batch_object(batch), "owner": batch.owner})
    return {"server": lock_holder(os.path.join(data_dir, LOCK_NAME)), "batches": found}
