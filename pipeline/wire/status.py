"""The broker's status: one typed record, versioned on the wire.

`Broker.status()` fills a BrokerStatus; a `status` request is answered with

    {"type": "status_reply", "version": STATUS_VERSION, "counters": status.to_wire()}

and every client reads it back with `BrokerStatus.from_wire(reply["counters"],
version=reply["version"])` (pipeline.runtime.local.broker_status): the launcher and its live
progress, `pipeline status`, the metrics endpoint, the run report, tools and tests.

Each field is declared once, here, with its meaning (`help` in its metadata) and, where
pipeline.reporting.metrics exports it, how (an `Export`: counter or gauge, and the metric's name, help
or value where they are not the field's own). Figures that several readers derive (received
with recovered items in, what is unfinished, the mean batch fill, a consumer's cache hit
rate) are properties of the records, defined once.

Versioning: any change to the wire form (a field added, removed, renamed or retyped) takes a
new STATUS_VERSION. A client reads its own version only, and refuses any other, and any
reply with a field missing, unknown or of the wrong type, with a ProtocolError naming it:
it never misreads a broker of another release.

Cheap to import: the standard library and pipeline.wire.errors only, never broker internals
(clients that only read status must not pay for numpy or the broker's modules).
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from typing import Any, get_args, get_origin, get_type_hints

from pipeline.wire.errors import ProtocolError

# The wire form's version: bump it with any change to the fields (see the module docstring).
# 5: compulsory_prefix_tokens (per consumer and the whole model's), compulsory_uncounted_starts,
#    lineage_chains_unrecorded, store_damage's lineage_problems.
# 6: shapes_seen (the run's distinct shapes; `shapes` is the live ones).
# 7: periodic_syncs, periodic_sync_failures, periodic_sync_max_s (sync_interval_s at `process`).
# 8: pool_items, pool_shapes (the solitary pool, pipeline/broker/pool.py).
# 9: store_damage's lineage_problems gone (the chains are store log records: their damage
#    counts among catalog_problems, the store log's).
STATUS_VERSION = 9
# The signature of the `top_shapes` row that sums every shape past the top ones.
OTHER_SHAPE = "other"
# The signature of a model's solitary pool's row (its many shapes' items, batched together).
POOL_SHAPE = "pool"
# busy_ns's unit.
NS_PER_S = 1_000_000_000
# Metric kinds (prometheus_client's counter and gauge families).
COUNTER = "counter"
GAUGE = "gauge"


# The kinds `store_damage` counts (the disk tier's recovery, `damage_counts()`), in a stable
# order. Every one but the last three means entries that
# cannot be delivered or a store that cannot vouch for what it holds (`ok` is False).
DAMAGE_KEYS = (
    "entries_damaged",  # in damaged ranges of live segments: never delivered
    "entries_missing",  # lost to truncation, plus those of missing segments whose count is known
    "entries_quarantined",  # in segments quarantined whole: no keys to deliver them under
    "segments_damaged",  # live segments with damage (their good entries are delivered)
    "segments_missing",  # the store log holds them, the disk does not
    "segments_missing_count_unknown",  # of those, still open when last recorded: count unknown
    "segments_quarantined",  # moved to quarantine/ by this recovery
    "strays",  # files or directories under segments/ that do not parse
    "catalog_problems",  # damaged store log records, or no store log although segments exist
    "torn_tails",  # not a failure: leftovers of writes that were never acknowledged
    "entries_in_torn_tails",  # not a failure: entry headers readable in those leftovers
    "state_words_repaired",  # not a failure: entries delivered (again) as live
    "quarantine_files",  # not a failure of this start: files earlier damage left in quarantine/
)
# The keys above that do not make a store damaged: repairs, and what earlier damage left in
# quarantine/ (named again at every start, until an operator removes it; `verify` fails).
REPAIR_KEYS = ("torn_tails", "entries_in_torn_tails", "state_words_repaired", "quarantine_files")
# The kinds that count stored entries no consumer can be given.
UNDELIVERABLE_KEYS = ("entries_damaged", "entries_missing", "entries_quarantined")

@dataclass(frozen=True, slots=True)
class Export:
    """How pipeline.reporting.metrics exports a field. Empty strings mean the field's own: its name,
    its help, its value. `label`: the field is a mapping (or a record of counters) exported
    as one family with this label, one sample per key."""

    kind: str
    name: str = ""
    help: str = ""
    value: str = ""  # a derived figure exported instead of the field (a property's name)
    label: str = ""

    def read(self, record: object) -> Any:
        """The exported value of `record` (a dotted path for the fields of inline records)."""
        value = record
        for part in self.value.split("."):
            value = getattr(value, part)
        return value


def _doc(help_text: str, export: Export | None = None, *, default: Any = MISSING, factory: Any = MISSING,
         wire: str = "", inline: bool = False) -> Any:
    """A field with its meaning and, where it is exported, how. `wire`: its key on the wire
    when not its name; `inline`: a record whose fields sit in the enclosing wire object."""
    return field(default=default, default_factory=factory,
                 metadata={"help": help_text, "export": export, "wire": wire, "inline": inline})


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, None when the denominator is not positive (nothing measured):
    a report must not show 0 % or divide by zero for a run that never did the thing."""
    return numerator / denominator if denominator > 0 else None


def padding_efficiency(prompt_tokens: int, padded_tokens: int) -> float | None:
    """Real tokens / padded tokens."""
    return ratio(prompt_tokens, padded_tokens)


def cache_hit_rate(hit_tokens: int, cacheable_tokens: int, compulsory_miss_tokens: int) -> float | None:
    """Hits inside the cacheable prefix / the cacheable tokens a warm cache could have hit."""
    return ratio(hit_tokens, cacheable_tokens - compulsory_miss_tokens)


def prefix_reuse(hit_tokens: int, prompt_tokens: int) -> float | None:
    """Cache-hit tokens / prompt tokens: the share of the input the prefix cache served,
    what the Mooncake paper calls the cache ratio (comparable across systems, whatever
    prefix each declares cacheable)."""
    return ratio(hit_tokens, prompt_tokens)


@dataclass(frozen=True, slots=True)
class ConsumerWork:
    """What a consumer reported doing: one completion's `results` (pipeline.consumer.process
    `run_batch`: items by status, then its engine's counters over the batch), or their sum
    over its completions. Every field is a counter the consumer must send."""

    items_ok: int = _doc("Items the consumer answered", Export(COUNTER), default=0)
    items_too_long: int = _doc("Items the consumer refused as longer than its max input length", Export(COUNTER),
                               default=0)
    items_corrupt: int = _doc("Items the consumer found corrupt", Export(COUNTER), default=0)
    items_error: int = _doc("Items the consumer's engine failed (answered with its message)", Export(COUNTER),
                            default=0)
    items_cancelled: int = _doc("Items the consumer answered without running them: their owner ended (a cancelled "
                                "batch)", Export(COUNTER), default=0)
    prompt_tokens: int = _doc("Prompt tokens the consumer processed", Export(COUNTER), default=0)
    padded_tokens: int = _doc("Tokens of the consumer's batches, padding included", Export(COUNTER), default=0)
    cacheable_tokens: int = _doc("Prompt tokens inside a declared cacheable prefix", Export(COUNTER), default=0)
    cache_hit_tokens: int = _doc("Prompt tokens served from the prefix cache", Export(COUNTER), default=0)
    # The consumer sends the raw hits here where its engine does not split them (process.py).
    cacheable_hit_tokens: int = _doc("Cacheable prefix tokens served from the prefix cache", Export(COUNTER),
                                     default=0)
    compulsory_miss_tokens: int = _doc("Cacheable tokens of each shape's first item (a miss no order avoids)",
                                       Export(COUNTER), default=0)
    output_tokens: int = _doc("Tokens the consumer generated", Export(COUNTER), default=0)
    # The engine's own prefix-cache counters beside ours over exactly the same requests
    # (taken when nothing ran: pipeline/consumer/engines/base.py `check_totals`); zero for
    # an engine without counters of its own (sim). The two sides must agree.
    engine_prefix_cache_queries: int = _doc("Prompt tokens the engine's own counter saw (vLLM's prefix_cache_queries)",
                                            Export(COUNTER), default=0)
    engine_prefix_cache_hits: int = _doc("Prompt tokens the engine's own counter served from its cache "
                                         "(vLLM's prefix_cache_hits)", Export(COUNTER), default=0)
    engine_checked_prompt_tokens: int = _doc("Prompt tokens we counted over the requests the engine's counters "
                                             "cover", Export(COUNTER), default=0)
    engine_checked_cache_hit_tokens: int = _doc("Cache-hit tokens we counted over the requests the engine's "
                                                "counters cover", Export(COUNTER), default=0)
    # Version 3. An int of nanoseconds, so sums are exact; exported in seconds (busy_s).
    busy_ns: int = _doc("Nanoseconds the consumer's engine was busy running its batches",
                        Export(COUNTER, name="busy_seconds", help="Seconds the consumer's engine was busy running "
                               "its batches", value="busy_s"), default=0)

    @classmethod
    def from_results(cls, results: object) -> ConsumerWork:
        """The `results` of a `complete` message: ProtocolError naming a counter that is
        missing, unknown or not an integer.
        NOTE: the well-formed message takes a fast path (one key-set comparison and a type
        check per value): the general decoder cost 11.4 us a completion against 1.0 us for
        the dict sum it replaced, about 3% of the broker's throughput at 64-item batches
        (the flood of `pipeline bench e2e`). Anything else goes through the decoder, which names
        what is wrong."""
        if type(results) is dict and results.keys() == _WORK_KEYS and all(type(v) is int for v in results.values()):
            return cls(**results)
        return _decode_record(cls, results, "complete: results")

    def __add__(self, other: ConsumerWork) -> ConsumerWork:
        return ConsumerWork(*[getattr(self, name) + getattr(other, name) for name in _WORK_NAMES])

    @property
    def padding_efficiency(self) -> float | None:
        return padding_efficiency(self.prompt_tokens, self.padded_tokens)

    @property
    def cache_hit_rate(self) -> float | None:
        """Hits inside the cacheable prefix over the cacheable tokens less compulsory misses
        (the hits a perfect order could get)."""
        return cache_hit_rate(self.cacheable_hit_tokens, self.cacheable_tokens, self.compulsory_miss_tokens)

    @property
    def prefix_reuse(self) -> float | None:
        """Every cache hit over the prompt tokens (`prefix_reuse`), beside the hit rate."""
        return prefix_reuse(self.cache_hit_tokens, self.prompt_tokens)

    @property
    def busy_s(self) -> float:
        return self.busy_ns / NS_PER_S

    @property
    def engine_disagrees(self) -> bool:
        """Whether the engine's own prefix-cache counters differ from ours over the same
        requests (a bug in our accounting or in the engine's: a failure, never a footnote)."""
        return (self.engine_prefix_cache_queries, self.engine_prefix_cache_hits) != (
            self.engine_checked_prompt_tokens, self.engine_checked_cache_hit_tokens)



# ConsumerWork's fields, in order (positional construction) and as the keys of `results`.
_WORK_NAMES = tuple(f.name for f in fields(ConsumerWork))
_WORK_KEYS = frozenset(_WORK_NAMES)

@dataclass(frozen=True, slots=True)
class ConsumerTotalsRow:
    """One consumer's totals over this broker's life, by name (kept across reconnects)."""

    connected: bool = _doc("Whether the consumer is registered now",
                           Export(GAUGE, help="1 while the consumer is registered"), default=False)
    batches: int = _doc("Batches the consumer completed", Export(COUNTER), default=0)
    work: ConsumerWork = _doc("What it reported doing, summed over its completions", factory=ConsumerWork,
                              inline=True)
    # Not a metric: the model-wide shape_switches counter has them by reason, and a second
    # label (consumer and reason) on one counter is more than the exporter's rows take.
    switches: dict[str, int] = _doc("Its shape switches, by reason (the current shape is per consumer)",
                                    factory=dict)
    shapes_served: int = _doc("Distinct shapes it was handed batches of (estimated past 16,384)",
                              Export(GAUGE), default=0)
    split_prefix_tokens: int = _doc(
        "Prefix tokens of shapes it started after another consumer's cache had them (split shapes)",
        Export(COUNTER), default=0)
    compulsory_prefix_tokens: int = _doc(
        "Prefix tokens first referenced by its cache, as the broker counts them from the shapes' prefix "
        "lengths and chains (pipeline/broker/firstrefs.py)", Export(COUNTER), default=0)


@dataclass(frozen=True, slots=True)
class ConnectedConsumer:
    """A consumer registered now: its connection's id, its process, its credit and what it
    holds, and its contract."""

    consumer_id: int = _doc("Its connection's ConsumerId (a reconnect gets a new one)", wire="id")
    pid: int = _doc("Its process id, as it registered")
    credit: int = _doc("Batches it asked for and was not handed yet")
    batches_held: int = _doc("Batches handed to it and not completed")
    model: int = _doc("The model it serves")
    max_batch_items: int = _doc("Its contract: items a batch holds at most")
    max_batch_tokens: int = _doc("Its contract: padded tokens a batch holds at most")
    max_input_len: int = _doc("Its contract: the longest item it runs")


@dataclass(frozen=True, slots=True)
class TopShape:
    """One of the shapes with the most queued tokens, or the row summing the rest
    (signature OTHER_SHAPE, model -1): bounded output and bounded metric labels."""

    model: int = _doc("The shape's model (-1 on the other row)")
    signature: str = _doc("The shape's signature in 16 hex digits, POOL_SHAPE or OTHER_SHAPE")
    lanes: int = _doc("Length lanes this shape holds", Export(GAUGE))
    queued_items: int = _doc("Items queued in this shape's lanes", Export(GAUGE))
    queued_tokens: int = _doc("Tokens queued in this shape's lanes", Export(GAUGE))
    pending_items: int = _doc("Items of this shape routed and not yet completed", Export(GAUGE))

    @property
    def is_other(self) -> bool:
        return self.signature == OTHER_SHAPE


@dataclass(frozen=True, slots=True)
class LaneEvents:
    """Lane counters summed over shapes, retired ones included (SPEC §2 "Count")."""

    opened: int = _doc("Lanes opened", Export(COUNTER), default=0)
    reused: int = _doc("Items that joined an existing lane", Export(COUNTER), default=0)
    force_fits: int = _doc("Items put in a lane they do not fit (no lane id left)", Export(COUNTER), default=0)
    raises: int = _doc("Lanes whose length bound was raised", Export(COUNTER), default=0)
    quiesced: int = _doc("Lanes that stopped taking items", Export(COUNTER), default=0)
    released: int = _doc("Lanes released once drained", Export(COUNTER), default=0)
    revived: int = _doc("Quiescing lanes taken back into service (every lane id held)", Export(COUNTER), default=0)
    restored: int = _doc("Lanes brought back after a restart", Export(COUNTER), default=0)
    max_in_use: int = _doc("Sum over shapes of each shape's peak number of lanes", Export(GAUGE), default=0)


@dataclass(frozen=True, slots=True)
class ProducerRow:
    """A producer registered now: what the broker ingested of its ring."""

    frames: int = _doc("Frames ingested from its ring")
    items: int = _doc("Items ingested from its ring")


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    """The broker's counters, levels and rows at one moment (`Broker.status()`). Counters
    cover this broker process's life; a restart (a new `generation`) starts them again. The
    defaults are a broker that has done nothing yet."""

    # --- flow: items and tokens through the broker
    items_received: int = _doc(
        "Items stored from producer rings (the recovered ones are items_recovered)",
        Export(COUNTER, help="Items received, recovered ones included", value="items_received_all"), default=0)
    tokens_received: int = _doc(
        "Tokens of the items received",
        Export(COUNTER, help="Tokens received, recovered ones included", value="tokens_received_all"), default=0)
    items_recovered: int = _doc("Items recovered from disk at start (also in items_received)", Export(COUNTER),
                                default=0)
    tokens_recovered: int = _doc("Tokens of the items recovered from disk at start", Export(COUNTER), default=0)
    items_adopted: int = _doc("Items stored from producer rings an earlier run left (also received)",
                              Export(COUNTER), default=0)
    items_routed: int = _doc("Items handed to consumers (a redelivered item counts again)", Export(COUNTER),
                             default=0)
    tokens_routed: int = _doc("Tokens of the items routed, without padding", Export(COUNTER), default=0)
    items_completed: int = _doc("Items whose completion the broker recorded", Export(COUNTER), default=0)
    tokens_completed: int = _doc("Tokens of the items completed", Export(COUNTER), default=0)
    items_returned: int = _doc("Items returned to their queue for redelivery", Export(COUNTER), default=0)
    tokens_returned: int = _doc("Tokens of the items returned to their queue for redelivery", Export(COUNTER),
                                default=0)
    duplicate_items: int = _doc("Items received again with an id already stored (dropped)", Export(COUNTER),
                                default=0)
    # --- what the broker holds now
    backlog_items: int = _doc("Items stored and not yet routed", Export(GAUGE), default=0)
    backlog_tokens: int = _doc("Tokens of the items stored and not yet routed", Export(GAUGE), default=0)
    pending_items: int = _doc("Items routed and not yet completed", Export(GAUGE), default=0)
    # --- shapes and lanes
    shapes: int = _doc("(model, shape) pairs the broker holds items of, in lanes of their own or in the solitary "
                       "pool", Export(GAUGE), default=0)
    shapes_seen: int = _doc("Distinct (model, shape) pairs given items since the broker started, idle and pooled "
                            "ones included (estimated within about 1% past 16,384)", Export(COUNTER), default=0)
    lanes_in_use: int = _doc("Length lanes open now", Export(GAUGE), default=0)
    pool_items: int = _doc("Items stored in a model's solitary pool: of shapes that shared nothing with another "
                           "live shape, batched together", Export(COUNTER), default=0)
    pool_shapes: int = _doc("Shapes whose items went to the solitary pool", Export(COUNTER), default=0)
    # --- sync_interval_s at durability `process` (pipeline/broker/periodic_sync.py)
    periodic_syncs: int = _doc("syncfs calls of the data directory's filesystem (sync_interval_s)", Export(COUNTER),
                               default=0)
    periodic_sync_failures: int = _doc("syncfs calls that failed (a writeback error: logged, not retried)",
                                       Export(COUNTER), default=0)
    periodic_sync_max_s: float = _doc("The longest syncfs: the loss bound is sync_interval_s plus twice this",
                                      Export(GAUGE), default=0.0)
    lanes: LaneEvents = _doc("Lane events summed over shapes, by event",
                             Export(COUNTER, name="lane_events", label="event"), factory=LaneEvents)
    switches: dict[str, int] = _doc("Changes of a model's current shape, by reason",
                                    Export(COUNTER, name="shape_switches", label="reason"), factory=dict)
    top_shapes: tuple[TopShape, ...] = _doc("The shapes with the most queued tokens, then one row for the rest",
                                            factory=tuple)
    # --- batches routed
    batches_routed: int = _doc("Batches handed to consumers", Export(COUNTER), default=0)
    padded_tokens_routed: int = _doc("Tokens of the batches routed, padding included", Export(COUNTER), default=0)
    batch_fill_sum: float = _doc(
        "Sum over the batches routed of each one's fill: its binding share of its consumer's contract, "
        "max(items / max_batch_items, padded tokens / max_batch_tokens), at most 1", default=0.0)
    # --- compulsory misses: every consumer's cache against one cache for the whole model
    compulsory_prefix_tokens: int = _doc(
        "Prefix tokens first referenced by the whole model's cache (one cache for every consumer of a "
        "model, summed over models): the compulsory misses that remain whatever splits the shapes",
        Export(COUNTER, name="model_compulsory_prefix_tokens"), default=0)
    compulsory_uncounted_starts: int = _doc(
        "Shapes consumers started that the compulsory counts left out (past their memory limit): the "
        "counts are then lower bounds", Export(COUNTER), default=0)
    lineage_chains_unrecorded: int = _doc(
        "Declared chains the lineage file could not keep (past its limit, or a full disk): those shapes "
        "come back as chains of one after a restart", Export(COUNTER), default=0)
    # --- peers
    consumers: dict[str, ConnectedConsumer] = _doc("The consumers registered now, by name", factory=dict)
    per_consumer: dict[str, ConsumerTotalsRow] = _doc("Every consumer's totals over this broker's life, by name",
                                                      factory=dict)
    # Keyed by the ProducerId in decimal: JSON object keys are strings.
    producers: dict[str, ProducerRow] = _doc("The producers registered now, by producer id", factory=dict)
    consumers_lost: int = _doc("Consumers dropped for a closed connection or missed heartbeats", Export(COUNTER),
                               default=0)
    peers_refused: int = _doc("Connections refused: a malformed message, another user, past a limit",
                              Export(COUNTER), default=0)
    peers_shed: int = _doc("Connections that never registered, closed: idle too long, or too many",
                           Export(COUNTER), default=0)
    # --- the broker process and its store
    pid: int = _doc("The broker's process id", default=0)
    generation: int = _doc("Broker generation on this data directory (one more at each start)", Export(GAUGE),
                           default=0)
    uptime_s: float = _doc("Seconds since this broker process started", Export(GAUGE, name="uptime_seconds"),
                           default=0.0)
    stalls: int = _doc("Gaps in the broker's loop long enough to be its own stall (paused, starved)",
                       Export(COUNTER), default=0)
    stalled_s: float = _doc("Seconds those stalls lasted, summed", default=0.0)
    disk_full: bool = _doc("The disk tier refuses writes for lack of space: ingest is paused",
                           Export(GAUGE, help="1 while the disk tier refuses writes for lack of space"), default=False)
    store_damage: dict[str, int] = _doc(
        "What recovery found in the store that it could not deliver or had to repair, by kind "
        "(named in the broker's log)", Export(GAUGE, label="kind"), factory=dict)

    @classmethod
    def from_wire(cls, wire: object, *, version: object) -> BrokerStatus:
        """The record of a status reply's `counters` sent as `version`. ProtocolError for
        another version, and for a field missing, unknown or of the wrong type, naming it."""
        if type(version) is not int or version != STATUS_VERSION:
            raise ProtocolError(f"status_reply: version {version!r:.40} is not {STATUS_VERSION}, the only one this "
                                f"client reads: the broker runs another release of shape-broker (use that "
                                f"release's pipeline command with it)")
        return _decode_record(cls, wire, "status_reply: counters")

    def to_wire(self) -> dict[str, Any]:
        """The plain JSON-able form: objects for records and mappings, arrays for rows."""
        return _encode(self)

    @property
    def items_received_all(self) -> int:
        """Received, recovered items included: SPEC's received = routed = completed holds
        across restarts only with them in (the report's and the metric's items_received)."""
        return self.items_received + self.items_recovered

    @property
    def tokens_received_all(self) -> int:
        return self.tokens_received + self.tokens_recovered

    @property
    def items_unfinished(self) -> int:
        """Items the broker holds that are not completed: queued, or routed and pending."""
        return self.backlog_items + self.pending_items

    @property
    def consumers_compulsory_prefix_tokens(self) -> int:
        """The consumers' first-referenced prefix tokens, summed: each consumer's cache pays
        for every prefix it runs, so a prefix split across two is paid twice."""
        return sum(row.compulsory_prefix_tokens for row in self.per_consumer.values())

    @property
    def split_cost_tokens(self) -> int:
        """What splitting shapes across consumers cost: the consumers' compulsory prefix
        tokens, summed, less the whole model's (0 when every prefix ran on one consumer)."""
        return self.consumers_compulsory_prefix_tokens - self.compulsory_prefix_tokens

    @property
    def shape_switches(self) -> int:
        return sum(self.switches.values())

    @property
    def mean_batch_fill(self) -> float | None:
        """The mean fill of the batches routed; None before the first one."""
        return ratio(self.batch_fill_sum, self.batches_routed)

    @property
    def routed_padding_efficiency(self) -> float | None:
        """Tokens routed over padded tokens routed; None before the first batch."""
        return padding_efficiency(self.tokens_routed, self.padded_tokens_routed)


def exports(record: type, kind: str) -> tuple[Export, ...]:
    """The fields of `record` exported as `kind`, in field order, with name, help and value
    filled in (the fields of an inline record follow, their value a dotted path)."""
    found: list[Export] = []
    for f in fields(record):
        if f.metadata["inline"]:
            found += [replace(e, value=f"{f.name}.{e.value}") for e in exports(_hints(record)[f.name], kind)]
            continue
        export = f.metadata["export"]
        if export is not None and export.kind == kind:
            found.append(replace(export, name=export.name or f.name, help=export.help or f.metadata["help"],
                                 value=export.value or f.name))
    return tuple(found)


@functools.cache
def _hints(record: type) -> dict[str, Any]:
    return get_type_hints(record)


@functools.cache
def _wire_keys(record: type) -> frozenset[str]:
    """Every key of the record's wire object, its inline records' included."""
    keys: set[str] = set()
    for f in fields(record):
        keys |= _wire_keys(_hints(record)[f.name]) if f.metadata["inline"] else {f.metadata["wire"] or f.name}
    return frozenset(keys)


def _encode(value: Any) -> Any:
    if is_dataclass(value):
        wire: dict[str, Any] = {}
        for f in fields(value):
            encoded = _encode(getattr(value, f.name))
            if f.metadata["inline"]:
                wire.update(encoded)
            else:
                wire[f.metadata["wire"] or f.name] = encoded
        return wire
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _decode_record(record: type, value: object, where: str, inline: bool = False) -> Any:
    """A record from its wire object, every field checked; `inline`: the object also holds
    the enclosing record's fields (checked there)."""
    wire = _expect(value, dict, where)
    hints = _hints(record)
    values = {}
    for f in fields(record):
        if f.metadata["inline"]:
            values[f.name] = _decode_record(hints[f.name], wire, where, inline=True)
            continue
        key = f.metadata["wire"] or f.name
        if key not in wire:
            raise ProtocolError(f"{where}: field {key!r} is missing")
        values[f.name] = _decode(hints[f.name], wire[key], f"{where}.{key}")
    unknown = [] if inline else sorted(map(str, wire.keys() - _wire_keys(record)))
    if unknown:
        raise ProtocolError(f"{where}: unknown field {unknown[0]!r:.80} ({len(unknown)} unknown in all)")
    return record(**values)


def _decode(kind: Any, value: object, where: str) -> Any:
    if is_dataclass(kind):
        return _decode_record(kind, value, where)
    origin, args = get_origin(kind), get_args(kind)
    if origin is dict:
        return {_expect(key, str, f"{where} key"): _decode(args[1], item, f"{where}[{key!r:.80}]")
                for key, item in _expect(value, dict, where).items()}
    if origin is tuple:
        return tuple(_decode(args[0], item, f"{where}[{k}]") for k, item in enumerate(_expect(value, list, where)))
    if kind is float:
        return float(_expect(value, (int, float), where))
    return _expect(value, kind, where)


def _expect(value: object, kind: type | tuple[type, ...], where: str) -> Any:
    """`value` if it is of `kind` (bool only where bool is asked for: JSON's true is no 1)."""
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
    shown = f"a {type(value).__name__} of {len(value)}" if isinstance(value, (dict, list)) else f"{value!r:.80}"
    raise ProtocolError(f"{where} must be {names}, got {shown}")
