"""`pipeline bench run-batch-mix`: `vllm run-batch` against `pipeline run-batch --engine
vllm --consumers 1` on a file of the parameters vLLM users send (lab/bench/mix_batch.py:
plain chat, `response_format` json_schema, `logprobs` with top_logprobs, `n: 2`) over
a few dozen system prompts, with the same vLLM settings (lab/bench/batch_sides.py),
alternating and repeated, each side a fresh process, as `pipeline bench run-batch` runs them.

Measured per request kind: whether the two sides' answers are the same (run k of one side
against run k of the other, matched by custom_id; each side against its own first run
too, the noise floor), and the cached prompt tokens (usage.prompt_tokens_details); the
span and wall of each run as run_batch.py measures them. Without an interpreter that
imports vllm (run_batch.vllm_python), the figures say why and nothing is judged.

Targets: the same answers where sampling is greedy, token for token on at least
SAME_SHARE of the requests; at least the cached prompt tokens of `vllm run-batch` on every
request kind; no slower, in the span and in the command's wall time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.bench import batch_sides, mix_batch
from lab.bench.charts import Panel, cell, grouped_bars
from lab.bench.harness import BenchContext, Outcome, Target, alternate, fmt_spread, spread_of, table
from lab.bench.run_batch import SIDES, build_model, vllm_python

# A few hundred requests: each full run of a side is about a minute on 2 cores (engine start
# and the structured-output grammar's first compile included).
REQUESTS = 400
QUICK_REQUESTS = 40
# A few dozen system prompts: every shape its own.
SHAPES = 36
QUICK_SHAPES = 8
# Batches of another composition may flip a near tie of the greedy choice.
SAME_SHARE = 0.99
SIDE_KEYS = ("span_s", "wall_s", "prompt_tokens", "cached_tokens", "completion_tokens")
KIND_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens", "cacheable_tokens")


def measure(ctx: BenchContext) -> dict[str, Any]:
    python, tried = vllm_python(ctx.quick)
    if python is None:
        return {"vllm": None, "tried": tried}
    build_model(python)
    count, shapes = ctx.size(REQUESTS, QUICK_REQUESTS), ctx.size(SHAPES, QUICK_SHAPES)
    reqs = mix_batch.requests(count, shapes, batch_sides.MODEL_NAME, seed=0)
    batch = ctx.work_dir / "mix-batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    ids = [r["custom_id"] for r in reqs]
    settings = batch_sides.engine_settings(batch_sides.KV_CACHE_MIB)
    threads = batch_sides.engine_threads()
    answers: dict[str, list[dict[str, mix_batch.Answer]]] = {name: [] for name in SIDES}
    counter = [0]

    def side(name: str, run: Callable[[Path], dict]) -> tuple[str, Callable[[], dict]]:
        def once() -> dict:
            counter[0] += 1
            ctx.log(f"  {name}, {count:,} mixed requests (run {counter[0]})")
            row = run(ctx.work_dir / f"mix-run-{counter[0]}")
            row.update(batch_sides.check_output(row["output"], ids))
            found = mix_batch.answers_of(Path(row["output"]).read_text().splitlines())
            answers[name].append(found)
            row["by_kind"] = mix_batch.usage_by_kind(found, settings["block_size"])
            return row
        return name, once

    runs = alternate([
        side(SIDES[0], lambda d: batch_sides.run_vllm(batch, d, settings, threads, python)),
        side(SIDES[1], lambda d: batch_sides.run_product(batch, d, settings, 1, threads, python))], ctx.repeat)
    return {"vllm": python, "tried": tried, "requests": count, "shapes": shapes,
            "kinds": {k: sum(mix_batch.kind_of(i) == k for i in ids) for k in mix_batch.KINDS},
            "engine": settings, "threads": threads, "cores": len(os.sched_getaffinity(0)),
            "sides": {name: side_figures(rows) for name, rows in runs.items()},
            "answers": answer_figures(answers[SIDES[0]], answers[SIDES[1]]),
            "runs": {name: [{k: v for k, v in r.items() if k != "output"} for r in rows]
                     for name, rows in runs.items()}}


def side_figures(rows: list[dict]) -> dict[str, Any]:
    """A side's spreads over its runs, overall and per kind."""
    out: dict[str, Any] = {key: spread_of(rows, key) for key in SIDE_KEYS}
    out["by_kind"] = {kind: {key: spread_of([r["by_kind"][kind] for r in rows], key) for key in KIND_KEYS}
                      for kind in mix_batch.KINDS}
    return out


def answer_figures(vllm_runs: list[dict], product_runs: list[dict]) -> dict[str, Any]:
    """Run k of each side against run k of the other (`pairs`), and each side's later runs
    against its own first (`vllm_self`, `product_self`: how far a side repeats itself)."""
    return {"pairs": [mix_batch.agreement(v, p) for v, p in zip(vllm_runs, product_runs)],
            "vllm_self": [mix_batch.agreement(vllm_runs[0], v) for v in vllm_runs[1:]],
            "product_self": [mix_batch.agreement(product_runs[0], p) for p in product_runs[1:]]}


def _worst(agreements: list[dict], kind: str) -> tuple[int, int] | None:
    """(same, requests) of the pair with the fewest same answers of `kind`; None: no pair."""
    found = [(a[kind]["same"], a[kind]["requests"]) for a in agreements]
    return min(found, key=lambda x: x[0] / x[1] if x[1] else 1.0) if found else None


def judge(figures: dict[str, Any]) -> list[Target]:
    names = [f"the same answers where sampling is greedy (token for token on >= {SAME_SHARE:.0%} of requests)",
             "at least the cached prompt tokens of vllm run-batch on every request kind",
             "no slower than vllm run-batch (span)",
             "no slower than vllm run-batch (the command's wall time)"]
    if figures["vllm"] is None:
        reason = "vllm is not importable: " + "; ".join(figures["tried"])
        return [Target(name, None, reason) for name in names]
    shares = [mix_batch.greedy_share(pair) for pair in figures["answers"]["pairs"]]
    same, total = min(shares, key=lambda x: x[0] / x[1] if x[1] else 1.0)
    v, p = (figures["sides"][name] for name in SIDES)
    cached = {k: (p["by_kind"][k]["cached_tokens"]["median"], v["by_kind"][k]["cached_tokens"]["median"],
                  v["by_kind"][k]["cacheable_tokens"]["median"]) for k in mix_batch.KINDS}
    vs, ps = v["span_s"]["median"], p["span_s"]["median"]
    vw, pw = v["wall_s"]["median"], p["wall_s"]["median"]
    return [Target(names[0], total > 0 and same >= SAME_SHARE * total,
                   f"{same:,} of {total:,} ({same / total if total else 0:.1%}), the worst of "
                   f"{len(shares)} pairs of runs"),
            Target(names[1], all(pc >= vc for pc, vc, _ in cached.values()),
                   "; ".join(f"{k}: {pc:,.0f} against {vc:,.0f} of {most:,.0f} cacheable"
                             for k, (pc, vc, most) in cached.items())),
            Target(names[2], ps <= vs, f"{ps:.2f} s against {vs:.2f} s"),
            Target(names[3], pw <= vw, f"{pw:.1f} s against {vw:.1f} s")]


def _share(found: tuple[int, int] | None) -> str:
    return "-" if found is None else f"{found[0]:,} of {found[1]:,}"


def _kind_rows(figures: dict[str, Any]) -> list[list[str]]:
    v, p = (figures["sides"][name] for name in SIDES)
    a = figures["answers"]
    rows = []
    for kind in mix_batch.KINDS:
        diffs = [pair[kind]["max_logprob_diff"] for pair in a["pairs"] if pair[kind]["max_logprob_diff"] is not None]
        vk, pk = v["by_kind"][kind], p["by_kind"][kind]
        rows.append([kind, f"{figures['kinds'][kind]:,}", fmt_spread(vk["cached_tokens"]),
                     fmt_spread(pk["cached_tokens"]), fmt_spread(pk["cacheable_tokens"]),
                     fmt_spread(pk["prompt_tokens"]),
                     _share(_worst(a["pairs"], kind)), _share(_worst(a["vllm_self"], kind)),
                     _share(_worst(a["product_self"], kind)), f"{max(diffs):.2g}" if diffs else "-"])
    return rows


def markdown(figures: dict[str, Any]) -> str:
    if figures["vllm"] is None:
        return "Not measured: vllm is not importable (" + "; ".join(figures["tried"]) + ")."
    e = figures["engine"]
    sides = table(["side", "processing span s", "wall s", "cached prompt tokens", "prompt tokens",
                   "completion tokens"],
                  [[name] + [fmt_spread(s[k], f) for k, f in (("span_s", ".2f"), ("wall_s", ".1f"),
                                                               ("cached_tokens", ",.0f"), ("prompt_tokens", ",.0f"),
                                                               ("completion_tokens", ",.0f"))]
                   for name, s in figures["sides"].items()])
    kinds = table(["kind", "requests", "cached tokens, vllm run-batch", "cached tokens, pipeline run-batch",
                   "cacheable tokens", "prompt tokens", "same answers, pipeline against vllm", "vllm against itself",
                   "pipeline against itself", "largest logprob difference"], _kind_rows(figures))
    return (f"`vllm run-batch` against `pipeline run-batch --engine vllm --consumers 1` on the same file: "
            f"{figures['requests']:,} chat requests over {figures['shapes']} shapes, each its own system prompt "
            "and few-shot turns (Zipf-like, shuffled; lab/bench/mix_batch.py), a quarter of each kind: "
            f"`plain` (temperature 0), `json_schema` (temperature 0, `response_format` of a two-key schema, "
            f"at most {mix_batch.JSON_MAX_COMPLETION_TOKENS} tokens), `logprobs` (temperature 0, "
            f"`top_logprobs: {mix_batch.TOP_LOGPROBS}`) and `n2` (`n: {mix_batch.SAMPLES}`, temperature "
            f"{mix_batch.SAMPLED_TEMPERATURE:g}, `min_tokens` its max tokens, no seed: vLLM refuses n > 1 at "
            "temperature 0, and a seeded request kills `vllm run-batch`'s engine core on this CPU build, whose "
            "generators have no offset to rewind). "
            "Engine settings, the same vLLM flags on both command lines: the tiny model with random weights, "
            f"`{' '.join(batch_sides.vllm_flags(e))}` (KV cache {e['kv_cache_memory_bytes'] >> 20} MiB; "
            "max num seqs and batched tokens are vLLM's server defaults on the CPU, which `vllm.LLM` has larger), "
            f"prefix caching on, {figures['threads']} engine thread(s) on {figures['cores']} cores "
            "(vLLM binds its worker to the cores less one it keeps for its scheduler process; the product's "
            "cpu_threads, the same count, one core kept for its broker and producers), vLLM's defaults for the "
            "rest (engine core in its own process, chunked prefill). Same answers: run k of one side "
            "against run k of the other, matched by custom_id: every choice's content, the completion's token "
            "count and (logprobs) every chosen token equal; `n2` only the number of choices (sampled). The worst "
            "pair of runs is shown; each side against its own first run beside it. Largest logprob difference: "
            "of a chosen token, where the tokens are the same. Cached tokens: "
            "usage.prompt_tokens_details.cached_tokens, summed; cacheable: the most a cache of these blocks "
            "could serve, every full block of each prompt but one holding its last token. For `n: 2` vLLM's usage "
            "reports the cached tokens of the sample that finished last, which has reused the blocks its sibling "
            "computed: both sides sit at the cacheable ceiling there (hence `min_tokens`: without it a sample "
            "that stopped early left its sibling to report, a block short, on either side at random). Span and "
            "wall as in the run-batch comparison above; on both sides most of the span passes before the first "
            "answer, while vLLM's worker compiles its logprobs rank kernel (torch.compile of "
            "batched_count_greater_than, Inductor on the CPU) at the "
            f"first request with logprobs. Interpreter: `{figures['vllm']}`.\n\n" + sides + "\n\n" + kinds)


def plot(figures: dict[str, Any]) -> Callable[[Path], None] | None:
    if figures["vllm"] is None:
        return None
    sides = list(figures["sides"])

    def draw(path: Path) -> None:
        grouped_bars(path, "vllm run-batch against pipeline run-batch, mixed parameters (same engine settings)", [
            Panel("cached prompt tokens per request kind", "tokens", list(mix_batch.KINDS), sides,
                  [[cell(figures["sides"][s]["by_kind"][k]["cached_tokens"]) for s in sides]
                   for k in mix_batch.KINDS]),
            Panel("time", "seconds", ["processing span", "wall"], sides,
                  [[cell(figures["sides"][s][k]) for s in sides] for k in ("span_s", "wall_s")])])
    return draw


class RunBatchMixComparison:
    name = "run-batch-mix"
    title = "Every parameter vLLM users send: vllm run-batch against pipeline run-batch on a mixed file"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), plot(figures))


COMPARISON = RunBatchMixComparison()
