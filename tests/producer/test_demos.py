"""demo-chat: chained turns (each prompt extends the one before, its components one more),
determinism, arrival order (turns of a conversation in order, interleaved with others),
exact item counts; and `named_workload` as `pipeline launch` uses it."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from pipeline.cli.launch import load_launch_workload
from pipeline.producer.demos import DEMO_CHAT_MAX_TURNS, DEMO_CHAT_SYSTEMS, demo_chat_workload, named_workload
from pipeline.runtime.settings import LaunchSettings


def conversations(items) -> dict[int, list[tuple[int, object]]]:
    """Conversation -> [(turn, item)] in arrival order, from the payloads chat-C-T."""
    out: dict[int, list[tuple[int, object]]] = defaultdict(list)
    for item in items:
        _, conv, turn = item.payload.decode().split("-")
        out[int(conv)].append((int(turn), item))
    return out


@pytest.mark.parametrize("items", [1, 7, 500])
def test_turns_chain(items):
    workload = demo_chat_workload(items, seed=5)
    all_items = list(workload)
    assert len(all_items) == len(workload) == items
    assert workload.total_tokens == sum(i.length for i in all_items)
    systems = set()
    for turns in conversations(all_items).values():
        assert [t for t, _ in turns] == list(range(1, len(turns) + 1))  # in order, none missing
        assert len(turns) <= DEMO_CHAT_MAX_TURNS
        systems.add(turns[0][1].components[0].tobytes())
        for (_, earlier), (_, later) in zip(turns, turns[1:]):
            assert len(later.components) == len(earlier.components) + 1
            for a, b in zip(earlier.components, later.components):
                assert np.array_equal(a, b)
            # the new component: the earlier user message, then a reply to it
            added = later.components[-1]
            assert np.array_equal(added[:len(earlier.suffix)], earlier.suffix) and len(added) > len(earlier.suffix)
            assert np.array_equal(later.tokens[:earlier.length], earlier.tokens)
        assert all(len(item.components) == turn for turn, item in turns)
    assert len(systems) <= DEMO_CHAT_SYSTEMS


def test_arrival_order_interleaves_conversations():
    items = list(demo_chat_workload(2000, seed=1))
    times = [item.timestamp_ms for item in items]
    assert times[0] == 0.0 and times == sorted(times)
    by_conv = conversations(items)
    position = {id(item): k for k, item in enumerate(items)}
    gaps = [position[id(b)] - position[id(a)] for turns in by_conv.values()
            for (_, a), (_, b) in zip(turns, turns[1:])]
    assert min(gaps) >= 1 and np.median(gaps) > 5  # other conversations' turns come between
    assert len({len(t) for t in by_conv.values()}) > 3  # conversations of several lengths
    assert len({item.signature for item in items}) > len(by_conv)  # later turns: shapes of their own


def test_deterministic_and_seeded():
    def fingerprint(workload):
        return [(i.payload, i.tokens.tobytes(), i.signature, i.timestamp_ms) for i in workload]
    assert fingerprint(demo_chat_workload(300, seed=9)) == fingerprint(demo_chat_workload(300, seed=9))
    assert fingerprint(demo_chat_workload(300, seed=9)) != fingerprint(demo_chat_workload(300, seed=10))
    small = demo_chat_workload(300, seed=9, vocab_size=50)
    assert all(int(i.tokens.max()) < 50 for i in small)


@pytest.mark.parametrize("args", [{"items": 0}, {"items": 5, "seed": -1}, {"items": 5, "seed": 1 << 63},
                                  {"items": 5, "vocab_size": 0}])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError):
        demo_chat_workload(**args)


def test_launch_picks_demo_chat_with_items_and_seed():
    workload = load_launch_workload(LaunchSettings(workload="demo-chat", items=40, seed=3), vocab_size=32_000)
    assert len(workload) == 40 and workload.source.startswith("demo-chat(items=40, seed=3")
    assert [i.payload for i in workload] == [i.payload for i in demo_chat_workload(40, seed=3)]
    assert len(named_workload("demo", 12, seed=1)) == 12
    assert len(named_workload("demo-chat", default_items=9)) == 9
