"""Every error the product raises for the outside world, in one tree.

`assert` is for our own bugs. Anything caused by input (producers, consumers, files, disks)
raises one of these, with the offending value, path and byte offset in the message.

    PipelineError
    ├── BadInputError (also ValueError)      a producer's item is malformed; nothing was written
    │   ├── TokenArrayError                  empty, not 1-D, non-integer, or ids outside int32;
    │   │                                    or a text the tokenizer fails on (a lone surrogate)
    │   ├── ItemTooLongError                 more tokens than the configured record limit
    │   ├── PayloadTooLargeError             payload above the configured limit
    │   ├── ModelIdError                     model id outside [0, max_models)
    │   ├── SignatureError                   signature not an unsigned 64-bit integer, or
    │   │                                    the solitary pool's own (POOL_SIGNATURE)
    │   ├── WorkloadError                    a workload file has bad lines (path:line named)
    │   │   └── BatchFileError               an OpenAI Batch request file has malformed lines
    │   │                                    (path:line named); the job does not start
    │   ├── AuditFileError                   a file `tools check-job` reads is absent, not a
    │   │                                    regular file, unreadable or changed while read
    │   │                                    (path and byte offset named)
    │   ├── ChatRequestError                 a chat request cannot be made a prompt: its
    │   │   │                                messages are malformed, or the model's chat
    │   │   │                                template or tokenizer failed on them (what, and
    │   │   │                                where: a lone surrogate's field and position)
    │   │   └── NoChatTemplateError          the model directory has no chat template: chat
    │   │                                    requests are refused, completions still work
    │   ├── ContractError                    a consumer contract has a zero, negative or
    │   │                                    non-integer number
    │   ├── NotHeldError                     a consumer completes an entry it does not hold
    │   ├── SettingsError                    a run's setting is unknown, mistyped or out of
    │   │   │                                range (its file or the command line named)
    │   │   └── ApiKeysError                 the batch service's key file is unreadable, open
    │   │                                    to others or has a bad line (path:line named)
    │   ├── ApiError                         a request to the batch service is refused: its
    │   │                                    HTTP status, OpenAI's error type, param, code
    │   └── ProtocolError                    a control message is malformed (length, JSON,
    │       │                                type, fields); the peer is disconnected
    │       └── ConsumerNameError            a consumer name that cannot name a results file
    ├── ConfigError (also ValueError)        a configuration value outside its limit (a
    │   │                                    socket path too long for a Unix socket, ...)
    │   ├── EngineOptionsError               an engine's options are unknown, mistyped or
    │   │                                    out of range (each one named)
    │   └── ModelDirError                    a model directory's tokenizer.json, its config
    │                                        or its chat template is missing, unreadable or
    │                                        invalid (the path named)
    ├── EngineUnavailableError               an engine's runtime is not installed or cannot
    │                                        start (the command that installs it named)
    ├── UntrustedPeerError                   the control socket, or the process behind it,
    │                                        belongs to another user; nothing was sent
    ├── DataDirError                         a data directory (or one of its directories)
    │   │                                    owned by another user or writable by group or
    │   │                                    others: refused, with how to fix it
    │   ├── DataDirMovedError                the data directory's path no longer leads to the
    │   │                                    folder the run started in (moved, or a link put
    │   │                                    in its place): the run stops, writing nowhere else
    │   └── LiveRunError                     a live run holds it (its broker or its
    │       │                                launcher): `tools cleanup` refuses, and no
    │       │                                clean-up removes anything of it
    │       └── DataDirInUseError            `launch` or `run-batch` refused at once: another
    │                                        run or a broker holds it (also RuntimeError)
    ├── NodeStartError (also RuntimeError)   a node's broker and consumers did not start in
    │                                        time (`runtime/node.py`); nothing of it is left running
    ├── ProducerStoppedError                 a producer stopped before any broker took its registration
    ├── ProducerRefusedError                 the broker refused a producer (its reason named);
    │                                        what it published and was not stored is named
    ├── FrameError                           a ring record is not a valid submission frame
    ├── StaleBatchError                      a batch can no longer be committed (its entries
    │                                        left the front of their lane); nothing changed
    ├── ShapeGuardError                      FATAL: a chunk's shape is not its model's current
    │                                        shape; the process loop must stop the broker
    ├── RegistrationRefusedError             FATAL for a consumer: the broker refused its
    │                                        registration (the broker's reason named)
    └── StorageError                         the disk tier's files or disk
        ├── SegmentFormatError               a file is not a segment of this format version
        ├── SegmentCorruptError              damage inside a segment (path and offset named);
        │                                    never truncated or zeroed
        ├── SegmentReadError                 a segment cannot be read now (descriptors,
        │                                    memory, permissions): not damage; the consumer
        │                                    hands its batches back and retries
        ├── SegmentNameError                 a segment key (model, lane, sequence, signature)
        │                                    beyond what a segment file name holds
        ├── StoreReadError                   a data directory, segment or store log cannot
        │                                    be read (permissions, I/O, not a directory)
        ├── ResultsFileError                 a results file or directory cannot be read or
        │   │                                written (path named); bad lines are counted
        │   └── ResultsWriteError            FATAL for a consumer: a batch's results write
        │       │                            failed (path, offset, errno); it was undone
        │       └── ResultsDiskFullError     ENOSPC/EDQUOT: the consumer hands its batches
        │                                    back and retries with backoff
        ├── BatchOutputError                 a batch job's output file cannot be written (path,
        │                                    errno named; any older output is left whole), or
        │                                    a results row cannot make its output line
        ├── DiskFullError                    ENOSPC: appends stop (backpressure), nothing
        │                                    accepted is lost
        └── DurabilityError                  FATAL: fsync/fdatasync failed; the broker stops
                                             (no retry-and-continue: the page cache may
                                             already have dropped the data)

The shared-memory errors of `shm/` (which cannot import this package) are re-exported here
so callers catch everything from one module: `except (PipelineError, ShmError)`. Among
them ShmSpaceError (also OSError, errno ENOSPC): /dev/shm has no room for an object at its
creation, or for a run before it starts.
"""

from __future__ import annotations

import os

from shm.errors import (
    ObjectExistsError,
    ObjectMissingError,
    RecordTooLargeError,
    RingClosedError,
    RingTimeoutError,
    ShmError,
    ShmSpaceError,
    StaleObjectError,
)


class PipelineError(Exception):
    """Base of every error raised by `pipeline/`."""


class BadInputError(PipelineError, ValueError):
    """A producer's input is malformed; it was rejected and nothing was written."""


class TokenArrayError(BadInputError):
    """Token ids are empty, not one-dimensional, not integers, or outside int32; or a text to
    tokenize (a completion prompt) the tokenizer fails on: a lone surrogate (valid in JSON,
    not in UTF-8) is named with its position."""


class ItemTooLongError(BadInputError):
    """An item has more tokens than the configured record limit."""


class PayloadTooLargeError(BadInputError):
    """An item's opaque payload is larger than the configured limit."""


class GenerationParamsError(BadInputError):
    """An item's generation parameters are out of range (at the producer), or the envelope
    that carries them in its payload is malformed (at the consumer: that item is answered
    with status error, naming the byte offset)."""


class ModelIdError(BadInputError):
    """A model id is outside the configured range."""


class SignatureError(BadInputError):
    """A shape signature is not an unsigned 64-bit integer, or is the one the broker keeps
    for its solitary pool (`pipeline.wire.shapes.POOL_SIGNATURE`)."""


class WorkloadError(BadInputError):
    """A workload file cannot be used: unreadable, empty, or with malformed lines (each one
    named as path:line with what is wrong). Raised before anything is submitted."""


class BatchFileError(WorkloadError):
    """An OpenAI Batch request file (`pipeline run-batch -i`) cannot be run: unreadable, empty,
    more requests than the limit, or lines that are not requests (not JSON, not an object, a
    missing or mistyped custom_id/method/url/body, a method other than POST, a custom_id used
    twice): the first lines are named as path:line with what is wrong, and the total. Raised
    before anything is submitted. A well-formed request the engine cannot serve is not this
    error: it is answered in the output file (`pipeline.batchjob.requests`)."""


class AuditFileError(BadInputError):
    """A file `pipeline tools check-job` reads (a job's input, output, error file or summary)
    cannot be audited: it is absent, not a regular file, unreadable (the errno's words and
    the byte offset where reading stopped), or it changed between the audit's passes over it
    (a line where another was). What is wrong inside a file that reads is the audit's verdict,
    not this error."""


class ChatRequestError(BadInputError):
    """A chat request cannot be made into a prompt: its messages are not a list of
    {role, content} objects (the message and field named), or the model's chat template
    raised on them (anything: `raise_exception`, a type error, MemoryError, RecursionError)
    or rendered nothing, or the tokenizer failed on the rendered text (a lone surrogate, valid
    in JSON and not in UTF-8: its field and position named). That request is refused; the
    others are not affected."""


class NoChatTemplateError(ChatRequestError):
    """The model directory has no chat template (no `chat_template` in tokenizer_config.json,
    no chat_template.jinja, or a list of named templates without "default"): chat requests
    are refused, naming the directory; completion requests still work."""


class ConfigError(PipelineError, ValueError):
    """A configuration value is outside its limit (a data directory whose socket path does
    not fit a Unix socket address, a timeout that is not a positive number, ...). Raised
    before anything is created; the message names the value and the limit."""


class EngineOptionsError(ConfigError):
    """An engine's options (`engine_options`) are unknown, of the wrong type or out of range:
    the message names every wrong option. Raised when the engine is made, before any model
    is loaded, so a launch refuses them before a process starts."""


class ModelDirError(ConfigError):
    """A model directory cannot give a tokenizer: it is not a directory, or its
    tokenizer.json, tokenizer_config.json or chat template is missing, unreadable, too large
    or invalid (a field of the wrong type, a template that does not compile). The message
    names the path and what is wrong, in one line. Raised when the tokenizer is loaded,
    before any request is read."""


class EngineUnavailableError(PipelineError):
    """An engine's runtime cannot be used here: its package is not installed, or it failed
    to start. The message names what is missing and the command that installs it."""


class SettingsError(BadInputError):
    """A setting of a run is wrong (an unknown key, a wrong type, a value out of range);
    the message names where it came from (a file, the command line) and the key."""


class ApiKeysError(SettingsError):
    """The batch service's API key file (`pipeline serve --api-keys`) cannot be used: it is
    missing, unreadable, too big, readable by others, or a line is not a key (too short, too
    long, a space inside, a name that is not a word, a key given twice): path:line named,
    never the key itself."""


class ApiError(BadInputError):
    """A request to the batch service (`pipeline serve`) refused: the HTTP status, and
    OpenAI's error object (message, type, param, code) it is answered with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type


class MetricsPortError(SettingsError):
    """The metrics port cannot be listened on (another process listens there, or it is not
    ours to take). Found before anything runs; the message names the port and the way out."""


class UntrustedPeerError(PipelineError):
    """The control socket is not a socket owned by this user, or the process serving (or
    connecting to) it runs as another user: it may be posing as the broker (or a client).
    Nothing was sent; the message names the path, the owner's uid and how to fix it."""


class DataDirError(PipelineError):
    """A data directory cannot be trusted: it, or a directory inside it or above it, is owned
    by another user or writable by group or others (who could replace its files: the
    socket, the segments), or it is not a directory. Nothing was read or written there; the
    message names the path, its owner and mode, and how to fix it."""


class DataDirMovedError(DataDirError):
    """The data directory's path no longer leads to the folder the run checked and started in
    (`pipeline.wire.dirpin`): the folder, or one above it, was moved or removed, or a link or
    another folder was put at its name while the run went on. Nothing more is written by
    path: the run stops there. The message names the path, what it leads to now, and that
    the same command continues once the folder is back."""


class JobMismatchError(DataDirError):
    """A batch job's data directory holds a job this run would change (another input file,
    by content; another served model, tokenizer, chat template, model config, weights,
    engine or engine option that changes answers; another output): resuming there would mix
    answers made two ways. The message names what changed and what the user can do."""


class InputChangedError(JobMismatchError):
    """A batch job's input file changed in place while the job ran: a line read back is not
    the one the job's scan read. The message names the line."""


class JobPathError(BadInputError):
    """A path a batch job would write, replace or delete is not the job's to touch: an
    output that is the input or another output, inside the data directory, a device, FIFO,
    socket, directory or symlink, an existing file not the job's own (without --overwrite),
    a directory the job cannot write to; or a data directory that is not a job's. Checked
    before anything runs; the message names the path and what to do."""


class JobOutputError(PipelineError):
    """A batch job's outputs could not be written at its end (a full disk, a read-only
    directory); every answer is kept, and the message says how to write them."""


class LiveRunError(DataDirError):
    """A live run holds the data directory: a broker (run/broker.lock) or a launcher
    (run/launch.lock). `pipeline tools cleanup` touches nothing of a live run. The message
    names the data directory, the pid and how to stop it."""


class DataDirInUseError(LiveRunError, RuntimeError):
    """`pipeline launch` or `run-batch` refused before anything started: another launcher
    holds the data directory, or a broker serves it. Nothing was read, started or removed.
    A RuntimeError too, as a broker that cannot start raises (`start_broker`): every caller
    of a launch already says those in one line."""


class NodeStartError(PipelineError, RuntimeError):
    """A node process (a broker and its consumers serving until stopped) did not say it
    serves within its start timeout, or exited first; what it started was stopped. A
    RuntimeError too, as a broker that cannot start raises."""


class ProducerStoppedError(PipelineError):
    """A producer told to stop (SIGTERM; its parent died) while no broker had taken its
    registration yet: it gives up at once, having published nothing."""


class ProducerRefusedError(PipelineError):
    """The broker refused this producer (a record that is not a valid frame, a model id it
    does not serve): the message carries the broker's reason. Records the producer published
    after the refused one were not stored; they stay in its ring for inspection."""


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


class RegistrationRefusedError(PipelineError):
    """FATAL for a consumer. The broker answered its registration with an error (a contract
    whose descriptor does not fit the broker's descriptor ring, an unknown model, a bad
    name); the message carries the broker's reason. The same registration would be refused
    again, so the consumer exits (status 2) instead of retrying."""



class ProtocolError(BadInputError):
    """A control-socket message is malformed: bad length, not JSON, unknown type, or a
    missing or mistyped field. The broker disconnects that peer and serves the others."""


class ConsumerNameError(ProtocolError):
    """A consumer's name cannot name its results file: empty, longer than the limit, a
    character other than letters, digits, '.', '_', '-', or a leading '.'
    (`pipeline.wire.protocol.check_consumer_name`)."""


class StorageError(PipelineError):
    """The disk tier's files or disk failed; the message names the path and byte offset."""


class SegmentFormatError(StorageError):
    """A file is not a segment of this format version (magic, version, identity checksum)."""


class SegmentCorruptError(StorageError):
    """Damage inside a segment where a reader expected a whole entry (an offset where none
    starts, a checksum that fails). Never truncated or zeroed: recovery salvages the other
    entries and names the damage (`pipeline.storage.scan`)."""


class SegmentReadError(StorageError):
    """A segment file cannot be mapped now for a reason that is not damage (out of file
    descriptors or memory, permission denied): the items are intact, so the consumer hands
    its batches back and retries with backoff, never answers them as corrupt."""


class SegmentNameError(StorageError):
    """A segment key does not fit the segment file names (`pipeline.wire.layouts`: model ids below
    MODEL_ID_LIMIT, lane ids below LANE_ID_LIMIT, sequences below SEGMENT_SEQ_LIMIT,
    signatures unsigned 64-bit): refused before anything is created, the value named."""


class StoreReadError(StorageError):
    """A data directory, segment file or store log cannot be read (permissions, an I/O error, a
    file where a directory belongs): the path and the system's reason are named."""


class ResultsFileError(StorageError):
    """A consumer's results file, or the results directory, cannot be read or written (no
    permission, not a regular file, an I/O error); the path is named. Lines in a readable
    file that are not results are not an error: readers count and name them."""


class ResultsWriteError(ResultsFileError):
    """FATAL for a consumer. Writing one batch's results failed: the message names the path,
    the byte offset of the write and the errno. The write was undone (the file cut back to
    its size before it), so no partial line is left and nothing written before is lost; the
    batch was not reported complete, so it comes back. `errno_code` is the OSError's errno."""

    def __init__(self, message: str, path: str = "", offset_bytes: int = -1, errno_code: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.offset_bytes = offset_bytes
        self.errno_code = errno_code


class ResultsDiskFullError(ResultsWriteError):
    """ENOSPC or EDQUOT writing results. Not fatal: the consumer hands back every batch it
    holds, waits with backoff, and registers again."""


class AnswerLogWriteError(StorageError, OSError):
    """An append to a batch job's answer log failed and was cut back whole (nothing of it
    kept, nothing counted): `errno` says why; ENOSPC means wait for room and offer the same
    answers again (they are still in the results files)."""

    def __init__(self, message: str, errno_value: int | None, path: str | None = None) -> None:
        OSError.__init__(self, errno_value or 0, message)
        self.path = path  # the file whose write failed: its disk is the one full


class BatchOutputError(StorageError):
    """A batch job's output file cannot be written (no directory, no permission, the disk
    full, a failed fsync): the message names the path and the errno. The output is written
    to a temporary file beside it and renamed over it only when whole, so an older output
    file is left as it was and no temporary file stays behind. Also raised, before anything
    is written, for a results row that cannot make its request's output line (a count that
    is not a number of tokens, an unknown status, no row for a request that ran)."""


class AnswerTextError(BatchOutputError):
    """A request's answer text cannot be made from its tokens: the model's tokenizer
    decoder failed on them (any exception, a Rust panic), or decoded them to more than
    `decoding.MAX_ANSWER_TEXT_CHARS`. That request is answered with status 500 naming why;
    the others are not affected."""


class DiskFullError(StorageError):
    """The disk is full (ENOSPC): appends stop, producers feel backpressure, nothing that was
    accepted is lost; appends resume when space comes back."""


class FileOpError(StorageError, OSError):
    """A file operation of the store or the results failed (pipeline.wire.fileops): the
    operation, the path and the byte offset are named, and `errno` is the system's, so a
    caller that handles a full disk (ENOSPC) still sees it as such; an OSError too, for the
    handlers that catch those. In the broker an unhandled one is FATAL: it stops, and its
    restart recovers from what the files hold."""

    def __init__(self, code: int | None, message: str, path: str | None = None) -> None:
        # strerror stays the system's words, as for any OSError, for messages built from it.
        OSError.__init__(self, code, os.strerror(code) if code else message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return self.message


class DurabilityError(StorageError):
    """FATAL. fsync/fdatasync failed. The broker stops: after a failed fsync the kernel may
    have dropped the dirty pages, so retrying and carrying on could lose acknowledged work."""


__all__ = [
    "AuditFileError",
    "BadInputError",
    "BatchFileError",
    "BatchOutputError",
    "ChatRequestError",
    "ConfigError",
    "ConsumerNameError",
    "ContractError",
    "DataDirError",
    "DataDirInUseError",
    "DiskFullError",
    "DurabilityError",
    "FileOpError",
    "EngineOptionsError",
    "EngineUnavailableError",
    "FrameError",
    "GenerationParamsError",
    "ItemTooLongError",
    "JobMismatchError",
    "LiveRunError",
    "ModelDirError",
    "ModelIdError",
    "NoChatTemplateError",
    "NotHeldError",
    "ObjectExistsError",
    "ObjectMissingError",
    "PayloadTooLargeError",
    "PipelineError",
    "ProducerRefusedError",
    "ProducerStoppedError",
    "ProtocolError",
    "RecordTooLargeError",
    "RegistrationRefusedError",
    "ResultsDiskFullError",
    "ResultsFileError",
    "ResultsWriteError",
    "RingClosedError",
    "RingTimeoutError",
    "SegmentCorruptError",
    "SegmentFormatError",
    "SegmentNameError",
    "SegmentReadError",
    "SettingsError",
    "ShapeGuardError",
    "ShmError",
    "ShmSpaceError",
    "SignatureError",
    "StaleBatchError",
    "StaleObjectError",
    "StorageError",
    "StoreReadError",
    "TokenArrayError",
    "UntrustedPeerError",
    "WorkloadError",
]
