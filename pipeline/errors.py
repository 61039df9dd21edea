"""Every error the product raises for the outside world, in one tree.

`assert` is for our own bugs. Anything caused by input (producers, consumers, files, disks)
raises one of these, with the offending value, path and byte offset in the message.

    PipelineError
    ├── BadInputError (also ValueError)      a producer's item is malformed; nothing was written
    │   ├── TokenArrayError                  empty, not 1-D, non-integer, or ids outside int32
    │   ├── ItemTooLongError                 more tokens than the configured record limit
    │   ├── PayloadTooLargeError             payload above the configured limit
    │   ├── ModelIdError                     model id outside [0, max_models)
    │   └── SignatureError                   signature not an unsigned 64-bit integer
    └── FrameError                           a ring record is not a valid submission frame

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


class FrameError(PipelineError):
    """A ring record does not parse as a submission frame (wrong magic, version or sizes)."""


__all__ = [
    "BadInputError",
    "FrameError",
    "ItemTooLongError",
    "ModelIdError",
    "ObjectExistsError",
    "ObjectMissingError",
    "PayloadTooLargeError",
    "PipelineError",
    "RecordTooLargeError",
    "RingClosedError",
    "RingTimeoutError",
    "ShmError",
    "SignatureError",
    "StaleObjectError",
    "TokenArrayError",
]
