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
    workload = load_launch_workload(LaunchSettings(workload="demo-chat", items=40, workload_seed=3), vocab_size=32_000)
    assert len(workload) == 40 and workload.source.startswith("demo-chat(items=40, seed=3")
    assert [i.payload for i in workload] == [i.payload for i in demo_chat_workload(40, seed=3)]
    assert len(named_workload("demo", 12, seed=1)) == 12
    assert len(named_workload("demo-chat", default_items=9)) == 9


# ----------------------------------------------------------------------------- demo-template


def test_template_shapes_components_and_popularity():
    from pipeline.producer.demos import (
        DEMO_TEMPLATE_COMPONENT_MAX_TOKENS,
        DEMO_TEMPLATE_COMPONENT_MIN_TOKENS,
        DEMO_TEMPLATE_GROUP,
        DEMO_TEMPLATE_SHAPES,
        DEMO_TEMPLATE_USER_MAX_TOKENS,
        demo_template_workload,
    )
    workload = demo_template_workload(5000, seed=2)
    items = list(workload)
    assert len(items) == 5000 and workload.total_tokens == sum(i.length for i in items)
    by_template: dict[int, list] = defaultdict(list)
    for k, item in enumerate(items):
        kind, template, index = item.payload.decode().split("-")
        assert kind == "template" and int(index) == k
        by_template[int(template)].append(item)
    assert set(by_template) <= set(range(DEMO_TEMPLATE_SHAPES)) and len(by_template) >= 60
    for template, group in by_template.items():
        assert len({i.signature for i in group}) == 1  # one shape per template
        assert all(len(i.components) == 2 for i in group)
        for c in group[0].components:
            assert DEMO_TEMPLATE_COMPONENT_MIN_TOKENS <= len(c) <= DEMO_TEMPLATE_COMPONENT_MAX_TOKENS
    assert len({i.signature for i in items}) == len(by_template)
    # Templates of a group share their system prompt; of different groups, not.
    firsts = {t: g[0].components[0].tobytes() for t, g in by_template.items()}
    for a in firsts:
        for b in firsts:
            assert (firsts[a] == firsts[b]) == (a // DEMO_TEMPLATE_GROUP == b // DEMO_TEMPLATE_GROUP)
    # Zipf popularity: the hottest template far above the median one.
    counts = sorted((len(g) for g in by_template.values()), reverse=True)
    assert counts[0] > 8 * counts[len(counts) // 2]
    users = np.array([len(i.suffix) for i in items])
    assert users.min() >= 1 and users.max() <= DEMO_TEMPLATE_USER_MAX_TOKENS and 80 < np.median(users) < 200
    times = [i.timestamp_ms for i in items]
    assert times[0] == 0.0 and times == sorted(times)


def test_template_deterministic_seeded_and_reachable_by_name():
    from pipeline.producer.demos import demo_template_workload

    def fingerprint(workload):
        return [(i.payload, i.tokens.tobytes(), i.signature, i.timestamp_ms) for i in workload]
    assert fingerprint(demo_template_workload(200, seed=4)) == fingerprint(demo_template_workload(200, seed=4))
    assert fingerprint(demo_template_workload(200, seed=4)) != fingerprint(demo_template_workload(200, seed=5))
    assert all(int(i.tokens.max()) < 50 for i in demo_template_workload(50, seed=4, vocab_size=50))
    workload = load_launch_workload(LaunchSettings(workload="demo-template", items=30, workload_seed=4), vocab_size=32_000)
    assert [i.payload for i in workload] == [i.payload for i in demo_template_workload(30, seed=4)]
    assert len(named_workload("demo-template", default_items=7)) == 7


@pytest.mark.parametrize("args", [{"items": 0}, {"items": 5, "seed": -1}, {"items": 5, "seed": 1 << 63},
                                  {"items": 5, "vocab_size": 0}])
def test_template_bad_arguments_are_refused(args):
    from pipeline.producer.demos import demo_template_workload
    with pytest.raises(ValueError):
        demo_template_workload(**args)


def test_template_at_a_smaller_scale_keeps_its_bounds_groups_and_popularity():
    from pipeline.producer.demos import TemplateScale, demo_template_workload

    scale = TemplateScale(shapes=12, group=3, component_min_tokens=10, component_max_tokens=40,
                          user_median_tokens=4, user_max_tokens=9)
    items = list(demo_template_workload(3000, seed=1, scale=scale))
    by_template: dict[int, list] = defaultdict(list)
    for item in items:
        by_template[int(item.payload.decode().split("-")[1])].append(item)
    assert set(by_template) == set(range(12))
    for template, group in by_template.items():
        assert all(10 <= len(c) <= 40 for c in group[0].components)
        assert group[0].components[0].tobytes() == by_template[template // 3 * 3][0].components[0].tobytes()
    assert len({g[0].components[0].tobytes() for g in by_template.values()}) == 4
    assert max(len(i.suffix) for i in items) <= 9 and max(i.length for i in items) <= scale.max_prompt_tokens
    counts = sorted((len(g) for g in by_template.values()), reverse=True)
    assert counts[0] > 4 * counts[len(counts) // 2]


@pytest.mark.parametrize("changes", [{"shapes": 10, "group": 4}, {"component_min_tokens": 50, "component_max_tokens": 40},
                                     {"user_max_tokens": 0}, {"shapes": True}, {"group": 2.0}])
def test_template_bad_scales_are_refused(changes):
    from pipeline.producer.demos import TemplateScale, demo_template_workload

    scale = TemplateScale(**{**dict(shapes=8, group=4, component_min_tokens=10, component_max_tokens=40), **changes})
    assert scale.problems()
    with pytest.raises(ValueError, match="scale"):
        demo_template_workload(5, scale=scale)
    assert not TemplateScale().problems()
