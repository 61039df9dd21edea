"""The run report of `pipeline launch`: accounting and efficiency from the broker's final
status and the consumers' results files (SPEC §7, §9).

Pure functions except `write_report_json`. The launcher calls, at the end of a run:

    report = build_report(broker_status, summarize_results(results_dir), wall_s, stock=stock)
    render_report(report)                      # rich tables on the terminal
    write_report_json(report, "report.json")   # the same figures for scripts

Definitions (every figure is an int or a float; a ratio with nothing to divide is None):

- received = items_received + items_recovered (tokens likewise): a restarted broker counts
  what it found on disk as recovered, not received again (items it stored from rings an
  earlier run left are received, and also counted in items_adopted).
- routed counts a redelivery again (an item whose consumer was lost is routed twice).
- completed is the broker's count over its life.
- items_accepted = items this run's producers put into their rings (by id); items_taken_over
  = items the broker recovered or adopted from an earlier run on the data directory;
  items_not_submitted = workload items the producers never submitted (a run stopped early).
- items_in_store = accepted or taken-over items still live in the store (not completed, no
  result); items_in_rings = items still in a producer ring, never stored; items_unfinished =
  the two together. Where the store outlives the run (the disk tier on a data directory
  that stays) they are kept, and the next launch on it completes them; otherwise they are
  items_discarded (the memory tier, a temporary data directory): gone with it.
- lost = accepted items found nowhere (no result, not in the store, not in a ring), plus
  taken-over items the places do not account for; by id, never negative. lost_examples
  names up to 10 of them. items_unexpected = items found that nothing accounts for.
- store_damage = what the broker's recovery found it could not deliver (damaged, missing or
  truncated entries, quarantined segments) or repaired, named in its log and by `pipeline
  tools verify`; items_undeliverable = the entries of it that cannot be delivered.
- duplicates = results lines beyond the first per item (at-least-once delivery, counted);
  duplicates_across_runs = items taken over from an earlier run that already had a result
  there (its consumer wrote it and the broker died before the completion arrived) and that
  ran again in this run.
- results_bad_lines = lines of the results files that are not results (a line torn by a
  kill or a full disk, garbage), counted and named in results_bad_line_examples (path:line);
  results_torn_lines = those that were a file's last line, cut short.
- items_empty = results with status too_long (answered without running); items_corrupt too;
  items_error = results with status error (the engine failed the item; its message is in the line).
- accounting_ok = lost == 0, nothing unexpected and nothing damaged (items_corrupt == 0,
  items_undeliverable == 0), and, once nothing is unfinished, the broker's counters balance
  (received == completed, in items and tokens); None for a live
  broker (`pipeline status`: nothing is judged before the run ends); False when a finished
  run's status lacks the broker's counters (`broker_status_missing`).
- padding_efficiency = real tokens / padded tokens of what the consumers' engines ran (their
  prompt_tokens / padded_tokens summed); the broker's tokens_routed / padded_tokens_routed
  when no consumer reported any (e.g. a broker restarted after the consumers finished).
- mean_batch_fill = batch_fill_sum / batches_routed, a batch's fill being its binding share
  of the consumer's contract: max(items / max_batch_items, padded tokens / max_batch_tokens).
- cacheable_tokens: the tokens in whole cache blocks of each item's shape components.
- cache_hit_tokens: cache hits inside that cacheable prefix (the engines'
  `cacheable_hit_tokens`), so the rate is at most 1; `cache_hit_tokens_all` is the engines'
  raw hit count, which also counts hits beyond the prefix (identical suffixes).
- compulsory_miss_tokens: cacheable tokens each consumer's engine missed on their first
  reference (the 3C model's compulsory misses: no schedule could serve them). Where shapes
  share no prefix this is the cacheable tokens of each shape's first item on each consumer;
  where they share leading blocks (a trace's common system prompt) only new blocks count,
  so the rate below stays at most 1.
- cache_hit_rate = cache_hit_tokens / (cacheable_tokens - compulsory_miss_tokens).
- prefix_reuse = cache_hit_tokens_all / prompt_tokens (every hit over the prompt tokens the
  engines ran, what the Mooncake paper calls the cache ratio): unlike the rate above it does
  not depend on what each system declares cacheable, so it compares with other systems.
- shape_switches = the sum of the broker's switch counts; shape_switches_by_reason keeps them.
- stalls = gaps in the broker's loop long enough to be its own stall (`stalled_s`: their
  seconds, summed): a loop that kept its yield has none.
- items_per_s and tokens_per_s = completed over the launcher's wall time (wall_s).
- makespan_s = from the first dispatch to the last completion: the earliest dispatch_ns and
  the latest done_ns of the run's results lines (one monotonic clock for the machine). Not
  the wall time: that also holds the processes' start (minutes loading a model on a GPU),
  the producers' work before the first batch and the shutdown, when no consumer can be
  busy. `pipeline status` divides by the broker's uptime instead, the only window a live
  broker's counters cover (its results directory spans runs). None before any result.
- busy_s = the seconds each consumer's engine was busy running batches (ConsumerWork
  busy_ns: the sim times each batch's run, its cost model's sleep included; vLLM its
  scheduler steps), summed by the broker over the consumer's completions; busy_fraction =
  busy_s / makespan_s per consumer, and the consumers' mean at the top. A broker restarted
  mid-run counts only its own life, so the fraction is then low, never high.
- engine_counters_agree: whether every engine that keeps prefix-cache counters of its own
  (vLLM's prefix_cache_hits / prefix_cache_queries) counted what ours did over the same
  requests (engine_checked_*: the requests that finished while nothing else ran, taken when
  its engine was idle; at the end of a run that is all of them, less the stretches that ran
  a request of several samples, which vLLM looks up once per sample); None where nothing was
  checked (the sim keeps no counters; a job whose every stretch ran several samples). False
  is a failure of the run, as a mismatch of the accounting is.

per_consumer[name] also has the consumer's shape switches (`shape_switches`, and by reason),
how many distinct shapes it was handed (`shapes_served`: the current shape is per consumer,
SPEC §4b, so a consumer switches about once per shape it serves; exact up to 16,384 shapes,
then estimated within about 1%, as the run's `shapes` is: `broker/distinct.py`), and
`split_prefix_tokens`: the prefix tokens (the first item's prefix_len) of every shape it
started after another consumer's cache had its prefix (that consumer started the shape or a
longer one), what splitting shapes across consumers cost, on top of the compulsory misses
one cache for the whole model would have paid;
`split_prefix_tokens` at the top is their sum.

Compulsory misses against one cache for the whole model: the broker counts, from
the shapes' prefix lengths and chains (`pipeline/broker/firstrefs.py`, content-blind, in
tokens), the prefix tokens first referenced by each consumer's cache
(per_consumer[name]["compulsory_prefix_tokens"], summed at the top as
`compulsory_prefix_tokens_per_consumer`) and by one cache for every consumer of the model
(`compulsory_prefix_tokens_model`: what no split avoids). `split_cost_tokens` = the first
less the second: the prefix tokens computed again because shapes (or shapes sharing a
prefix) ran on more than one consumer; 0 when each prefix ran on one consumer. They are
exact when every shared chain level is some shape's own prefix, and count a shared prefix
once per shape below it otherwise, in both alike; `compulsory_uncounted_starts` > 0 makes
them lower bounds (the count's memory limit). `compulsory_miss_tokens` stays the engines'
own count, per consumer, in whole blocks.

per_consumer[name] merges the broker's per-consumer totals (engine counters summed over the
consumer's completions, kept by name across reconnects) with the lines of its results file.
A consumer killed after writing results but before its completion reached the broker has
more results lines (`items`) than completed items (`items_ok` + `items_empty` + corrupt).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict

from rich import box
from rich.console import Console
from rich.table import Table

from pipeline.reporting.accounting import ResultsSummary, Stock, reconcile
from pipeline.wire.status import (
    REPAIR_KEYS,
    UNDELIVERABLE_KEYS,
    BrokerStatus,
    ConsumerTotalsRow,
    cache_hit_rate,
    padding_efficiency,
    prefix_reuse,
    ratio,
)
from pipeline.wire.textfiles import counted

# The engine's own prefix-cache counters and ours over the same requests (ConsumerWork).
ENGINE_CHECK_KEYS = ("engine_prefix_cache_queries", "engine_prefix_cache_hits", "engine_checked_prompt_tokens",
                     "engine_checked_cache_hit_tokens")
# The lane counters the report always shows; any other counter the broker adds is kept too.
LANE_KEYS = ("opened", "reused", "force_fits", "quiesced", "released", "max_in_use")


def consumer_figures(broker: ConsumerTotalsRow, results: dict, makespan_s: float | None = None) -> dict:
    """One consumer's report row from its broker totals (`status.per_consumer[name]`, an
    empty row if the broker has none), its results-file counts
    (`ResultsSummary.per_consumer[name]`, may be {}) and the run's makespan (None: unknown)."""
    work = broker.work
    # NOTE: the statuses come from the broker's totals, not the results files: ResultsSummary
    # counts statuses over all files only, and re-reading them here would be a second parser.
    return {
        "connected": broker.connected,
        "items": results.get("lines", 0),
        "items_ok": work.items_ok,
        "items_empty": work.items_too_long,
        "items_corrupt": work.items_corrupt,
        "items_error": work.items_error,
        "prompt_tokens": work.prompt_tokens,
        "padded_tokens": work.padded_tokens,
        "padding_efficiency": work.padding_efficiency,
        "cacheable_tokens": work.cacheable_tokens,
        "cache_hit_tokens": work.cacheable_hit_tokens,
        "cache_hit_tokens_all": work.cache_hit_tokens,
        "compulsory_miss_tokens": work.compulsory_miss_tokens,
        "cache_hit_rate": work.cache_hit_rate,
        "prefix_reuse": work.prefix_reuse,
        "output_tokens": work.output_tokens,
        "busy_s": work.busy_s,
        "busy_fraction": None if makespan_s is None else ratio(work.busy_s, makespan_s),
        "batches": broker.batches,
        "shape_switches": sum(broker.switches.values()),
        "shape_switches_by_reason": dict(broker.switches),
        "shapes_served": broker.shapes_served,
        "split_prefix_tokens": broker.split_prefix_tokens,
        "compulsory_prefix_tokens": broker.compulsory_prefix_tokens,
        **{key: getattr(work, key) for key in ENGINE_CHECK_KEYS},
        "engine_counters_agree": None if not any(getattr(work, key) for key in ENGINE_CHECK_KEYS)
        else not work.engine_disagrees,
    }


def build_report(status: BrokerStatus | None, results: ResultsSummary, wall_s: float, stock: Stock | None = None,
                 store_kept: bool = True, not_submitted: int = 0, unreadable_rings: Sequence[str] = (),
                 duplicates_across_runs: int = 0, makespan_s: float | None = None) -> dict:
    """The run report (definitions in the module docstring) as a JSON-ready dict.
    `status`: the broker's last status; None when the broker was gone at the end, reported
    as zero counters and the accounting as not OK, since nothing can be checked.
    `stock`: where every item of the run is, by id (`accounting.take_stock`); None for a live
    broker (`pipeline status`), which nothing is judged on. `store_kept` False: the store
    does not outlive the run (the memory tier, a temporary data directory), so unfinished
    items are discarded with it, and reported so. `not_submitted`: workload items the
    producers never put into their rings (a run stopped early). `makespan_s`: the window
    the busy fractions divide by, where it is not the results' first dispatch to last
    completion (`pipeline status`: the broker's uptime)."""
    missing = status is None
    broker = BrokerStatus() if status is None else status
    accounted = reconcile(results, broker, stock)
    names = sorted(set(broker.per_consumer) | set(results.per_consumer))
    makespan = results.makespan_s if makespan_s is None else makespan_s
    per_consumer = {name: consumer_figures(broker.per_consumer.get(name, ConsumerTotalsRow()),
                                           results.per_consumer.get(name, {}), makespan)
                    for name in names}
    # Without a status: the lane counters the report always shows, at 0.
    lanes = {key: 0 for key in LANE_KEYS} | ({} if status is None else asdict(status.lanes))
    compulsory_per_consumer = _total(per_consumer, "compulsory_prefix_tokens")
    return {
        **_stock_figures(accounted, broker, results, stock, missing=missing, store_kept=store_kept,
                         not_submitted=not_submitted, unreadable_rings=unreadable_rings,
                         duplicates_across_runs=duplicates_across_runs),
        **_batch_figures(broker, per_consumer),
        "shape_switches": broker.shape_switches,
        "shape_switches_by_reason": dict(broker.switches),
        # The run's shapes, not the live ones: a finished run's lanes retire, and its shapes go.
        "shapes": broker.shapes_seen,
        "lanes": lanes,
        "consumers_lost": broker.consumers_lost,
        "stalls": broker.stalls,
        "stalled_s": broker.stalled_s,
        "per_consumer": per_consumer,
        "engine_counters_agree": _engines_agree(per_consumer),
        "split_prefix_tokens": _total(per_consumer, "split_prefix_tokens"),
        "compulsory_prefix_tokens_per_consumer": compulsory_per_consumer,
        "compulsory_prefix_tokens_model": broker.compulsory_prefix_tokens,
        "split_cost_tokens": compulsory_per_consumer - broker.compulsory_prefix_tokens,
        "compulsory_uncounted_starts": broker.compulsory_uncounted_starts,
        "wall_s": wall_s,
        "items_per_s": ratio(accounted["items_completed"], wall_s),
        "tokens_per_s": ratio(accounted["tokens_completed"], wall_s),
        "makespan_s": makespan,
        "busy_s": sum(row["busy_s"] for row in per_consumer.values()),
        "busy_fraction": _mean_busy_fraction(per_consumer),
    }


def _total(per_consumer: dict, key: str) -> int:
    return sum(row[key] for row in per_consumer.values())


def _stock_figures(accounted: dict, broker: BrokerStatus, results: ResultsSummary, stock: Stock | None, *,
                   missing: bool, store_kept: bool, not_submitted: int, unreadable_rings: Sequence[str],
                   duplicates_across_runs: int) -> dict:
    """The report's accounting: where every item is, what the store and the results files
    hold that is damaged, and whether it all balances."""
    damage = broker.store_damage
    undeliverable = sum(damage.get(key, 0) for key in UNDELIVERABLE_KEYS)
    store_damaged = any(count for key, count in damage.items() if key not in REPAIR_KEYS)
    return {
        **accounted,
        "items_not_submitted": not_submitted,
        "duplicates_across_runs": duplicates_across_runs,
        "broker_status_missing": missing,
        "accounting_ok": None if stock is None else _balanced(accounted, not_submitted, store_damaged, missing),
        "items_discarded": 0 if store_kept else accounted["items_unfinished"],
        "store_kept": store_kept,
        "unreadable_rings": list(unreadable_rings),
        "store_damage": dict(damage),
        "items_undeliverable": undeliverable,
        "store_damaged": store_damaged,
        "results_torn_lines": results.torn_lines,
        "results_bad_lines": results.bad_lines,
        "results_bad_line_examples": list(results.bad_line_examples),
    }


def _batch_figures(broker: BrokerStatus, per_consumer: dict) -> dict:
    """The report's padding and cache figures, over every consumer's batches."""
    prompt, padded = _total(per_consumer, "prompt_tokens"), _total(per_consumer, "padded_tokens")
    efficiency = padding_efficiency(prompt, padded) if padded else broker.routed_padding_efficiency
    cacheable, hits = _total(per_consumer, "cacheable_tokens"), _total(per_consumer, "cache_hit_tokens")
    compulsory, hits_all = _total(per_consumer, "compulsory_miss_tokens"), _total(per_consumer, "cache_hit_tokens_all")
    return {
        "padding_efficiency": efficiency,
        "mean_batch_fill": broker.mean_batch_fill,
        "batches_routed": broker.batches_routed,
        "cacheable_tokens": cacheable,
        "cache_hit_tokens": hits,
        "cache_hit_tokens_all": hits_all,
        "compulsory_miss_tokens": compulsory,
        "cache_hit_rate": cache_hit_rate(hits, cacheable, compulsory),
        "prefix_reuse": prefix_reuse(hits_all, prompt),
    }

def _mean_busy_fraction(per_consumer: dict) -> float | None:
    """The consumers' busy fractions, averaged; None without a makespan or a consumer."""
    fractions = [row["busy_fraction"] for row in per_consumer.values()]
    return None if not fractions or None in fractions else sum(fractions) / len(fractions)


def _engines_agree(per_consumer: dict) -> bool | None:
    """Whether every engine with counters of its own (vLLM's) agrees with ours; None when
    no engine has any (sim)."""
    verdicts = [row["engine_counters_agree"] for row in per_consumer.values() if row["engine_counters_agree"] is not None]
    return all(verdicts) if verdicts else None


def _balanced(accounted: dict, not_submitted: int, store_damaged: bool, status_missing: bool) -> bool:
    """Nothing lost or unexplained (by id) and nothing damaged (no item answered "corrupt",
    nothing in the store that cannot be delivered); and, once nothing is unfinished, the
    broker's counters balance too: everything received was completed, in items and in
    tokens. A run stopped early is judged by id alone (a broker killed mid-run leaves no
    final counters)."""
    if accounted["lost"] or accounted["items_unexpected"] or accounted["items_corrupt"] or store_damaged:
        return False
    if accounted["items_unfinished"] or not_submitted:
        return True
    return (not status_missing and accounted["items_received"] == accounted["items_completed"]
            and accounted["tokens_received"] == accounted["tokens_completed"])


def write_report_json(report: dict, path: str) -> None:
    """Write the report as JSON, atomically: a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # owner-only whatever the umask (SPEC §12)
        with open(fd, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def format_count(value: float | None) -> str:
    """An int with thousands separators ("1,580,568"); "-" for None."""
    return "-" if value is None else f"{value:,.0f}"


def format_percent(value: float | None) -> str:
    """A ratio as a percentage with one decimal ("97.8%"); "-" for None."""
    return "-" if value is None else f"{100 * value:.1f}%"


def format_seconds(value: float | None) -> str:
    """Seconds with one decimal ("12.3 s"); "-" for None."""
    return "-" if value is None else f"{value:.1f} s"


def format_rate(value: float | None) -> str:
    """A per-second figure, compact ("12.3k/s"); "-" for None."""
    return "-" if value is None else f"{format_compact(value)}/s"


def format_compact(value: float) -> str:
    """A large figure in three significant digits with a k/M/G suffix ("1.58M")."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _pairs_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, box=box.SIMPLE, show_header=False, title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    return table


def _accounting_table(report: dict) -> Table:
    table = Table(title="Accounting", box=box.SIMPLE, title_justify="left")
    table.add_column("")
    table.add_column("items", justify="right")
    table.add_column("tokens", justify="right")
    for stage in ("received", "routed", "completed"):
        table.add_row(stage, format_count(report[f"items_{stage}"]), format_count(report[f"tokens_{stage}"]))
    rows = [("accepted from producers", "items_accepted"), ("taken over from earlier runs", "items_taken_over"),
            ("with results", "items_with_results"), ("empty (too long)", "items_empty"),
            ("corrupt", "items_corrupt"), ("engine errors (answered with the message)", "items_error"),
            ("duplicates", "duplicates"),
            ("duplicates of earlier runs' results", "duplicates_across_runs"),
            ("unfinished, in the store", "items_in_store"), ("unfinished, in producer rings", "items_in_rings"),
            ("not submitted", "items_not_submitted"), ("discarded with the store", "items_discarded"),
            ("unexpected", "items_unexpected"), ("results lines that are not results", "results_bad_lines")]
    always = {"items_with_results", "items_empty", "items_corrupt", "duplicates"}
    for label, key in rows:
        if key in always or report.get(key):
            table.add_row(label, format_count(report[key]), "")
    table.add_row("lost", format_count(report["lost"]), "")
    table.add_row("accounting", accounting_verdict(report), "")
    if report.get("engine_counters_agree") is not None:
        table.add_row("engine's own cache counters", engine_verdict(report), "")
    return table


def _unknown_damage(report: dict) -> str:
    """What the store lost that no count covers: missing segments of unknown size, strays,
    a store log that could not vouch for the store."""
    damage = report.get("store_damage", {})
    parts = [counted(damage[key], what) + why for key, what, why in (
        ("segments_missing_count_unknown", "missing segment", " of unknown size"),
        ("strays", "stray file", ""), ("catalog_problems", "store log problem", "")) if damage.get(key)]
    return f", and {', '.join(parts)}" if parts else ""


def store_damage_note(report: dict, data_dir: str = "DATA_DIR") -> tuple[bool, str] | None:
    """What the run's broker found damaged in the store, in one sentence, and whether it is
    this start's damage (True) or only files earlier damage left in quarantine/ (False);
    None when neither."""
    if report.get("store_damaged"):
        return True, (f"{counted(report['items_undeliverable'], 'stored item')} cannot be delivered"
                      f"{_unknown_damage(report)} (each named in the broker's log; `pipeline tools verify "
                      f"{data_dir}` lists them)")
    quarantined = report.get("store_damage", {}).get("quarantine_files")
    if quarantined:
        return False, (f"quarantine/ holds {counted(quarantined, 'file')} earlier damage left (`pipeline tools "
                       f"verify {data_dir}` names them; remove them once looked at)")
    return None


def accounting_verdict(report: dict) -> str:
    """The accounting in a few words (rich markup): OK, what is left and where, or what is
    wrong. Never OK while an item is missing."""
    if report["accounting_ok"] is None:
        return "not checked on a live broker (see the run's report)"
    damage = report.get("items_undeliverable", 0)
    if not report["accounting_ok"]:
        if not report["lost"] and (report.get("store_damaged") or report["items_corrupt"]) \
                and not report.get("items_unexpected"):
            return (f"[bold red]DAMAGED: {counted(damage + report['items_corrupt'], 'item')} could not be delivered "
                    f"({report['items_corrupt']:,} answered corrupt, {damage:,} undeliverable in the store"
                    f"{_unknown_damage(report)}; each named in the logs)[/bold red]")
        if report["broker_status_missing"] and not report["lost"] and not report.get("items_unexpected"):
            return "[bold red]UNCHECKED (no broker status)[/bold red]"
        why = f"{report['lost']:,} lost" if report["lost"] else "the broker's counters do not balance"
        if report["lost"] and damage:
            why += " (the broker found damage in the store: see its log and `pipeline tools verify`)"
        if report.get("items_unexpected"):
            why += f", {report['items_unexpected']:,} unexpected"
        return f"[bold red]MISMATCH: {why}[/bold red]"
    unfinished = report.get("items_unfinished", 0)
    if report.get("items_discarded"):
        return "[yellow]stopped early: the unfinished items are discarded with the store[/yellow]"
    if unfinished:
        return "[yellow]OK so far (stopped early: the unfinished items are kept)[/yellow]"
    if report.get("items_not_submitted"):
        return "[yellow]OK so far (stopped early: some items were never submitted)[/yellow]"
    return "[green]OK[/green]"


def engine_verdict(report: dict) -> str:
    """The engines' own prefix-cache counters against ours, in a few words (rich markup)."""
    if report.get("engine_counters_agree"):
        return "[green]agree with ours[/green]"
    wrong = [f"{name}: engine {row['engine_prefix_cache_hits']:,} hits / {row['engine_prefix_cache_queries']:,} "
             f"queries, ours {row['engine_checked_cache_hit_tokens']:,} / {row['engine_checked_prompt_tokens']:,}"
             for name, row in report["per_consumer"].items() if row["engine_counters_agree"] is False]
    return f"[bold red]DISAGREE ({'; '.join(wrong)})[/bold red]"


def _efficiency_rows(report: dict) -> list[tuple[str, str]]:
    reasons = ", ".join(f"{reason} {count}" for reason, count in report["shape_switches_by_reason"].items())
    return [
        ("padding efficiency", format_percent(report["padding_efficiency"])),
        ("mean batch fill", format_percent(report["mean_batch_fill"])),
        ("batches routed", format_count(report["batches_routed"])),
        ("cacheable tokens", format_count(report["cacheable_tokens"])),
        ("cache hit tokens", format_count(report["cache_hit_tokens"])),
        ("compulsory miss tokens", format_count(report["compulsory_miss_tokens"])),
        # The broker's counts (firstrefs.py), in tokens: the row above is the engines', in blocks.
        ("compulsory misses, consumers (broker)", format_count(report["compulsory_prefix_tokens_per_consumer"])),
        ("compulsory misses, whole model", format_count(report["compulsory_prefix_tokens_model"])
         + (f" (lower bound: {report['compulsory_uncounted_starts']:,} shape starts uncounted)"
            if report["compulsory_uncounted_starts"] else "")),
        ("split cost (consumers less model)", format_count(report["split_cost_tokens"])),
        ("cache hit rate", format_percent(report["cache_hit_rate"])),
        ("prefix reuse (hits / prompt tokens)", format_percent(report["prefix_reuse"])),
        ("shape switches", f"{report['shape_switches']:,}" + (f" ({reasons})" if reasons else "")),
        ("shapes", format_count(report["shapes"])),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("makespan (first dispatch to last result)", format_seconds(report["makespan_s"])),
        ("consumers' mean busy fraction", format_percent(report["busy_fraction"])),
        ("items per second", format_count(report["items_per_s"])),
        ("tokens per second", format_count(report["tokens_per_s"])),
    ]


# The per-consumer rows of the report table: (label, key, formatter).
_CONSUMER_ROWS = (
    ("batches", "batches", format_count), ("items", "items", format_count), ("ok", "items_ok", format_count),
    ("empty (too long)", "items_empty", format_count), ("engine errors", "items_error", format_count),
    ("prompt tokens", "prompt_tokens", format_count),
    ("padded tokens", "padded_tokens", format_count), ("padding efficiency", "padding_efficiency", format_percent),
    ("cacheable tokens", "cacheable_tokens", format_count), ("cache hit tokens", "cache_hit_tokens", format_count),
    ("compulsory miss tokens", "compulsory_miss_tokens", format_count),
    ("cache hit rate", "cache_hit_rate", format_percent), ("prefix reuse", "prefix_reuse", format_percent),
    ("engine busy", "busy_s", format_seconds),
    ("busy fraction", "busy_fraction", format_percent),
    ("shape switches", "shape_switches", format_count), ("shapes served", "shapes_served", format_count),
    ("prefix tokens of split shapes", "split_prefix_tokens", format_count),
    ("first-referenced prefix tokens", "compulsory_prefix_tokens", format_count),
)


def _consumers_table(report: dict) -> Table:
    """One column per consumer, one row per figure.
    NOTE: a row per consumer was rejected: twelve columns of full figures do not fit an
    80-column log, while a node has few consumers (one per GPU)."""
    table = Table(title="Per consumer", box=box.SIMPLE, title_justify="left", pad_edge=False)
    table.add_column("")
    consumers = report["per_consumer"]
    for name in consumers:
        table.add_column(name, justify="right")
    for label, key, show in _CONSUMER_ROWS:
        table.add_row(label, *(show(row[key]) for row in consumers.values()))
    if any(row["engine_counters_agree"] is not None for row in consumers.values()):
        for label, key in (("engine's own cache hits", "engine_prefix_cache_hits"),
                           ("engine's own cache queries", "engine_prefix_cache_queries"),
                           ("ours over the same requests: hits", "engine_checked_cache_hit_tokens"),
                           ("ours over the same requests: queries", "engine_checked_prompt_tokens")):
            table.add_row(label, *(format_count(row[key]) for row in consumers.values()))
    return table


def render_report(report: dict, console: Console | None = None) -> None:
    """Print the report as rich tables: accounting, efficiency, lanes, per consumer. On a
    console that is not a terminal rich writes the same tables as plain text."""
    console = console or Console()
    console.print(_accounting_table(report))
    damage = store_damage_note(report)
    if damage is not None:
        severe, text = damage
        console.print(f"[bold red]STORE DAMAGE: {text}[/bold red]" if severe else f"[yellow]{text}[/yellow]")
    console.print(_pairs_table("Efficiency", _efficiency_rows(report)))
    console.print(_pairs_table("Lanes", [(key.replace("_", " "), format_count(value))
                                         for key, value in report["lanes"].items()]))
    if report["per_consumer"]:
        console.print(_consumers_table(report))
    if "settings" in report:  # a launch's report: what the broker and consumers ran with
        changed = report["settings"]["changed"]
        console.print("settings: " + (", ".join(f"{key}={value}" for key, value in changed.items())
                                      if changed else "the defaults (the JSON report lists every value)"))
