"""Every error the product raises for the outside world, in one tree.

`assert` is for our own bugs. Anything caused by input (producers, consumers, files, disks)
raises one of these, with the offending value, path and byte offset in the message.

    PipelineError
    ├── BadInputError (also ValueError)      a producer's item is malformed; nothing was written
    │   ├── TokenArrayError                  empty, not 1-D, non-integer, or ids outside int32
    │   ├── ItemTooLongError                 more tokens than the configured record limit
    │   ├── PayloadTooLargeError             payload above the configured limit
    │   ├── ModelIdError                     model id outside [0, max_models)
    │   ├── SignatureError                   signature not an unsigned 64-bit integer
    │   ├── WorkloadError                    a workload file has bad lines (path:line named)
    │   ├── ResultsFileError                 a results line that is not JSON, before the last
    │   ├── ContractError                    a consumer contract has a zero, negative or
    │   │                                    non-integer number
    │   ├── NotHeldError                     a consumer completes an entry it does not hold
    │   └── ProtocolError                    a control message is malformed (length, JSON,
    │                                        type, fields); the peer is disconnected
    ├── FrameError                           a ring record is not a valid submission frame
    ├── StaleBatchError                      a batch can no longer be committed (its entries
    │                                        left the front of their lane); nothing changed
    ├── ShapeGuardError                      FATAL: a chunk's shape is not its model's current
    │                                        shape; the process loop must stop the broker
    └── StorageError                         the disk tier's files or disk
        ├── SegmentFormatError               a file is not a segment of this format version
        ├── SegmentCorruptError              damage inside a segment (path and offset named);
        │                                    the segment is quarantined, never truncated
        ├── EntryCompletedError              a consumer read an entry already completed (it
        │                                    held a stale batch after being declared dead)
        ├── DiskFullError                    ENOSPC: appends stop (backpressure), nothing
        │                                    accepted is lost
        └── DurabilityError                  FATAL: fsync/fdatasync failed; the broker stops
                                             (no retry-and-continue: the page cache may
                                             already have dropped the data)

The shared-memory errors of `shm/` (which cannot import this package) are re-exported here
so callers catch everything from one module: `except (PipelineError, ShmError)`.
"""

from __future__ import annotations

from shm.errors import (
    ObjectExistsError,
    ObjectMissingError,
    RecordTooLargeError,
    RingClosedError,
    RingTimeoutError,
    ShmError,
    StaleObjectError,
)


class PipelineError(Exception):
    """Base of every error raised by `pipeline/`."""


class BadInputError(PipelineError, ValueError):
    """A producer's input is malformed; it was rejected and nothing was written."""


class TokenArrayError(BadInputError):
    """Token ids are empty, not one-dimensional, not integers, or outside int32."""


class ItemTooLongError(BadInputError):
    """An item has more tokens than the configured record limit."""


class PayloadTooLargeError(BadInputError):
    """An item's opaque payload is larger than the configured limit."""


class ModelIdError(BadInputError):
    """A model id is outside the configured range."""


class SignatureError(BadInputError):
    """A shape signature is not an unsigned 64-bit integer."""


class WorkloadError(BadInputError):
    """A workload file cannot be used: unreadable, empty, or with malformed lines (each one
    named as path:line with what is wrong). Raised before anything is submitted."""


class ResultsFileError(BadInputError):
    """A consumer's results file has a line that is not a result, before its last line (a
    torn last line is what a killed consumer leaves, and is counted, not an error)."""


class FrameError(PipelineError):
    """A ring record does not parse as a submission frame (wrong magic, version or sizes)."""


class ContractError(BadInputError):
    """A consumer's contract (model, max batch items, max batch tokens, max input length) has
    a number that is not an integer, or is zero or negative (SPEC §8)."""


class NotHeldError(BadInputError):
    """A consumer completed an entry it does not hold (never dispatched to it, held by another
    consumer, or completed so long ago that it is no longer remembered). Nothing of the
    completion was applied; the broker disconnects that consumer (SPEC §5, §8)."""


class StaleBatchError(PipelineError):
    """A peeked batch can no longer be committed: its entries are not the front of their lane
    any more, or a segment holding them is gone. Step 1 of the commit found it, so nothing
    was changed (SPEC §5); the entries stay dispatchable."""


class ShapeGuardError(PipelineError):
    """FATAL. A chunk about to be handed out is not of its model's current shape (SPEC §4's
    hard guard). Never caught to carry on: the process loop must stop the broker with this
    message, because a poisoned cache is worse than a restart."""



class ProtocolError(BadInputError):
    """A control-socket message is malformed: bad length, not JSON, unknown type, or a
    missing or mistyped field. The broker disconnects that peer and serves the others."""


class StorageError(PipelineError):
    """The disk tier's files or disk failed; the message names the path and byte offset."""


class SegmentFormatError(StorageError):
    """A file is not a segment of this format version (magic, version, identity checksum)."""


class SegmentCorruptError(StorageError):
    """Damage inside a segment: an entry fails its checks and a valid entry follows it.
    The segment is quarantined, never silently truncated."""


class EntryCompletedError(StorageError):
    """A consumer found an entry already tombstoned: another consumer completed it after this
    one was declared dead. Not damage: the consumer skips the item."""


class DiskFullError(StorageError):
    """The disk is full (ENOSPC): appends stop, producers feel backpressure, nothing that was
    accepted is lost; appends resume when space comes back."""


class DurabilityError(StorageError):
    """FATAL. fsync/fdatasync failed. The broker stops: after a failed fsync the kernel may
    have dropped the dirty pages, so retrying and carrying on could lose acknowledged work."""


__all__ = [
    "BadInputError",
    "ContractError",
    "DiskFullError",
    "DurabilityError",
    "EntryCompletedError",
    "FrameError",
    "ItemTooLongError",
    "ModelIdError",
    "NotHeldError",
    "ObjectExistsError",
    "ObjectMissingError",
    "PayloadTooLargeError",
    "PipelineError",
    "ProtocolError",
    "RecordTooLargeError",
    "RingClosedError",
    "RingTimeoutError",
    "SegmentCorruptError",
    "SegmentFormatError",
    "ShapeGuardError",
    "ShmError",
    "SignatureError",
    "StaleBatchError",
    "StaleObjectError",
    "StorageError",
    "TokenArrayError",
]
