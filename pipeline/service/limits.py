"""The batch service's limits, each checked where the outside world enters (a request, the
key file, the command line), with its reason."""

from __future__ import annotations

# OpenAI's completion window (the one its Batch API takes), the default, and the deadline it
# means. Other windows are taken too, a number of seconds, minutes or hours ("90m", "2h"):
# a batch's window is its deadline, which the scheduler orders by (admission.py).
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600
COMPLETION_WINDOW_UNITS_S = {"s": 1, "m": 60, "h": 3600}
# The windows taken: a minute (shorter is less than a vLLM engine's start, missed by any
# batch) to a week (Bedrock's longest batch window; longer is a mistake, not a plan).
COMPLETION_WINDOW_RANGE_S = (60, 7 * 24 * 3600)
# The test option's range for the deadline of every batch, whatever its window: a second (a test that
# expires a batch at once) to the real window.
TEST_WINDOW_RANGE_S = (1, COMPLETION_WINDOW_S)

# Batches whose jobs run at once, all on the node's one broker and engines: their requests
# meet in its store, so jobs that share prompts share the cache. Four: each job holds its
# producers (a tokenizer and a 64 MiB ring each, as many as the cores), and more jobs at
# once only split the same engines further.
DEFAULT_MAX_CONCURRENT_BATCHES = 4
# The most the option takes: every running job holds its producers.
MAX_CONCURRENT_BATCHES = 64
# The node (the broker and consumers every job runs on) is started again when it stopped,
# after a wait that doubles while starts fail or the node stops within NODE_STABLE_S of its
# start (a request that kills an engine each time it runs), from a second to five minutes:
# a node that keeps dying costs a start every five minutes, not a loop.
NODE_RETRY_FIRST_S = 1.0
NODE_RETRY_MAX_S = 300.0
NODE_STABLE_S = 60.0
# How often the node's results that every job read are freed (`batchjob/reclaim.py`): a stat
# of each results file and a read of each running job's positions, so not at every tick; the
# disk they take is at most this long of answers more.
RECLAIM_INTERVAL_S = 10.0

# A tenant's stored bytes (its uploads and the outputs made for it): OpenAI's project file
# storage is 100 GB; an upload past it is refused (outputs are always written).
DEFAULT_KEY_MAX_STORED_BYTES = 100 << 30
# A tenant's batches not yet ended (waiting or running): a create past it is refused, so
# one tenant cannot queue so much that everyone else waits behind it for days.
DEFAULT_KEY_MAX_ACTIVE_BATCHES = 100
# What the options take: a tenant's bytes up to a PiB (more than one machine holds); its
# active batches up to 100,000 (every record is in the server's memory, ~1 KiB each).
MAX_STORED_BYTES_LIMIT = 1 << 50
MAX_ACTIVE_BATCHES_LIMIT = 100_000
# One upload's bytes: OpenAI's per-file limit (512 MB). A bigger job is split, or the
# option raised.
DEFAULT_MAX_UPLOAD_BYTES = 512 << 20
# What the upload size options take: a byte to 1 TiB (what one disk holds, give or take).
MAX_UPLOAD_BYTES_LIMIT = 1 << 40

# The key file: read whole, at most this many bytes (10,000 keys of 64 characters with
# names fit in 1 MiB).
MAX_KEY_FILE_BYTES = 1 << 20
# Keys in the file: lookups are a hash; the bound keeps a wrong file (a log) from loading.
MAX_API_KEYS = 10_000
# A key is a password: at least 16 characters (of a 62-letter alphabet, ~95 bits), at most
# 256 (a header's worth; longer is a pasted file, not a key).
MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 256
# A tenant's name: what its records say it owns, in logs and metrics.
MAX_TENANT_NAME_CHARS = 64

# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# A batch's priority: its metadata's "priority", an integer in vLLM's sense (the lower, the
# sooner), 0 when not given. The range is far past any ladder of priorities a team keeps; a
# value beyond it is a mistake (a timestamp, an id in the wrong field) worth a 400.
PRIORITY_KEY = "priority"
DEFAULT_PRIORITY = 0
PRIORITY_RANGE = (-1_000_000, 1_000_000)
# An uploaded file's name as its record keeps it (a file system's name limit).
MAX_FILENAME_CHARS = 255
# A request body of JSON (a batch create): far above any real one, far below memory.
MAX_JSON_BODY_BYTES = 64 << 10

# Listing: OpenAI's ranges and defaults (batches 1..100, default 20; files 1..10,000, default
# 10,000).
BATCH_LIST_LIMIT_RANGE = (1, 100)
BATCH_LIST_DEFAULT = 20
FILE_LIST_LIMIT_RANGE = (1, 10_000)
FILE_LIST_DEFAULT = 10_000

# How often the scheduler looks at its batches (a create or a cancel wakes it at once): a
# job's end is seen within this, a small share of a job's own start (a second or more), and a
# status file read per running job costs microseconds.
SCHEDULER_TICK_S = 0.2
# A job run that fails (not one stopped) is run again, keeping what it answered, at most this
# many times before its batch fails: a passing failure (a crashed consumer) gets retries, a
# lasting one (a model that cannot load) does not loop for the whole window.
MAX_JOB_FAILURES = 3
# How long a stopping server waits for its jobs to stop gracefully (each keeps what it
# answered) before killing them; a killed job is resumed as well, only with less kept in order.
JOB_STOP_WAIT_S = 60.0
# How long a stopping server lets the requests in flight finish (an upload's check of a
# large file takes seconds), before its jobs are stopped.
REQUESTS_STOP_WAIT_S = 30
# Lines of a failed job's log kept in its batch's errors: the last lines say why.
JOB_LOG_TAIL_LINES = 5
# Bytes of a job's log read for that tail.
JOB_LOG_TAIL_BYTES = 16 << 10
