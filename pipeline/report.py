"""The run report of `pipeline launch`: accounting and efficiency from the broker's final
status and the consumers' results files (SPEC §7, §9).

Pure functions except `write_report_json`. The launcher calls, at the end of a run:

    report = build_report(broker_status, summarize_results(results_dir), wall_s, expected_items)
    render_report(report)                      # rich tables on the terminal
    write_report_json(report, "report.json")   # the same figures for scripts

Definitions (every figure is an int or a float; a ratio with nothing to divide is None):

- received = items_received + items_recovered (tokens likewise): a restarted broker counts
  what it found on disk as recovered, not received again.
- routed counts a redelivery again (an item whose consumer was lost is routed twice).
- completed is the broker's count over its life.
- items_unfinished = backlog + pending items in the broker's status (a run stopped early);
  they are in the store, not lost; items_discarded = the same when the store does not
  outlive the run (memory tier, temporary data directory): gone with it, by the user's stop.
- items_unfinished_with_results = unfinished items that already have a result line (their
  consumer wrote it and died before the completion reached the broker; the launcher reads
  the unfinished item ids from the store when it stops a run early).
- lost = received - unfinished - distinct items with a result + unfinished items with a
  result, or expected_items - distinct items with a result when the launcher knows how many
  items its producers submitted (that also catches items lost before the broker stored them).
- duplicates = results lines beyond the first per item (at-least-once delivery, counted).
- items_empty = results with status too_long (answered without running); items_corrupt too.
- accounting_ok = lost == 0 and received == completed + unfinished in items, and in tokens
  too once nothing is unfinished; False when the
  status lacks the broker's counters (`broker_status_missing`: the broker was gone at the end).
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
- shape_switches = the sum of the broker's switch counts; shape_switches_by_reason keeps them.
- items_per_s and tokens_per_s = completed over the launcher's wall time.

per_consumer[name] merges the broker's per-consumer totals (engine counters summed over the
consumer's completions, kept by name across reconnects) with the lines of its results file.
A consumer killed after writing results but before its completion reached the broker has
more results lines (`items`) than completed items (`items_ok` + `items_empty` + corrupt).
"""

from __future__ import annotations

import json
import os

from rich import box
from rich.console import Console
from rich.table import Table

from pipeline.accounting import ResultsSummary, reconcile

# The broker's flow counters; a status without them (the broker was gone at the end: `{}`)
# reports them as 0 and the accounting as not OK, since nothing can be checked.
FLOW_KEYS = ("items_received", "tokens_received", "items_routed", "tokens_routed", "items_completed",
             "tokens_completed")
# The lane counters the report always shows; any other counter the broker adds is kept too.
LANE_KEYS = ("opened", "reused", "force_fits", "quiesced", "released", "max_in_use")


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


def prefix_hit_tokens(consumer: dict) -> int:
    """A consumer's cache hits inside the cacheable prefix, from its broker totals. Engines
    without that split report only raw hits: the best figure there is."""
    return consumer.get("cacheable_hit_tokens", consumer.get("cache_hit_tokens", 0))


def consumer_figures(broker: dict, results: dict) -> dict:
    """One consumer's report row from its broker totals (`status["per_consumer"][name]`, may
    be {}) and its results-file counts (`ResultsSummary.per_consumer[name]`, may be {})."""
    prompt = broker.get("prompt_tokens", 0)
    padded = broker.get("padded_tokens", 0)
    cacheable = broker.get("cacheable_tokens", 0)
    compulsory = broker.get("compulsory_miss_tokens", 0)
    hits = prefix_hit_tokens(broker)
    # NOTE: the statuses come from the broker's totals, not the results files: ResultsSummary
    # counts statuses over all files only, and re-reading them here would be a second parser.
    return {
        "connected": bool(broker.get("connected", False)),
        "items": results.get("lines", 0),
        "items_ok": broker.get("items_ok", 0),
        "items_empty": broker.get("items_too_long", 0),
        "items_corrupt": broker.get("items_corrupt", 0),
        "prompt_tokens": prompt,
        "padded_tokens": padded,
        "padding_efficiency": padding_efficiency(prompt, padded),
        "cacheable_tokens": cacheable,
        "cache_hit_tokens": hits,
        "cache_hit_tokens_all": broker.get("cache_hit_tokens", 0),
        "compulsory_miss_tokens": compulsory,
        "cache_hit_rate": cache_hit_rate(hits, cacheable, compulsory),
        "output_tokens": broker.get("output_tokens", 0),
        "batches": broker.get("batches", 0),
    }


def build_report(status: dict, results: ResultsSummary, wall_s: float, expected_items: int | None = None,
                 store_kept: bool = True, unfinished_ids: set[int] | None = None) -> dict:
    """The run report (definitions in the module docstring) as a JSON-ready dict.
    `store_kept` False: the store does not outlive the run (the memory tier, a temporary data
    directory), so unfinished items are discarded with it, and reported so. `unfinished_ids`:
    the item ids the store held when `status` was taken (see `accounting.reconcile`)."""
    missing = not all(key in status for key in FLOW_KEYS)
    accounted = reconcile(results, dict.fromkeys(FLOW_KEYS, 0) | status, expected_items, unfinished_ids)
    broker_consumers = status.get("per_consumer", {})
    names = sorted(set(broker_consumers) | set(results.per_consumer))
    per_consumer = {name: consumer_figures(broker_consumers.get(name, {}), results.per_consumer.get(name, {}))
                    for name in names}

    def total(key: str) -> int:
        return sum(row[key] for row in per_consumer.values())

    prompt, padded = total("prompt_tokens"), total("padded_tokens")
    if padded == 0:
        prompt, padded = status.get("tokens_routed", 0), status.get("padded_tokens_routed", 0)
    cacheable, hits, compulsory = total("cacheable_tokens"), total("cache_hit_tokens"), total("compulsory_miss_tokens")
    switches = dict(status.get("switches", {}))
    lanes = {key: 0 for key in LANE_KEYS} | dict(status.get("lanes", {}))
    return {
        **accounted,
        "expected_items": expected_items,
        "broker_status_missing": missing,
        "accounting_ok": _balanced(accounted) and not missing,
        "items_discarded": 0 if store_kept else accounted["items_unfinished"],
        "results_torn_lines": results.torn_lines,
        "padding_efficiency": padding_efficiency(prompt, padded),
        "mean_batch_fill": ratio(status.get("batch_fill_sum", 0.0), status.get("batches_routed", 0)),
        "batches_routed": status.get("batches_routed", 0),
        "cacheable_tokens": cacheable,
        "cache_hit_tokens": hits,
        "cache_hit_tokens_all": total("cache_hit_tokens_all"),
        "compulsory_miss_tokens": compulsory,
        "cache_hit_rate": cache_hit_rate(hits, cacheable, compulsory),
        "shape_switches": sum(switches.values()),
        "shape_switches_by_reason": switches,
        "shapes": status.get("shapes", 0),
        "lanes": lanes,
        "consumers_lost": status.get("consumers_lost", 0),
        "per_consumer": per_consumer,
        "wall_s": wall_s,
        "items_per_s": ratio(accounted["items_completed"], wall_s),
        "tokens_per_s": ratio(accounted["tokens_completed"], wall_s),
    }


def _balanced(accounted: dict) -> bool:
    """Nothing lost, and everything received completed or still queued (tokens are checked
    once nothing is queued: the broker counts queued items, not the tokens of pending ones)."""
    unfinished = accounted["items_unfinished"]
    return (accounted["lost"] == 0 and accounted["items_received"] == accounted["items_completed"] + unfinished
            and (unfinished > 0 or accounted["tokens_received"] == accounted["tokens_completed"]))


def write_report_json(report: dict, path: str) -> None:
    """Write the report as JSON, atomically: a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as file:
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
    table.add_row("with results", format_count(report["items_with_results"]), "")
    table.add_row("empty (too long)", format_count(report["items_empty"]), "")
    table.add_row("corrupt", format_count(report["items_corrupt"]), "")
    table.add_row("duplicates", format_count(report["duplicates"]), "")
    if report.get("items_unfinished"):
        table.add_row("unfinished (queued)", format_count(report["items_unfinished"]), "")
    if report.get("items_unfinished_with_results"):
        table.add_row("  of which with results", format_count(report["items_unfinished_with_results"]), "")
    table.add_row("lost", format_count(report["lost"]), "")
    if report["accounting_ok"] is None:
        verdict = "not checked on a live broker (see the run's report)"
    elif report["broker_status_missing"]:
        verdict = "[bold red]UNCHECKED (no broker status)[/bold red]"
    else:
        verdict = "[green]OK[/green]" if report["accounting_ok"] else "[bold red]MISMATCH[/bold red]"
        if report["accounting_ok"] and report.get("items_unfinished"):
            verdict = "[yellow]OK so far (stopped early)[/yellow]"
        if report["accounting_ok"] and report.get("items_discarded"):
            verdict = f"[yellow]stopped early: {report['items_discarded']:,} unfinished items discarded[/yellow]"
    table.add_row("accounting", verdict, "")
    return table


def _efficiency_rows(report: dict) -> list[tuple[str, str]]:
    reasons = ", ".join(f"{reason} {count}" for reason, count in report["shape_switches_by_reason"].items())
    return [
        ("padding efficiency", format_percent(report["padding_efficiency"])),
        ("mean batch fill", format_percent(report["mean_batch_fill"])),
        ("batches routed", format_count(report["batches_routed"])),
        ("cacheable tokens", format_count(report["cacheable_tokens"])),
        ("cache hit tokens", format_count(report["cache_hit_tokens"])),
        ("compulsory miss tokens", format_count(report["compulsory_miss_tokens"])),
        ("cache hit rate", format_percent(report["cache_hit_rate"])),
        ("shape switches", f"{report['shape_switches']:,}" + (f" ({reasons})" if reasons else "")),
        ("shapes", format_count(report["shapes"])),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("items per second", format_count(report["items_per_s"])),
        ("tokens per second", format_count(report["tokens_per_s"])),
    ]


# The per-consumer rows of the report table: (label, key, formatter).
_CONSUMER_ROWS = (
    ("batches", "batches", format_count), ("items", "items", format_count), ("ok", "items_ok", format_count),
    ("empty (too long)", "items_empty", format_count), ("prompt tokens", "prompt_tokens", format_count),
    ("padded tokens", "padded_tokens", format_count), ("padding efficiency", "padding_efficiency", format_percent),
    ("cacheable tokens", "cacheable_tokens", format_count), ("cache hit tokens", "cache_hit_tokens", format_count),
    ("compulsory miss tokens", "compulsory_miss_tokens", format_count),
    ("cache hit rate", "cache_hit_rate", format_percent),
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
    return table


def render_report(report: dict, console: Console | None = None) -> None:
    """Print the report as rich tables: accounting, efficiency, lanes, per consumer. On a
    console that is not a terminal rich writes the same tables as plain text."""
    console = console or Console()
    console.print(_accounting_table(report))
    console.print(_pairs_table("Efficiency", _efficiency_rows(report)))
    console.print(_pairs_table("Lanes", [(key.replace("_", " "), format_count(value))
                                         for key, value in report["lanes"].items()]))
    if report["per_consumer"]:
        console.print(_consumers_table(report))
