"""`pipeline bench serve`: the batch service (`pipeline serve`) as a client uses it (the
official `openai` client: upload, create, poll, download), against `pipeline run-batch` on
the same files, in one run. Three measurements, each side a fresh server (measured once its
/health says its engines serve, as a client waits for a server) or command:

- overhead: one file of OVERHEAD_REQUESTS chat requests through the service (upload to the
  output downloaded) against `pipeline run-batch` (the command's wall time): requests/s;
- four jobs: FOUR_REQUESTS requests over one pool of system prompts, split in four files,
  submitted at once to a service running four at a time (--max-concurrent-batches 4),
  against the four files through run-batch one after the other: the makespan, and the
  cached prompt tokens of the four together;
- a deadline: a long job (LONG_REQUESTS, a day's window; alone it takes longer than
  DEADLINE_DELAY_S and SHORT_WINDOW together) and, DEADLINE_DELAY_S later, a short one
  (SHORT_REQUESTS) whose window is SHORT_WINDOW, on a service running one batch at a time:
  whether the short one completes within its window (behind the long one in submission
  order it could not), how often the long one made way, and its cached share against the
  same long job alone.

The engine is the sim with a cost per padded token (COST_S_PER_PADDED_TOKEN; a cached token
costs nothing), so that a job takes long enough for a deadline to matter and reuse shows in
time. The files are the run-batch comparison's chat requests (chat_batch.py).

Targets (the batch service's issue): (a) the four jobs at once cache at least the prompt
tokens of the four one after the other, in a shorter makespan; (b) the short job completes
within its window, and the long job's cached share stays within LONG_REUSE_POINTS points of
its share alone; (c) the service's requests/s within OVERHEAD_SHARE of run-batch's.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.bench import batch_sides, chat_batch, runs
from lab.bench.harness import BenchContext, Outcome, Target, alternate, fmt_spread, python_command, spread_of, table
from lab.bench.run_batch import build_model

OVERHEAD_REQUESTS, QUICK_OVERHEAD_REQUESTS = 20_000, 1_000
FOUR_REQUESTS, QUICK_FOUR_REQUESTS = 8_000, 800
LONG_REQUESTS, QUICK_LONG_REQUESTS = 40_000, 2_000
SHORT_REQUESTS = 400
SHAPES = 32
SHORT_WINDOW = "60s"
DEADLINE_DELAY_S = 10.0
COST_S_PER_PADDED_TOKEN = 1e-4
BLOCK_TOKENS = 32
# Targets.
OVERHEAD_SHARE = 0.05
LONG_REUSE_POINTS = 2.0
# A server starts in seconds; a job of these sizes ends within minutes on 2 busy cores.
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 1800
# How often the client asks for a batch's status: each ask costs the server and the client a
# few milliseconds of CPU, a share of the 2 cores the job runs on when asked too often.
POLL_S = 0.25
ADDRESS = re.compile(rb"http://127\.0\.0\.1:(\d+)/v1")
TERMINAL = ("completed", "failed", "expired", "cancelled")


def write_requests(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def engine_args(cost: bool) -> list[str]:
    args = ["--model", str(batch_sides.MODEL_DIR), "--engine", "sim"]
    return args + (["--engine-options", runs.sim_cost_options(COST_S_PER_PADDED_TOKEN, None, BLOCK_TOKENS)]
                   if cost else [])


class Service:
    """One `pipeline serve` on a fresh data directory, stopped (SIGTERM) by `close`."""

    def __init__(self, work: Path, concurrent: int, cost: bool) -> None:
        work.mkdir(parents=True)
        self.log_path = work / "server.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*python_command(), "serve", "--data-dir", str(work / "data"), "--port", "0",
                 "--max-concurrent-batches", str(concurrent), *engine_args(cost)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=runs.child_env(), cwd=runs.ROOT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (found := ADDRESS.search(self.log_path.read_bytes())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise runs.BenchRunError(f"pipeline serve did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(POLL_S)
        from openai import OpenAI

        base = f"http://127.0.0.1:{int(found.group(1))}"
        while not _healthy(base):  # ready as a client sees it: the engines serve
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise runs.BenchRunError(f"pipeline serve did not get ready: {self.log_path.read_text()[-2000:]}")
            time.sleep(POLL_S)
        self.client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)

    def submit(self, path: Path, window: str = "24h") -> str:
        with open(path, "rb") as f:
            source = self.client.files.create(file=f, purpose="batch")
        return self.client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                          completion_window=window).id

    def wait(self, batch_ids: list[str]) -> dict[str, Any]:
        """Every batch ended: {id: (the Batch object, when it was seen ended)}."""
        deadline, seen = time.monotonic() + JOB_TIMEOUT_S, {}
        while len(seen) < len(batch_ids):
            for batch_id in batch_ids:
                if batch_id not in seen:
                    batch = self.client.batches.retrieve(batch_id)
                    if batch.status in TERMINAL:
                        seen[batch_id] = (batch, time.monotonic())
            if time.monotonic() > deadline:
                raise runs.BenchRunError(f"batches {batch_ids} did not end: {self.log_path.read_text()[-2000:]}")
            time.sleep(POLL_S)
        return seen

    def download(self, batch) -> int:
        return len(self.client.files.content(batch.output_file_id).content) if batch.output_file_id else 0

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _healthy(base: str) -> bool:
    """The server's /health says ok (503 while its node starts)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def usage_of(batch) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of an ended batch."""
    usage = batch.usage
    return usage.input_tokens, usage.input_tokens_details.cached_tokens


def run_batch(path: Path, out: Path, cost: bool) -> dict[str, Any]:
    """`pipeline run-batch` on `path`: its wall time and its summary's usage."""
    out.mkdir(parents=True)
    command = [*python_command(), "run-batch", "-i", str(path), "-o", str(out / "out.jsonl"), *engine_args(cost)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=runs.child_env(), cwd=runs.ROOT,
                          timeout=JOB_TIMEOUT_S)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise runs.BenchRunError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    usage = json.loads((out / "out.jsonl.summary.json").read_text())["job"]["usage"]
    return {"wall_s": wall_s, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["cached_tokens"]}


class Sides:
    """Each measurement's two sides, as harness.alternate runs them (a fresh directory a run)."""

    def __init__(self, ctx: BenchContext) -> None:
        self.ctx = ctx
        self.runs = 0
        model = batch_sides.MODEL_NAME
        work = ctx.work_dir
        self.single = write_requests(work / "single.jsonl",
                                     chat_batch.requests(ctx.size(OVERHEAD_REQUESTS, QUICK_OVERHEAD_REQUESTS), SHAPES,
                                                         model, seed=1))
        pool = chat_batch.requests(ctx.size(FOUR_REQUESTS, QUICK_FOUR_REQUESTS), SHAPES, model, seed=2)
        self.four = [write_requests(work / f"four-{k}.jsonl", pool[k::4]) for k in range(4)]
        self.long = write_requests(work / "long.jsonl",
                                   chat_batch.requests(ctx.size(LONG_REQUESTS, QUICK_LONG_REQUESTS), SHAPES, model,
                                                       seed=3))
        self.short = write_requests(work / "short.jsonl", chat_batch.requests(SHORT_REQUESTS, SHAPES, model, seed=4))

    def _dir(self, tag: str) -> Path:
        self.runs += 1
        return self.ctx.work_dir / f"{tag}-{self.runs}"

    def run_batch_single(self) -> dict[str, Any]:
        got = run_batch(self.single, self._dir("rb"), cost=False)
        return {**got, "requests_per_s": _lines(self.single) / got["wall_s"]}

    def service_single(self) -> dict[str, Any]:
        service = Service(self._dir("serve"), 1, cost=False)
        try:
            started = time.monotonic()
            batch_id = service.submit(self.single)
            batch, _ = service.wait([batch_id])[batch_id]
            service.download(batch)
            wall_s = time.monotonic() - started
        finally:
            service.close()
        _check(batch, _lines(self.single))
        prompt, cached = usage_of(batch)
        return {"wall_s": wall_s, "requests_per_s": _lines(self.single) / wall_s, "prompt_tokens": prompt,
                "cached_tokens": cached}

    def four_in_turn(self) -> dict[str, Any]:
        done = [run_batch(path, self._dir("rb4"), cost=True) for path in self.four]
        return {"makespan_s": sum(d["wall_s"] for d in done), "prompt_tokens": sum(d["prompt_tokens"] for d in done),
                "cached_tokens": sum(d["cached_tokens"] for d in done)}

    def four_at_once(self) -> dict[str, Any]:
        service = Service(self._dir("serve4"), 4, cost=True)
        try:
            started = time.monotonic()
            ids = [service.submit(path) for path in self.four]
            ended = service.wait(ids)
            makespan_s = max(seen for _, seen in ended.values()) - started
        finally:
            service.close()
        for path, batch_id in zip(self.four, ids):
            _check(ended[batch_id][0], _lines(path))
        usage = [usage_of(batch) for batch, _ in ended.values()]
        return {"makespan_s": makespan_s, "prompt_tokens": sum(p for p, _ in usage),
                "cached_tokens": sum(c for _, c in usage)}

    def long_alone(self) -> dict[str, Any]:
        service = Service(self._dir("long"), 1, cost=True)
        try:
            batch_id = service.submit(self.long)
            batch, _ = service.wait([batch_id])[batch_id]
        finally:
            service.close()
        _check(batch, _lines(self.long))
        prompt, cached = usage_of(batch)
        return {"long_cached_share": cached / prompt, "long_s": batch.completed_at - batch.created_at}

    def long_and_short(self) -> dict[str, Any]:
        service = Service(self._dir("deadline"), 1, cost=True)
        try:
            long_id = service.submit(self.long)
            time.sleep(DEADLINE_DELAY_S)
            short_id = service.submit(self.short, SHORT_WINDOW)
            ended = service.wait([long_id, short_id])
        finally:
            service.close()
        (long, _), (short, _) = ended[long_id], ended[short_id]
        _check(long, _lines(self.long))
        preemptions = service.log_path.read_text(errors="replace").count(f"batch {long_id}: stops for batch")
        prompt, cached = usage_of(long)
        return {"long_cached_share": cached / prompt, "long_s": long.completed_at - long.created_at,
                "short_status": short.status, "short_s": (short.completed_at or short.expired_at) - short.created_at,
                "short_window_s": short.expires_at - short.created_at,
                "short_answered": short.request_counts.completed, "long_preempted": preemptions}


def _lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _check(batch, requests: int) -> None:
    if batch.status != "completed" or batch.request_counts.completed != requests:
        raise runs.BenchRunError(f"batch {batch.id}: {batch.status}, {batch.request_counts.completed} of {requests} "
                                 f"answered")


def measure(ctx: BenchContext) -> dict[str, Any]:
    build_model(sys.executable)
    sides = Sides(ctx)
    ctx.log(f"  overhead: {_lines(sides.single):,} requests through run-batch and through the service")
    overhead = alternate([("run-batch", sides.run_batch_single), ("service", sides.service_single)], ctx.repeat)
    ctx.log(f"  four jobs of {_lines(sides.four[0]):,} requests: run-batch in turn against the service, four at once")
    four = alternate([("run-batch, one after the other", sides.four_in_turn),
                      ("service, four at once", sides.four_at_once)], ctx.repeat)
    ctx.log(f"  a deadline: {_lines(sides.long):,} requests alone, and with {SHORT_REQUESTS} due in {SHORT_WINDOW}")
    deadline = alternate([("long job alone", sides.long_alone), ("long job, then a short one", sides.long_and_short)],
                         ctx.repeat)
    return {"requests": {"overhead": _lines(sides.single), "four_each": _lines(sides.four[0]),
                         "long": _lines(sides.long), "short": SHORT_REQUESTS},
            "cost_s_per_padded_token": COST_S_PER_PADDED_TOKEN, "short_window": SHORT_WINDOW,
            "deadline_delay_s": DEADLINE_DELAY_S,
            "overhead": _spreads(overhead), "four": _spreads(four), "deadline": _spreads(deadline)}


def _spreads(sides: dict[str, list[dict]]) -> dict[str, Any]:
    return {side: {**{key: spread_of(found, key) for key, value in found[0].items()
                      if isinstance(value, (int, float))}, "runs": found} for side, found in sides.items()}


def judge(figures: dict[str, Any]) -> list[Target]:
    over, four, dead = figures["overhead"], figures["four"], figures["deadline"]
    rb, sv = over["run-batch"]["requests_per_s"]["median"], over["service"]["requests_per_s"]["median"]
    turn, once = four["run-batch, one after the other"], four["service, four at once"]
    alone, both = dead["long job alone"], dead["long job, then a short one"]
    shorts = [(run["short_status"], run["short_s"], run["short_window_s"]) for run in both["runs"]]
    behind_s = alone["long_s"]["median"] - figures["deadline_delay_s"]  # the long job's time left at the short's creation
    points = 100 * (alone["long_cached_share"]["median"] - both["long_cached_share"]["median"])
    return [
        Target("(a) four jobs at once cache at least the prompt tokens of the four one after the other, in a "
               "shorter makespan",
               once["cached_tokens"]["median"] >= turn["cached_tokens"]["median"]
               and once["makespan_s"]["median"] < turn["makespan_s"]["median"],
               f"cached {once['cached_tokens']['median']:,.0f} against {turn['cached_tokens']['median']:,.0f} tokens; "
               f"makespan {once['makespan_s']['median']:.1f} s against {turn['makespan_s']['median']:.1f} s (medians)"),
        Target(f"(b) the short job completes within its {SHORT_WINDOW} window behind the long one, whose cached "
               f"share stays within {LONG_REUSE_POINTS:g} points of its share alone",
               all(status == "completed" and took <= window for status, took, window in shorts)
               and points <= LONG_REUSE_POINTS,
               f"short job: {', '.join(f'{status} in {took} s' for status, took, _ in shorts)} (in submission order "
               f"it would have waited about {behind_s:.0f} s for the long one); the long one made way "
               f"{fmt_spread(both['long_preempted'])} times; long job cached "
               f"{100 * both['long_cached_share']['median']:.1f}% against {100 * alone['long_cached_share']['median']:.1f}% "
               f"alone ({points:+.1f} points lost)"),
        Target(f"(c) the service within {OVERHEAD_SHARE:.0%} of run-batch's requests/s on one file",
               sv >= (1 - OVERHEAD_SHARE) * rb, f"{sv:,.0f} against {rb:,.0f} requests/s ({sv / rb:.3f}x, medians)"),
    ]


def markdown(figures: dict[str, Any]) -> str:
    n = figures["requests"]
    over, four, dead = figures["overhead"], figures["four"], figures["deadline"]
    return "\n".join([
        f"The official `openai` client against `pipeline serve` (upload, create, poll until ended, download), and "
        f"`pipeline run-batch` on the same files; the tiny model's tokenizer, the sim engine; jobs of chat requests "
        f"over {SHAPES} system prompts and few-shot blocks (chat_batch.py).", "",
        f"Overhead: one file of {n['overhead']:,} requests, the sim at zero cost:", "",
        table(["side", "requests/s", "wall s", "cached tokens"],
              [[side, fmt_spread(v["requests_per_s"]), fmt_spread(v["wall_s"], ".1f"), fmt_spread(v["cached_tokens"])]
               for side, v in over.items()]), "",
        f"Four jobs of {n['four_each']:,} requests over one pool of prompts, the sim at "
        f"{figures['cost_s_per_padded_token']:g} s a padded token:", "",
        table(["side", "makespan s", "prompt tokens", "cached tokens"],
              [[side, fmt_spread(v["makespan_s"], ".1f"), fmt_spread(v["prompt_tokens"]), fmt_spread(v["cached_tokens"])]
               for side, v in four.items()]), "",
        f"A deadline: a job of {n['long']:,} requests, and {figures['deadline_delay_s']:g} s later one of "
        f"{n['short']:,} due in {figures['short_window']}, one batch at a time:", "",
        table(["side", "long job cached share", "long job s", "short job"],
              [[side, fmt_spread(_percent(v["long_cached_share"]), ".1f") + " %", fmt_spread(v["long_s"], ".0f"),
                ", ".join(f"{r['short_status']} in {r['short_s']} s" for r in v["runs"]) if "short_s" in v else "-"]
               for side, v in dead.items()])])


def _percent(s: dict[str, Any]) -> dict[str, Any]:
    return {key: [100 * x for x in value] if key == "values" else 100 * value for key, value in s.items()}


class ServeComparison:
    name = "serve"
    title = "The batch service against run-batch: overhead, four jobs at once, a deadline"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures))


COMPARISON = ServeComparison()
