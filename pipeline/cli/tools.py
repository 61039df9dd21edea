"""`pipeline tools ...`: read-only commands over the store (dump, tombstones, verify),
`check` (every submitted item against what runs left), `check-job` (a finished batch job's
output against its input), `analyze`, a workload's or a batch file's figures without running
it, and `cleanup`, which removes what a crashed run of a data directory
left (dry run unless --yes).

Every StorageError (a file that is not a segment, a directory or file that cannot be read)
is one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import click

from pipeline.analysis.workload import DEFAULT_CACHE_TOKENS, DEFAULT_TOP_SHAPES
from pipeline.storage.inspect import dump_segment, tombstone_rows, verify
from pipeline.wire.errors import PipelineError, StorageError


def _one_line_errors(command: Callable) -> Callable:
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except StorageError as exc:
            raise click.ClickException(str(exc)) from exc
    return wrapper


@click.group("tools")
def tools() -> None:
    """Inspect and verify the disk tier's segment files (read-only); audit a finished job's
    output against its input; analyze a workload or a batch file; clean up after a crashed run."""


@tools.command("dump-segment")
@click.argument("path", type=click.Path(dir_okay=False, readable=False))
@click.option("--entries", "max_entries", type=click.IntRange(min=0), default=None,
              help="List at most this many entries.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def dump_segment_command(path: str, max_entries: int | None, as_json: bool) -> None:
    """Header and entries of one segment: state, lengths, checksum status, damage."""
    dump = dump_segment(path, max_entries)
    if as_json:
        click.echo(json.dumps(dump, indent=2))
        return
    for key, value in dump["header"].items():
        click.echo(f"{key:>14}: {value:#x}" if key == "signature" else f"{key:>14}: {value}")
    scanned = dump["scanned"]
    click.echo(f"{'scanned':>14}: {scanned['entries']} whole entries ({scanned['live']} live, "
               f"{scanned['tombstones']} tombstones), whole entries end at {scanned['data_end']}, "
               f"counts agree: {scanned['counts_agree']}")
    for problem in scanned["problems"]:
        click.echo(f"{'DAMAGE':>14}: {problem}")
    for torn in scanned["torn"]:
        click.echo(f"{'torn tail':>14}: {torn['end'] - torn['offset']} bytes at offset {torn['offset']} "
                   f"(an unacknowledged write; kept)")
    click.echo(f"{'offset':>10} {'state':<9} {'length':>7} {'item_id':>20} {'producer':>8} {'seq':>10} {'checksum':>8}")
    for e in dump["entries"]:
        click.echo(f"{e['offset']:>10} {e['state']:<9} {e['length']:>7} {e['item_id']:>20} "
                   f"{e['producer_id']:>8} {e['seq']:>10} {e['checksum']:>8}")


@tools.command("dump-tombstones")
@click.argument("data_dir", type=click.Path(file_okay=False, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def dump_tombstones_command(data_dir: str, as_json: bool) -> None:
    """Per segment: live and tombstoned entries, the deleted count, and whether they agree."""
    rows = tombstone_rows(data_dir)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'live':>8} {'tombs':>8} {'deleted':>8} {'agree':>5}  segment")
    for row in rows:
        if "error" in row:
            click.echo(f"{'':>8} {'':>8} {'':>8} {'ERROR':>5}  {row['error']}")
        else:
            click.echo(f"{row['live']:>8} {row['tombstones']:>8} {row['deleted_count']:>8} "
                       f"{'yes' if row['agree'] else 'NO':>5}  {row['path']}{'  DAMAGED' if row['damaged'] else ''}")


@tools.command("verify")
@click.argument("data_dir", type=click.Path(file_okay=False, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def verify_command(data_dir: str, as_json: bool) -> None:
    """Exit 0 only when nothing is damaged, lost, missing (per the store log), quarantined or
    stray, checksums hold and counts agree. Torn tails of unacknowledged writes are listed
    as notes: they lose nothing."""
    result = verify(data_dir)
    if as_json:
        click.echo(json.dumps({
            "ok": result.ok, "segments": result.segments, "entries": result.entries,
            "live": result.live, "tombstones": result.tombstones,
            "bytes_scanned": result.bytes_scanned, "quarantined_files": result.quarantined_files,
            "counts": dict(result.counts), "problems": result.problems, "notes": result.notes,
        }, indent=2))
    else:
        click.echo(f"{result.segments} segments, {result.entries} entries "
                   f"({result.live} live, {result.tombstones} tombstones), {result.bytes_scanned} bytes; "
                   f"{result.quarantined_files} files in quarantine")
        for note in result.notes:
            click.echo(f"note: {note}")
        for problem in result.problems:
            click.echo(f"PROBLEM: {problem}")
        click.echo("OK" if result.ok else f"FAILED: {len(result.problems)} problems")
    sys.exit(0 if result.ok else 1)


def _sizes(text: str) -> list[int]:
    """`--cache-tokens 65536,1048576`: positive integers, comma-separated ("" for none)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.ClickException(f"--cache-tokens {text!r}: expected token counts separated by commas, e.g. 65536,1048576") from None
    if any(size < 1 for size in sizes):
        raise click.ClickException(f"--cache-tokens {text!r}: every cache size is a positive number of tokens")
    return sizes


@tools.command("analyze")
@click.argument("workload")
@click.option("--block-tokens", type=int, default=None,
              help="KV block size of the modelled cache (default: 512 for a Mooncake trace, its hash blocks; else 16, "
                   "the sim engine's and vLLM's).")
@click.option("--cache-tokens", default=",".join(map(str, DEFAULT_CACHE_TOKENS)), show_default=True,
              help="Cache sizes to replay at, tokens per cache, comma-separated.")
@click.option("--caches", type=int, default=1, show_default=True,
              help="Caches (consumers) side by side: arrival order deals items round-robin, prefix-sorted order "
                   "gives each cache one stretch of the walk.")
@click.option("--items", type=click.IntRange(min=1), default=None,
              help="Only the first N items (demo, demo-chat, demo-template: how many to generate; default 20000; a "
                   "batch file: its first N requests, the whole file still checked).")
@click.option("--workload-seed", "seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the generated workloads.")
@click.option("--top", type=click.IntRange(min=0), default=DEFAULT_TOP_SHAPES, show_default=True,
              help="Shapes listed, most items first.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, exists=True),
              help="WORKLOAD is an OpenAI Batch file (run-batch's -i), its prompts made with this model directory's "
                   "tokenizer and chat template, as run-batch's producers make them.")
@click.option("--served-model-name", help="With --model: the model name requests must ask for (default: the "
                                          "directory's name), as run-batch.")
@click.option("--chat-template", help="With --model: the chat template, over the directory's (a file or the "
                                      "template itself), as run-batch.")
def analyze_command(workload: str, block_tokens: int | None, cache_tokens: str, caches: int, items: int | None,
                    seed: int, top: int, as_json: bool, model_dir: str | None, served_model_name: str | None,
                    chat_template: str | None) -> None:
    """Shapes, shared prefixes and the prefix-reuse bound of WORKLOAD ('demo', 'demo-chat',
    'demo-template' or a workload file), without running it. The cache is modelled as the sim engine's (vLLM's
    automatic prefix caching): full blocks, a hit is the run of leading cached blocks, LRU
    in blocks, the last token always computed.

    With --model, WORKLOAD is an OpenAI Batch file, read in one pass in memory that does not
    grow with its requests: its requests, shapes (the chains of prefix signatures run-batch's
    producers declare), prompt tokens, tokens in prefixes shared by 2+ requests, and what a
    cache of each size serves in arrival order (the sim's cache, block for block) and in the
    product's shape-grouped order, with its bound (an unbounded cache). The grouped order is
    modelled from per-shape figures: shapes walked one after another (those sharing leading
    components next to each other), each shape's requests together; a request finds its
    shape's declared prefix, in full blocks, while the cache holds it (a shape's first
    request: what it shares with the shape before it), and of its own tokens what it shares
    with the request of its shape before it (up to 32 blocks). Other text requests share
    beyond their declared prefixes is counted in arrival order only. A file
    run-batch would refuse is refused the same way (path:line)."""
    from pipeline.analysis.workload import analyze_workload
    from pipeline.producer.demos import named_workload
    from pipeline.runtime.settings import DEMO_ITEMS

    sizes = _sizes(cache_tokens)
    if model_dir is not None:
        from pipeline.cli.analyze_batch import analyze_batch_file

        analyze_batch_file(workload, model_dir, served_model_name, chat_template, block_tokens, sizes, caches, items,
                           top, as_json)
        return
    if served_model_name is not None or chat_template is not None:
        raise click.ClickException("--served-model-name and --chat-template are for a batch file: give --model")
    try:
        loaded = named_workload(workload, items, seed=seed, default_items=DEMO_ITEMS)
        result = analyze_workload(loaded, block_tokens, sizes, caches, top)
    except PipelineError:
        raise  # a WorkloadError: the group prints it (a bad file's message lists its bad lines)
    except ValueError as exc:  # bad generator or analysis arguments
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print_analysis(result)


def _print_analysis(result: dict) -> None:
    shapes, shared, bound = result["shapes"], result["shared_prefix"], result["bound"]
    click.echo(f"workload: {result['workload']}: {result['items']:,} items, {result['input_tokens']:,} input tokens")
    click.echo(f"blocks of {result['block_tokens']} tokens; {shapes['count']:,} shapes, chain depth up to "
               f"{shapes['max_depth']}")
    click.echo(f"in prefixes shared by 2+ items: {shared['item_tokens']:,} tokens ({shared['share']:.1%} of input), "
               f"{shared['distinct_tokens']:,} distinct")
    click.echo(f"bound (one unbounded cache, prefix-sorted): {bound['reuse']:.1%} of input tokens from cache")
    if shapes["top"]:
        click.echo(f"\n{'items':>8} {'tokens':>12} {'components':>10} {'depth':>5} {'model':>5}  signature")
        for s in shapes["top"]:
            click.echo(f"{s['items']:>8,} {s['tokens']:>12,} {s['components']:>10} {s['depth']:>5} {s['model']:>5}  "
                       f"{s['signature']}")
    click.echo(f"\n{'order':<14} {'cache tokens':>13} {'caches':>6} {'hit tokens':>13} {'reuse':>7}")
    for run in result["reuse"]:
        size = "unbounded" if run["cache_tokens"] is None else f"{run['cache_tokens']:,}"
        click.echo(f"{run['order']:<14} {size:>13} {run['caches']:>6} {run['hit_tokens']:>13,} {run['reuse']:>7.1%}")


@tools.command("cleanup")
@click.argument("data_dir", type=click.Path(file_okay=False, readable=False))
@click.option("--yes", is_flag=True, help="Remove what is listed (without it: a dry run, nothing removed).")
@click.option("--discard-unstored", is_flag=True,
              help="Also remove producer rings holding items the broker never stored (they are lost).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def cleanup_command(data_dir: str, yes: bool, discard_unstored: bool, as_json: bool) -> None:
    """What a crashed run of DATA_DIR left: its rings, semaphores and memory tier in
    /dev/shm, stale pid files and a socket nobody listens on; listed, and removed with
    --yes. Nothing of a live run (refused while a broker or a launch holds the data
    directory, and whatever a live process still maps), of another data directory or of
    another user is touched, nor a ring holding items never stored (unless
    --discard-unstored)."""
    from pipeline.runtime.cleanup import apply_cleanup, held_run_lock, plan_cleanup

    with held_run_lock(data_dir):
        plan = plan_cleanup(data_dir, discard_unstored)
        removed = apply_cleanup(plan) if yes else []
    if as_json:
        click.echo(json.dumps({"data_dir": plan.data_dir, "prefix": plan.prefix, "dry_run": not yes,
                               "remove": [found.to_json() for found in plan.remove],
                               "keep": [found.to_json() for found in plan.keep],
                               "removed": [found.to_json() for found in removed]}, indent=2))
        return
    verb = "removed" if yes else "would remove"
    click.echo(f"cleanup of {plan.data_dir} (objects named {plan.prefix}*): "
               + ("removing what a stopped run left" if yes else "dry run, nothing removed; --yes removes what is listed"))
    for found in removed if yes else plan.remove:
        click.echo(f"{verb}: {found.kind} {found.path}: {found.why}")
    for found in plan.keep:
        click.echo(f"kept: {found.kind} {found.path}: {found.why}")
    done = len(removed) if yes else len(plan.remove)
    click.echo(f"{verb} {done}, kept {len(plan.keep)}" if done or plan.keep else "nothing left behind: nothing to clean")


@tools.command("check")
@click.argument("data_dir", type=click.Path(file_okay=False))
@click.option("--workload", required=True, help="What the producers submitted: 'demo', 'demo-chat' or a workload file.")
@click.option("--items", type=click.IntRange(min=1), default=None, help="As given to the run (demo: how many).")
@click.option("--workload-seed", "seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="As given to the run.")
@click.option("--duplicate-bound", type=click.IntRange(min=0), default=None,
              help="Fail when more duplicate results lines than this (items in flight at a fault).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check_command(data_dir: str, workload: str, items: int | None, seed: int, duplicate_bound: int | None,
                  as_json: bool) -> None:
    """Every item of WORKLOAD against what runs on DATA_DIR left: results of every run, live
    store entries, unstored ring records. Exit 1 unless lost = unexpected = corrupt = 0 (and
    duplicates within --duplicate-bound)."""
    import dataclasses

    from pipeline.producer.demos import named_workload
    from pipeline.audit.sources import check_data_dir
    from pipeline.runtime.settings import DEMO_ITEMS

    verdict = check_data_dir(named_workload(workload, items, seed=seed, default_items=DEMO_ITEMS), data_dir,
                             duplicate_bound)
    if as_json:
        click.echo(json.dumps({**dataclasses.asdict(verdict), "passed": verdict.passed}, indent=2))
    else:
        click.echo(verdict.line())
        for kind, keys in verdict.examples.items():
            click.echo(f"  {kind}: {', '.join(keys)}")
    if not verdict.passed:
        sys.exit(1)


@tools.command("check-job")
@click.option("-i", "--input-file", "input_file", required=True, type=click.Path(dir_okay=False),
              help="The job's requests (run-batch's -i).")
@click.option("-o", "--output-file", "output_file", required=True, type=click.Path(dir_okay=False),
              help="The job's output (run-batch's -o).")
@click.option("--error-file", type=click.Path(dir_okay=False),
              help="The job's error file, where it had one: failures there, only successes in the output.")
@click.option("--output-order", type=click.Choice(["input", "completion"]), default="input", show_default=True,
              help="As the job ran: input also checks that the answers follow their requests' order.")
@click.option("--summary-file", type=click.Path(dir_okay=False),
              help="The job's summary to hold to the files (default: the output's name with .summary.json, where "
                   "that exists).")
@click.option("--work-dir", type=click.Path(file_okay=False),
              help="Where the audit's temporary files go, 72 bytes a request (default: the system's temporary "
                   "directory).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check_job_command(input_file: str, output_file: str, error_file: str | None, output_order: str,
                      summary_file: str | None, work_dir: str | None, as_json: bool) -> None:
    """A finished batch job's output (and error file) against its input: each request's
    custom_id answered exactly once; each line an OpenAI batch output line; failures in the
    error file where there is one; answers in input order; each 200 answer fits its request
    (model, object, choices, usage); the job's summary agrees. Streams the files, in memory
    that does not depend on their length. Exit 1 on any problem, naming examples path:line."""
    import os
    import tempfile

    from pipeline.batchjob.audit import JobFiles, audit_job
    from pipeline.batchjob.auditrules import TITLES
    from pipeline.batchjob.plan import SUMMARY_SUFFIX

    if summary_file is None and os.path.lexists(output_file + SUMMARY_SUFFIX):
        summary_file = output_file + SUMMARY_SUFFIX
    files = JobFiles(input_file, output_file, error_file, summary_file)
    with tempfile.TemporaryDirectory(prefix="check-job-", dir=work_dir) as scratch:
        result = audit_job(files, output_order, scratch)
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2))
    else:
        click.echo(f"check-job: {result.line()}")
        for kind, count in result.counts.items():
            shown = result.examples.get(kind, [])
            click.echo(f"{kind} ({count:,}): {TITLES[kind]}")
            for example in shown:
                click.echo(f"  {example}")
            if count > len(shown):
                click.echo(f"  ... and {count - len(shown):,} more")
    if not result.ok:
        sys.exit(1)
