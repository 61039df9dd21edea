"""`pipeline tools analyze FILE --model DIR`: an OpenAI Batch file's figures before a run.
`pipeline/batchjob/preview.py` makes each request's item as run-batch's producers do, in one
pass over the file; `pipeline/analysis/batchfile.py` counts them. Progress goes to stderr
while it reads; the figures to stdout (a table, or JSON)."""

from __future__ import annotations

import json
import os
import time

import click

from pipeline.analysis.batchfile import BatchFileAnalysis
from pipeline.analysis.reuse import ARRIVAL
from pipeline.analysis.workload import DEFAULT_BLOCK_TOKENS
from pipeline.batchjob.preview import BatchPreview, PreviewCounts

# A progress line this often while the file is read (run-batch's rate for a log file).
PROGRESS_INTERVAL_S = 5.0


def analyze_batch_file(path: str, model_dir: str, served_model: str | None, chat_template: str | None,
                       block_tokens: int | None, sizes: list[int], caches: int, items: int | None, top: int,
                       as_json: bool) -> None:
    """The command's batch-file branch: check, read, print (ClickException for a bad option;
    a PipelineError, a bad file's or model directory's, goes to the group's one-line rule)."""
    if caches != 1:
        raise click.ClickException(f"--caches {caches}: a batch file is analyzed through one cache (its shape-grouped "
                                   f"order is one walk of its shapes)")
    try:
        analysis = BatchFileAnalysis(block_tokens or DEFAULT_BLOCK_TOKENS, sizes)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    preview = BatchPreview(path, model_dir, served_model, chat_template)
    counts = preview.run(analysis.add, items, _Progress(path))
    result = {"workload": path, "model": model_dir, "served_model": preview.served_model,
              **_counts(counts, items), **analysis.finish(top)}
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        _print(result)


def _counts(counts: PreviewCounts, limit: int | None) -> dict:
    analyzed = counts.requests if limit is None else min(limit, counts.requests)
    return {"requests": counts.requests, "analyzed": analyzed, "made": counts.made,
            "refused": {"count": counts.refused,
                        "examples": [{"line": line, "message": message} for line, message in counts.examples]}}


class _Progress:
    """A line on stderr every PROGRESS_INTERVAL_S while the file is read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.started = self.said = time.monotonic()
        try:
            self.size = os.path.getsize(path)
        except OSError:
            self.size = 0

    def __call__(self, read_bytes: int, requests: int) -> None:
        now = time.monotonic()
        if now - self.said < PROGRESS_INTERVAL_S:
            return
        self.said = now
        of = f" of {self.size / 1e6:,.0f}" if self.size else ""
        click.echo(f"analyze: {self.path}: {read_bytes / 1e6:,.0f}{of} MB read, {requests:,} requests so far, "
                   f"{requests / (now - self.started):,.0f}/s", err=True)


def _print(result: dict) -> None:
    shapes, shared, bound, refused = result["shapes"], result["shared_prefix"], result["bound"], result["refused"]
    analyzed = "" if result["analyzed"] == result["requests"] else f", the first {result['analyzed']:,} analyzed"
    click.echo(f"batch file: {result['workload']}: {result['requests']:,} requests{analyzed} (model "
               f"{result['model']}, served as {result['served_model']})")
    if refused["count"]:
        click.echo(f"  {refused['count']:,} would be answered 400 by run-batch's producers (not counted below), e.g.:")
        for example in refused["examples"]:
            click.echo(f"    line {example['line']}: {example['message']}")
    click.echo(f"{result['made']:,} prompts, {result['prompt_tokens']:,} prompt tokens; blocks of "
               f"{result['block_tokens']} tokens; {shapes['count']:,} shapes, chain depth up to {shapes['max_depth']}")
    click.echo(f"in prefixes shared by 2+ requests: {shared['request_tokens']:,} tokens ({shared['share']:.1%} of "
               f"prompt tokens), {shared['distinct_tokens']:,} distinct")
    click.echo(f"bound (one unbounded cache, shape-grouped): {bound['reuse']:.1%} of prompt tokens "
               f"from cache")
    if shapes["top"]:
        click.echo(f"\n{'requests':>9} {'tokens':>12} {'prefix':>7} {'components':>10} {'first line':>10}  signature")
        for s in shapes["top"]:
            click.echo(f"{s['requests']:>9,} {s['tokens']:>12,} {s['prefix_tokens']:>7,} {s['components']:>10} "
                       f"{s['first_line']:>10,}  {s['signature']}")
    click.echo(f"\n{'order':<14} {'cache tokens':>13} {'hit tokens':>13} {'reuse':>7}")
    for run in result["reuse"]:
        click.echo(f"{run['order']:<14} {run['cache_tokens']:>13,} {run['hit_tokens']:>13,} {run['reuse']:>7.1%}")
    arrival = {run["cache_tokens"]: run["hit_tokens"] for run in result["reuse"] if run["order"] == ARRIVAL}
    if any(run["hit_tokens"] < arrival[run["cache_tokens"]] for run in result["reuse"] if run["order"] != ARRIVAL):
        click.echo("(arrival finds more where requests share full blocks beyond their declared prefixes with a "
                   "request other than the one of their shape before them; the shape-grouped model does not count "
                   "those)")
