"""Where segments live under a data directory: the one definition of their names, their keys'
limits, and the broker's state file."""

from __future__ import annotations

import os
import re

from pipeline.wire.errors import SegmentNameError

# Where segments live under a data directory (the whole tree is documented in
# pipeline.storage.paths): names sort by model, shape, lane and sequence.
#
#     SEGMENTS_DIR/m{model:05d}/s{signature:016x}/l{lane:04d}-{segment_seq:010d}.seg
#
# This is the one definition of the names: `segment_relpath` formats them and the `parse_*`
# functions below read them back, and the limits are what the fixed-width fields hold. A key
# past its limit would make a name the parser does not read back (m123456), and its items
# would be stored and then skipped at restart: so every limit is checked where a segment is
# named (`segment_relpath` raises SegmentNameError) and exported for the edges (producers,
# registration, configuration) to check first.
SEGMENTS_DIR = "segments"
SEGMENT_SUFFIX = ".seg"
# A segment journal of an earlier release: its path plus this suffix (recovery refuses a
# store holding one beside its segment: its completions are in the store log now).
SEGMENT_JOURNAL_SUFFIX = ".journal"
# The broker's state file in a data directory (pipeline.broker.service.BrokerState: JSON with
# the next producer id and the start count, "generation"): a witness that a broker ran here,
# so that a store whose log and segments are both gone is not taken for a fresh one.
BROKER_STATE_NAME = "broker-state.json"
MODEL_ID_DIGITS = 5
LANE_ID_DIGITS = 4
SEGMENT_SEQ_DIGITS = 10
SIGNATURE_HEX_DIGITS = 16
# Model ids a model directory name holds: m00000 .. m99999. Every `max_models` setting
# (producer limits, the broker's configuration) is at most this.
MODEL_ID_LIMIT = 10**MODEL_ID_DIGITS
# Model ids index per-model broker state; one node serves a handful, 1,024 leaves room. The
# default of both the producer's and the broker's `max_models`.
DEFAULT_MAX_MODELS = 1024
# Lane ids (per shape) a segment file name holds: l0000 .. l9999 (LaneConfig.max_lanes).
LANE_ID_LIMIT = 10**LANE_ID_DIGITS
# Segment sequences a file name holds (one counter for the whole store): 10 billion
# segments, never reached.
SEGMENT_SEQ_LIMIT = 10**SEGMENT_SEQ_DIGITS
# Signatures are unsigned 64-bit: 16 hex digits always hold them.
SIGNATURE_LIMIT = 16**SIGNATURE_HEX_DIGITS

_MODEL_DIR_RE = re.compile(rf"^m(\d{{{MODEL_ID_DIGITS}}})$")
_SHAPE_DIR_RE = re.compile(rf"^s([0-9a-f]{{{SIGNATURE_HEX_DIGITS}}})$")
_SEGMENT_FILE_RE = re.compile(rf"^l(\d{{{LANE_ID_DIGITS}}})-(\d{{{SEGMENT_SEQ_DIGITS}}}){re.escape(SEGMENT_SUFFIX)}$")


def check_segment_keys(model: int, signature: int, lane: int, segment_seq: int) -> None:
    """SegmentNameError unless every key fits its field of the segment file names."""
    for what, value, limit in (("model id", model, MODEL_ID_LIMIT), ("lane id", lane, LANE_ID_LIMIT),
                               ("segment sequence", segment_seq, SEGMENT_SEQ_LIMIT),
                               ("signature", signature, SIGNATURE_LIMIT)):
        if not 0 <= value < limit:
            raise SegmentNameError(
                f"{what} {value} does not fit a segment file name: {what}s are 0 .. {limit - 1} "
                f"({SEGMENTS_DIR}/m{{model:05d}}/s{{signature:016x}}/l{{lane:04d}}-{{seq:010d}}{SEGMENT_SUFFIX})"
            )


def segment_relpath(model: int, signature: int, lane: int, segment_seq: int) -> str:
    """A segment's path below SEGMENTS_DIR: m{model}/s{signature}/l{lane}-{seq}.seg.
    SegmentNameError for a key past its limit (see above)."""
    if not (0 <= model < MODEL_ID_LIMIT and 0 <= lane < LANE_ID_LIMIT and 0 <= segment_seq < SEGMENT_SEQ_LIMIT
            and 0 <= signature < SIGNATURE_LIMIT):
        check_segment_keys(model, signature, lane, segment_seq)  # raises, naming the value
    return os.path.join(
        f"m{model:05d}", f"s{signature:016x}", f"l{lane:04d}-{segment_seq:010d}{SEGMENT_SUFFIX}"
    )


def parse_model_dir(name: str) -> int | None:
    """The model id a model directory name holds (m00042 -> 42), or None if it is not one."""
    match = _MODEL_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def parse_shape_dir(name: str) -> int | None:
    """The signature a shape directory name holds, or None if it is not one."""
    match = _SHAPE_DIR_RE.match(name)
    return int(match.group(1), 16) if match else None


def parse_segment_file(name: str) -> tuple[int, int] | None:
    """(lane id, segment sequence) a segment file name holds, or None if it is not one."""
    match = _SEGMENT_FILE_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_segment_relpath(relpath: str) -> tuple[int, int, int, int] | None:
    """(model, signature, lane, segment_seq) of a path that ends in a segment's three name
    components (below SEGMENTS_DIR or the quarantine), or None."""
    parts = os.path.normpath(relpath).split(os.sep)
    if len(parts) < 3:
        return None
    model, signature, name = parse_model_dir(parts[-3]), parse_shape_dir(parts[-2]), parse_segment_file(parts[-1])
    if model is None or signature is None or name is None:
        return None
    return model, signature, name[0], name[1]
