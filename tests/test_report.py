"""The run report: arithmetic from a real broker status and results files, lost and duplicate
cases, the JSON file, and the rendered tables."""

from __future__ import annotations

import copy
import io
import json
import os
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console

from pipeline.reporting.accounting import summarize_results, take_stock
from pipeline.reporting.report import (
    build_report,
    format_compact,
    format_count,
    format_percent,
    render_report,
    store_damage_note,
    write_report_json,
)
from pipeline.wire.status import BrokerStatus
from tests.support.statuses import SAMPLE as SAMPLE_STATUS  # a real status; figures below are from it
from tests.support.statuses import SAMPLE_WIRE, status_of

# In the sample, consumer c1 ran items 0..1927 and c0 items 1928..3999.
C1_ITEMS = 1928
ALL_ITEMS = 4000

REQUIRED_KEYS = {
    "items_received", "tokens_received", "items_routed", "tokens_routed", "items_completed", "tokens_completed",
    "items_empty", "duplicates", "lost", "padding_efficiency", "mean_batch_fill", "cacheable_tokens",
    "cache_hit_tokens", "cache_hit_tokens_all", "compulsory_miss_tokens", "cache_hit_rate", "shape_switches",
    "shape_switches_by_reason", "lanes", "per_consumer", "wall_s", "items_per_s", "tokens_per_s", "accounting_ok",
}
CONSUMER_KEYS = {"items", "items_ok", "items_empty", "prompt_tokens", "padded_tokens", "padding_efficiency",
                 "cacheable_tokens", "cache_hit_tokens", "compulsory_miss_tokens", "cache_hit_rate", "batches"}


def line(item_id: int, status: str = "ok", prompt_tokens: int = 395, dispatch_ns: int = 1, done_ns: int = 2) -> str:
    return json.dumps({"item_id": item_id, "batch_id": item_id // 4, "dispatch_ns": dispatch_ns, "submit_ns": 0,
                       "done_ns": done_ns,
                       "pad_to_tokens": 400, "status": status, "prompt_tokens": prompt_tokens,
                       "cached_tokens": 100, "output_tokens": 4, "output": [1, 2, 3, 4], "payload": ""})


def write_results(results_dir, per_consumer: dict[str, list[str]]) -> str:
    os.makedirs(results_dir, exist_ok=True)
    for name, lines in per_consumer.items():
        (results_dir / f"{name}.jsonl").write_text("".join(f"{text}\n" for text in lines))
    return str(results_dir)


def sample_results(tmp_path, skip: frozenset[int] = frozenset(), extra_c0: tuple[int, ...] = (),
                   too_long: frozenset[int] = frozenset()):
    """The sample run's results files (less `skip`, plus `extra_c0` duplicate lines)."""
    def lines(ids) -> list[str]:
        return [line(i, "too_long" if i in too_long else "ok") for i in ids if i not in skip]
    return summarize_results(write_results(tmp_path / "results", {
        "c1": lines(range(C1_ITEMS)), "c0": lines(range(C1_ITEMS, ALL_ITEMS)) + [line(i) for i in extra_c0]}))


def stock_of(results, published: int = ALL_ITEMS, store=(), rings=(), taken_over=()):
    """The stock of a run whose one producer (id 0: item ids 0, 1, ...) published `published`
    items and whose results are `results`."""
    ids = np.fromiter(results.item_ids, dtype=np.uint64)
    return take_stock([(0, published)], ids, np.array(store, dtype=np.uint64), np.array(rings, dtype=np.uint64),
                      np.array(taken_over, dtype=np.uint64))


def report_of(status, results, wall_s: float, **stock) -> dict:
    return build_report(status, results, wall_s=wall_s, stock=stock_of(results, **stock))


def test_report_from_the_sample_run(tmp_path):
    report = report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=2.0)
    assert REQUIRED_KEYS <= report.keys()
    for name in ("c0", "c1"):
        assert CONSUMER_KEYS <= report["per_consumer"][name].keys()
    assert (report["items_received"], report["items_routed"], report["items_completed"]) == (4000, 4000, 4000)
    assert (report["tokens_received"], report["tokens_routed"], report["tokens_completed"]) == (1580568,) * 3
    assert (report["items_empty"], report["duplicates"], report["lost"]) == (0, 0, 0)
    assert report["accounting_ok"] is True and report["broker_status_missing"] is False
    assert report["padding_efficiency"] == pytest.approx((753713 + 826855) / (770784 + 844672))
    assert report["mean_batch_fill"] == pytest.approx(63.1478271484375 / 924)
    assert report["cacheable_tokens"] == 220816 + 240416
    assert report["cache_hit_tokens"] == report["cache_hit_tokens_all"] == 218496 + 238096
    assert report["compulsory_miss_tokens"] == 2320 * 2
    # Every cacheable token but the compulsory misses hit: 456,592 / (461,232 - 4,640).
    assert report["cache_hit_rate"] == 1.0
    assert report["shape_switches"] == 20
    assert report["shape_switches_by_reason"] == {"initial": 1, "drained": 19, "starvation": 0}
    lanes = report["lanes"]
    assert (lanes["opened"], lanes["reused"], lanes["force_fits"], lanes["quiesced"], lanes["released"],
            lanes["max_in_use"]) == (923, 3077, 0, 0, 0, 923)
    assert (report["wall_s"], report["items_per_s"], report["tokens_per_s"]) == (2.0, 2000.0, 790284.0)
    c1 = report["per_consumer"]["c1"]
    assert (c1["items"], c1["items_ok"], c1["items_empty"], c1["batches"]) == (1928, 1928, 0, 463)
    assert (c1["prompt_tokens"], c1["padded_tokens"]) == (753713, 770784)
    assert c1["padding_efficiency"] == pytest.approx(753713 / 770784)
    assert (c1["cacheable_tokens"], c1["cache_hit_tokens"], c1["compulsory_miss_tokens"]) == (220816, 218496, 2320)
    assert c1["cache_hit_rate"] == pytest.approx(218496 / (220816 - 2320))
    assert report["per_consumer"]["c0"]["items"] == 2072


def test_cache_hits_beyond_the_prefix_do_not_count_in_the_rate(tmp_path):
    status = copy.deepcopy(SAMPLE_WIRE)
    status["per_consumer"]["c0"].update(cache_hit_tokens=250000, cacheable_hit_tokens=200000)
    report = report_of(status_of(status), sample_results(tmp_path), wall_s=1.0)
    assert report["cache_hit_tokens"] == 218496 + 200000
    assert report["cache_hit_tokens_all"] == 218496 + 250000
    assert report["cache_hit_rate"] == pytest.approx((218496 + 200000) / (461232 - 4640))
    assert report["per_consumer"]["c0"]["cache_hit_rate"] == pytest.approx(200000 / (240416 - 2320))


def test_prefix_reuse_is_every_hit_over_the_prompt_tokens_per_consumer_and_in_total(tmp_path):
    status = copy.deepcopy(SAMPLE_WIRE)
    status["per_consumer"]["c0"].update(cache_hit_tokens=250000, cacheable_hit_tokens=200000)
    report = report_of(status_of(status), sample_results(tmp_path), wall_s=1.0)
    # The hits beyond the declared prefix count too: the Mooncake paper's cache ratio.
    assert report["per_consumer"]["c0"]["prefix_reuse"] == pytest.approx(250000 / 826855)
    assert report["per_consumer"]["c1"]["prefix_reuse"] == pytest.approx(218496 / 753713)
    assert report["prefix_reuse"] == pytest.approx((250000 + 218496) / (826855 + 753713))
    empty = report_of(BrokerStatus(), summarize_results(str(tmp_path / "none")), wall_s=1.0, published=0)
    assert empty["prefix_reuse"] is None  # no prompt token ran: no ratio


def test_busy_fraction_is_each_consumers_busy_time_over_the_makespan(tmp_path):
    # c1's items dispatched from 1.0 s, c0's done by 3.5 s: a makespan of 2.5 s. The sample's
    # engines were busy 1.25 s (c0) and 1.5 s (c1).
    results = summarize_results(write_results(tmp_path / "results", {
        "c1": [line(i, dispatch_ns=1_000_000_000 + i, done_ns=2_000_000_000) for i in range(C1_ITEMS)],
        "c0": [line(i, dispatch_ns=2_000_000_000, done_ns=3_500_000_000 - i % 7) for i in range(C1_ITEMS, ALL_ITEMS)]}))
    assert results.makespan_s == 2.5
    report = report_of(SAMPLE_STATUS, results, wall_s=10.0)
    assert report["makespan_s"] == 2.5 and report["busy_s"] == 2.75
    assert report["per_consumer"]["c0"]["busy_s"] == 1.25 and report["per_consumer"]["c0"]["busy_fraction"] == 0.5
    assert report["per_consumer"]["c1"]["busy_fraction"] == 0.6
    assert report["busy_fraction"] == pytest.approx(0.55)  # the consumers' mean
    out = io.StringIO()
    render_report(report, Console(file=out, width=120))
    for figure in ("2.5 s", "55.0%", "60.0%", "1.5 s", "prefix reuse"):
        assert figure in out.getvalue(), figure
    # A live broker's window: its uptime (pipeline status).
    live = build_report(SAMPLE_STATUS, results, 5.0, makespan_s=5.0)
    assert live["makespan_s"] == 5.0 and live["per_consumer"]["c1"]["busy_fraction"] == 0.3
    # No result yet: no makespan, and no fraction.
    none = report_of(SAMPLE_STATUS, summarize_results(str(tmp_path / "none")), wall_s=1.0, published=0)
    assert none["makespan_s"] is None and none["busy_fraction"] is None
    assert none["per_consumer"]["c0"]["busy_fraction"] is None


def test_missing_results_are_lost(tmp_path):
    report = report_of(SAMPLE_STATUS, sample_results(tmp_path, skip=frozenset({5, 2500, 3999})), wall_s=1.0)
    assert report["lost"] == 3 and report["lost_examples"] == [5, 2500, 3999]
    assert report["items_with_results"] == 3997
    assert report["accounting_ok"] is False
    assert report["per_consumer"]["c0"]["items"] == 2072 - 2


def test_accepted_items_that_never_reached_the_broker_are_lost(tmp_path):
    report = report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=1.0, published=4005)
    assert report["lost"] == 5 and report["lost_examples"] == [4000, 4001, 4002, 4003, 4004]
    assert report["items_accepted"] == 4005
    assert report["accounting_ok"] is False


def test_a_stopped_run_is_judged_by_where_its_items_are(tmp_path):
    """Stopped early: some items have results, some are in the store, some in a ring; one
    in the store also has a result (its consumer died before the completion arrived) and
    counts once. Nothing is lost, and the verdict says what is kept."""
    results = sample_results(tmp_path, skip=frozenset(range(3000, 4000)))
    report = report_of(SAMPLE_STATUS, results, wall_s=1.0, published=4500, store=range(2999, 3600),
                       rings=range(3600, 4500))
    assert (report["items_in_store"], report["items_in_rings"], report["items_unfinished"]) == (600, 900, 1500)
    assert report["lost"] == 0 and report["accounting_ok"] is True
    out = io.StringIO()
    render_report(report, Console(file=out, width=120))
    assert "stopped early" in out.getvalue() and "MISMATCH" not in out.getvalue()
    discarded = build_report(SAMPLE_STATUS, results, 1.0, stock=stock_of(results, 4500, range(2999, 3600),
                                                                          range(3600, 4500)), store_kept=False)
    assert discarded["items_discarded"] == 1500 and discarded["accounting_ok"] is True


def test_duplicates_and_empty_items(tmp_path):
    results = sample_results(tmp_path, extra_c0=(7, 3000), too_long=frozenset({10, 11}))
    report = report_of(SAMPLE_STATUS, results, wall_s=1.0)
    assert report["duplicates"] == 2
    assert report["lost"] == 0
    assert report["items_empty"] == 2
    assert report["per_consumer"]["c0"]["items"] == 2072 + 2
    assert report["accounting_ok"] is True  # a duplicate is counted, not a loss


def test_completed_short_of_received_is_not_ok(tmp_path):
    status = replace(SAMPLE_STATUS, tokens_completed=SAMPLE_STATUS.tokens_completed - 1)
    assert report_of(status, sample_results(tmp_path), wall_s=1.0)["accounting_ok"] is False


def test_recovered_items_count_as_received(tmp_path):
    status = replace(SAMPLE_STATUS, items_received=3000, tokens_received=1000000, items_recovered=1000,
                     tokens_recovered=580568)
    report = report_of(status, sample_results(tmp_path), wall_s=1.0)
    assert (report["items_received"], report["tokens_received"]) == (4000, 1580568)
    assert report["accounting_ok"] is True


def test_the_brokers_loop_stalls_are_in_the_report(tmp_path):
    assert report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=1.0)["stalls"] == 0
    status = replace(SAMPLE_STATUS, stalls=3, stalled_s=1.75)
    report = report_of(status, sample_results(tmp_path), wall_s=1.0)
    assert (report["stalls"], report["stalled_s"]) == (3, 1.75)


def test_nothing_cacheable_and_no_consumer_totals(tmp_path):
    status = replace(SAMPLE_STATUS, per_consumer={})  # e.g. a broker restarted after the consumers finished
    report = report_of(status, sample_results(tmp_path), wall_s=0.0)
    assert report["cache_hit_rate"] is None
    assert report["cacheable_tokens"] == 0
    # Padding falls back to what the broker routed.
    assert report["padding_efficiency"] == pytest.approx(1580568 / 1615456)
    assert report["items_per_s"] is None and report["tokens_per_s"] is None
    # The consumers still appear, from their results files.
    assert report["per_consumer"]["c1"]["items"] == 1928
    assert report["per_consumer"]["c1"]["padding_efficiency"] is None
    assert report["per_consumer"]["c1"]["connected"] is False


def test_empty_run(tmp_path):
    report = report_of(BrokerStatus(), summarize_results(str(tmp_path / "none")), wall_s=1.0, published=0)
    assert report["accounting_ok"] is True
    assert (report["padding_efficiency"], report["mean_batch_fill"], report["cache_hit_rate"]) == (None, None, None)
    assert report["per_consumer"] == {} and report["shape_switches"] == 0
    render_report(report, Console(file=io.StringIO(), width=120))


def test_without_a_broker_status_nothing_is_checked(tmp_path):
    """The launcher passes None when the broker was gone at the end: the results files still
    show, and the accounting is not claimed to balance."""
    report = report_of(None, sample_results(tmp_path), wall_s=1.0)
    assert report["broker_status_missing"] is True
    assert report["accounting_ok"] is False
    assert (report["items_received"], report["items_with_results"], report["lost"]) == (0, 4000, 0)
    assert report["per_consumer"]["c0"]["items"] == 2072
    out = io.StringIO()
    render_report(report, Console(file=out, width=120))
    assert "UNCHECKED (no broker status)" in out.getvalue()


def test_json_round_trip(tmp_path):
    report = report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=2.0)
    path = tmp_path / "report.json"
    write_report_json(report, str(path))
    assert json.loads(path.read_text()) == report
    # Atomic: a second write replaces the file whole and leaves no temporary file.
    report["lost"] = 9
    write_report_json(report, str(path))
    assert json.loads(path.read_text())["lost"] == 9
    assert sorted(os.listdir(tmp_path)) == ["report.json", "results"]


def test_render_shows_the_key_figures(tmp_path):
    report = report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=2.0)
    out = io.StringIO()
    render_report(report, Console(file=out, width=120))
    text = out.getvalue()
    for figure in ("4,000", "1,580,568", "97.8%", "100.0%", "456,592", "4,640", "drained 19", "923", "3,077",
                   "790,284", "753,713", "OK"):
        assert figure in text, figure
    for heading in ("Accounting", "Efficiency", "Lanes", "Per consumer", "c0", "c1"):
        assert heading in text, heading


def test_render_flags_a_mismatch(tmp_path):
    report = report_of(SAMPLE_STATUS, sample_results(tmp_path, skip=frozenset({1})), wall_s=1.0)
    out = io.StringIO()
    render_report(report, Console(file=out, width=120))
    assert "MISMATCH" in out.getvalue()


def test_formatters():
    assert (format_count(1580568), format_count(None)) == ("1,580,568", "-")
    assert (format_percent(0.97840), format_percent(None)) == ("97.8%", "-")
    assert (format_compact(1580568), format_compact(12345), format_compact(812.4), format_compact(3)) == (
        "1.58M", "12.3k", "812", "3")


def test_damage_the_broker_found_is_shown_and_explains_what_is_lost(tmp_path):
    status = replace(SAMPLE_STATUS, store_damage={"entries_damaged": 2, "entries_missing": 1, "torn_tails": 4})
    report = report_of(status, sample_results(tmp_path, skip=frozenset({7, 8, 9})), wall_s=1.0)
    assert report["items_undeliverable"] == 3 and report["lost"] == 3 and report["accounting_ok"] is False
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "STORE DAMAGE: 3 stored items cannot be delivered" in text
    assert "MISMATCH: 3 lost (the broker found damage in the store" in text


def test_the_store_damage_note_names_what_was_damaged_and_nothing_else():
    """A store log problem (a damaged record: a chain level, a redelivery) loses no counted
    entry: the note says so, and sends nobody to quarantine/; files earlier damage left
    there are a note of their own."""
    log = {"store_damaged": True, "items_undeliverable": 0, "store_damage": {"catalog_problems": 1}}
    severe, text = store_damage_note(log, "/data")
    assert severe and text.startswith("0 stored items cannot be delivered, and 1 store log problem")
    assert "quarantine" not in text and "`pipeline tools verify /data`" in text
    old = {"store_damaged": False, "items_undeliverable": 0, "store_damage": {"quarantine_files": 2, "torn_tails": 1}}
    assert store_damage_note(old, "/data") == (False, "quarantine/ holds 2 files earlier damage left (`pipeline "
                                                       "tools verify /data` names them; remove them once looked at)")
    assert store_damage_note({"store_damaged": False, "store_damage": {"torn_tails": 3}}) is None
    assert store_damage_note({}) is None


def test_damage_without_a_loss_is_never_ok(tmp_path):
    """Items answered "corrupt" have a result line, and items damaged in the store that no
    run accepted are nobody's loss by id: the verdict is DAMAGED all the same, never OK."""
    corrupt = report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=1.0)
    assert corrupt["accounting_ok"] is True
    status = replace(SAMPLE_STATUS, store_damage={"entries_damaged": 1, "torn_tails": 2})
    damaged = report_of(status, sample_results(tmp_path), wall_s=1.0)
    assert damaged["lost"] == 0 and damaged["accounting_ok"] is False
    out = io.StringIO()
    render_report(damaged, Console(file=out, width=200))
    assert "DAMAGED: 1 item could not be delivered" in out.getvalue()
    results = summarize_results(write_results(tmp_path / "corrupt", {"c0": [line(0, "corrupt")] + [
        line(i) for i in range(1, ALL_ITEMS)]}))
    answered = report_of(SAMPLE_STATUS, results, wall_s=1.0)
    assert answered["items_corrupt"] == 1 and answered["lost"] == 0 and answered["accounting_ok"] is False
    only_torn = replace(SAMPLE_STATUS, store_damage={"torn_tails": 2, "state_words_repaired": 1})  # repairs, not damage
    assert report_of(only_torn, sample_results(tmp_path), wall_s=1.0)["accounting_ok"] is True


def test_engine_errors_are_answered_counted_and_shown(tmp_path):
    """Items the engine failed have a result line with status error: not lost, the run
    completes, and the report counts and shows them (an all-error run once read as plain OK)."""
    results = summarize_results(write_results(tmp_path / "errors", {"c0": [line(0, "error"), line(1, "error")] + [
        line(i) for i in range(2, ALL_ITEMS)]}))
    report = report_of(SAMPLE_STATUS, results, wall_s=1.0)
    assert report["items_error"] == 2 and report["lost"] == 0
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    assert "engine errors (answered with the message)" in out.getvalue()
    quiet = io.StringIO()
    render_report(report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=1.0), Console(file=quiet, width=200))
    assert "engine errors (answered" not in quiet.getvalue()  # shown only when there are some


@pytest.mark.parametrize("theirs, verdict", [((5000, 3000), True), ((5000, 2968), False)])
def test_the_engines_own_cache_counters_are_set_beside_ours(tmp_path, theirs, verdict):
    """vLLM's prefix_cache_queries / hits over the requests ours cover: agreeing is shown,
    a difference is a failure of the run (DISAGREE), never a footnote."""
    status = copy.deepcopy(SAMPLE_WIRE)
    status["per_consumer"]["c0"].update(engine_prefix_cache_queries=theirs[0], engine_prefix_cache_hits=theirs[1],
                                        engine_checked_prompt_tokens=5000, engine_checked_cache_hit_tokens=3000)
    report = report_of(status_of(status), sample_results(tmp_path), wall_s=1.0)
    assert report["per_consumer"]["c0"]["engine_counters_agree"] is verdict
    assert report["per_consumer"]["c1"]["engine_counters_agree"] is None  # a sim engine keeps none of its own
    assert report["engine_counters_agree"] is verdict
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "engine's own cache hits" in text
    assert ("agree with ours" in text) is verdict and ("DISAGREE" in text) is not verdict
    quiet = io.StringIO()
    render_report(report_of(SAMPLE_STATUS, sample_results(tmp_path), wall_s=1.0), Console(file=quiet, width=200))
    assert "engine's own" not in quiet.getvalue()  # sim only: nothing to set beside


def test_each_consumers_shape_switches_and_shapes_served_are_shown(tmp_path):
    status = copy.deepcopy(SAMPLE_WIRE)
    status["per_consumer"]["c0"].update(switches={"initial": 1, "drained": 4, "takeover": 1}, shapes_served=5,
                                        split_prefix_tokens=700)
    report = report_of(status_of(status), sample_results(tmp_path), wall_s=1.0)
    c0 = report["per_consumer"]["c0"]
    assert (c0["shape_switches"], c0["shapes_served"], c0["split_prefix_tokens"]) == (6, 5, 700)
    assert report["split_prefix_tokens"] == 700
    assert c0["shape_switches_by_reason"] == {"initial": 1, "drained": 4, "takeover": 1}
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    assert "shapes served" in out.getvalue()


def test_compulsory_misses_of_the_whole_model_and_the_split_cost_are_shown(tmp_path):
    status = copy.deepcopy(SAMPLE_WIRE)
    status["per_consumer"]["c0"]["compulsory_prefix_tokens"] = 900
    status["per_consumer"]["c1"]["compulsory_prefix_tokens"] = 700
    status["compulsory_prefix_tokens"] = 1000  # one cache for the model: 600 of the consumers' paid twice
    report = report_of(status_of(status), sample_results(tmp_path), wall_s=1.0)
    assert report["per_consumer"]["c0"]["compulsory_prefix_tokens"] == 900
    assert (report["compulsory_prefix_tokens_per_consumer"], report["compulsory_prefix_tokens_model"],
            report["split_cost_tokens"]) == (1600, 1000, 600)
    assert status_of(status).split_cost_tokens == 600
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "compulsory misses, whole model" in text and "split cost" in text and "lower bound" not in text
    status["compulsory_uncounted_starts"] = 3
    out = io.StringIO()
    render_report(report_of(status_of(status), sample_results(tmp_path), wall_s=1.0), Console(file=out, width=200))
    assert "lower bound: 3 shape starts uncounted" in out.getvalue()
