"""Which of a job's requests wait as items in a store or a producer ring: what a run does not
submit again (`BatchJob.find_pending`), and what a run on a node still waits for
(`BatchJob.unqueued`).

NOTE: each payload's tail is checked as a job payload, not its generation envelope decoded
first: the store's entries are checksummed as the producer wrote them, and a Python decode
per item took seconds for each million a stopped run left.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.batchjob.layout import JOB_PAYLOAD_SIZE_BYTES, job_request_indices
from pipeline.batchjob.manifest import JobManifest
from pipeline.batchjob.workload import set_bits
from pipeline.runtime.inventory import pending_payload_tails


def mark_queued(bits: np.ndarray, storage_dir: str, ring_names: Sequence[str], manifest: JobManifest) -> None:
    """Set in `bits` (a bit per request) the requests of the job of `manifest` that have an
    item in one of the producer rings `ring_names` or in the store of `storage_dir`; the
    rings first, so that an item a live broker moves from a ring into its store meanwhile is
    found in one of them."""
    for tails in (*pending_payload_tails("", ring_names, JOB_PAYLOAD_SIZE_BYTES),
                  *pending_payload_tails(storage_dir, (), JOB_PAYLOAD_SIZE_BYTES)):
        set_bits(bits, job_request_indices(tails, manifest.job_id, manifest.requests))
