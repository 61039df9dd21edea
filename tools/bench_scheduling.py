"""Scheduling beyond the design note (issue 15): shape orders and affinity, GPU-bound.

    PYTHONPATH=. .venv/bin/python tools/bench_scheduling.py            # about 15 minutes
    PYTHONPATH=. .venv/bin/python tools/bench_scheduling.py --quick    # tiny sizes, a smoke run
    ... --json out.json --repeat 2 --keep DIR

For each workload (the Mooncake synthetic trace, demo-chat) and each sim cache size (64 Ki and
1 Mi tokens per consumer), `pipeline tools analyze --caches 2` gives the prefix-reuse bound
(its prefix-sorted order, the better of its orders), then `pipeline launch` runs it on 2 sim
consumers under each policy:

    most-tokens          --shape-order most-tokens  (the design note; affinity off: the default)
    most-tokens+aff      --shape-order most-tokens --set broker.affinity=true
    prefix               --shape-order prefix
    prefix+aff           --shape-order prefix --set broker.affinity=true

The consumers are made the bottleneck with the sim's cost model (`cost_s_per_padded_token`
X, `cost_s_per_batch` = 50 X, the ratio of the sim's GPU figures: 5 ms a step against 0.1 ms
a token), X chosen per workload so a run lasts tens of seconds while the broker alone (X = 0)
takes a few. The block size is the same for the sim and the analyzer: 512 tokens for the
trace (its hash blocks: its token ids are only defined per 512-token block) and 16 for
demo-chat (the sim's and vLLM's default). The embedded demo (`pipeline launch`, no workload,
zero cost) is run under each policy too: padding efficiency and shape switches.

Per run, from the report and the results files (batch_id, dispatch_ns, done_ns per item):
prefix reuse and its share of the bound, makespan, each consumer's busy fraction of the
makespan and of the window while work was queued (first to last dispatch; a consumer's batch
runs from max(its dispatch, the consumer's previous completion) to its completion), shape
switches by reason, padding efficiency, batch fill.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the payload -> shape map reads the workloads with this tree's code
    sys.path.insert(0, str(ROOT))
from lab.bench import runs  # noqa: E402  (launch and analyze, shared with `pipeline bench prefix`)

TRACE = ROOT.parent / "shared" / "workloads" / "mooncake_synthetic_trace.jsonl"
if not TRACE.exists():
    TRACE = Path("/work/shared/workloads/mooncake_synthetic_trace.jsonl")
CACHES = (65536, 1048576)
BATCH_COST_PER_TOKEN_COST = runs.BATCH_COST_PER_TOKEN_COST
POLICIES = {
    "most-tokens": ["--shape-order", "most-tokens", "--set", "broker.affinity=false"],
    "most-tokens+aff": ["--shape-order", "most-tokens", "--set", "broker.affinity=true"],
    "prefix": ["--shape-order", "prefix", "--set", "broker.affinity=false"],
    "prefix+aff": ["--shape-order", "prefix", "--set", "broker.affinity=true"],
}
# Issue 15's targets.
REUSE_SHARE_1M = 0.95
REUSE_SHARE_64K = 0.85
BUSY_TARGET = 0.95
DEMO_EFFICIENCY = 0.985


def workloads(quick: bool) -> list[dict]:
    items_trace = ["--items", "400"] if quick else []
    chat_items = 1000 if quick else 10000
    return [
        dict(name="mooncake", workload=str(TRACE), items=400 if quick else None, block=512, cost=2e-6,
             launch=["--workload", str(TRACE), "--max-input-len", "262144", "--max-batch-tokens", "262144",
                     *items_trace],
             analyze=[str(TRACE), *items_trace]),
        dict(name="demo-chat", workload="demo-chat", items=chat_items, block=16, cost=1.5e-5,
             launch=["--workload", "demo-chat", "--items", str(chat_items)],
             analyze=["demo-chat", "--items", str(chat_items)]),
    ]


def analyze(w: dict) -> dict:
    """The bound per cache size: the best order of `tools analyze --caches 2` at that size."""
    found = runs.analyze(w["analyze"], w["block"], CACHES, caches=2)
    return dict(bounds=found["bounds"], shapes=found["shapes"], input_tokens=found["input_tokens"])


def launch(args: list[str], report: Path, data_dir: Path) -> dict:
    started = time.monotonic()
    try:
        rep = runs.launch(args, report, data_dir, keep=True)
    except runs.BenchRunError as e:
        raise SystemExit(str(e)) from None
    rep["_wall_cmd_s"] = time.monotonic() - started
    return rep


def shapes_by_payload(name: str, items: int | None) -> dict[bytes, int]:
    """Each item's shape signature by its payload (unique in these workloads)."""
    from pipeline.producer.demos import named_workload
    return {item.payload: item.signature for item in named_workload(name, items)}


def batch_timeline(data_dir: Path, shape_of: dict[bytes, int]) -> tuple[dict, dict]:
    """Per consumer: its batches (dispatch_ns, done_ns), from the results files; and its
    shapes served, its switches (a batch of another shape than its previous one, in dispatch
    order; the first counts) and the shapes that ran on more than one consumer."""
    per, shapes = {}, {}
    for path in sorted((data_dir / "results").glob("run-*/*.jsonl")):
        batches = {}
        with path.open() as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                b = batches.setdefault(r["batch_id"], [r["dispatch_ns"], r["done_ns"], None])
                b[1] = max(b[1], r["done_ns"])
                b[2] = shape_of.get(base64.b64decode(r["payload"]))
        per[path.stem] = sorted((d, e) for d, e, _ in batches.values())
        seq = [sig for _d, _e, sig in sorted(batches.values(), key=lambda b: b[0])]
        shapes[path.stem] = dict(served=set(seq), switches=sum(1 for a, b in zip([None, *seq], seq) if a != b))
    seen: dict[int, int] = {}
    for row in shapes.values():
        for sig in row["served"]:
            seen[sig] = seen.get(sig, 0) + 1
    summary = {c: dict(shapes=len(r["served"]), switches=r["switches"]) for c, r in shapes.items()}
    summary["_on_several"] = sum(1 for n in seen.values() if n > 1)
    summary["_shapes"] = len(seen)
    return per, summary


def busy_while_queued(per: dict) -> dict:
    """Each consumer's busy share of [first dispatch, last dispatch] (work was queued), its
    batches running back to back from max(dispatch, previous completion) to completion."""
    all_batches = [b for v in per.values() for b in v]
    if not all_batches:
        return {}
    t0 = min(d for d, _ in all_batches)
    t1 = max(d for d, _ in all_batches)
    end = max(e for _, e in all_batches)
    out = {}
    for name, batches in per.items():
        busy, prev = 0, t0
        for d, e in sorted(batches, key=lambda b: b[1]):
            start = max(d, prev)
            busy += max(0, min(e, t1) - min(start, t1))
            prev = e
        last_done = max((e for _, e in batches), default=t0)
        out[name] = dict(queued_busy=busy / max(t1 - t0, 1), tail_idle_s=(end - last_done) / 1e9,
                         batches=len(batches))
    out["_queued_window_s"] = (t1 - t0) / 1e9
    return out


def row_of(workload: str, policy: str, cache, rep: dict, data_dir: Path, shape_of: dict, bound) -> dict:
    per = rep["per_consumer"]
    batches, shapes = batch_timeline(data_dir, shape_of)
    timeline = busy_while_queued(batches)
    names = sorted(c for c in shapes if not c.startswith("_"))
    return dict(
        shapes_served=[shapes[c]["shapes"] for c in names],
        consumer_switches=[shapes[c]["switches"] for c in names],
        shapes_on_several=shapes["_on_several"], shapes_run=shapes["_shapes"],
        workload=workload, policy=policy, cache=cache, bound=bound,
        prefix_reuse=rep["prefix_reuse"],
        share=None if not bound else rep["prefix_reuse"] / bound,
        makespan_s=rep["makespan_s"],
        busy=[per[c]["busy_fraction"] for c in sorted(per)],
        queued_busy=[timeline[c]["queued_busy"] for c in sorted(timeline) if not c.startswith("_")],
        tail_idle_s=[timeline[c]["tail_idle_s"] for c in sorted(timeline) if not c.startswith("_")],
        items=[per[c]["items"] for c in sorted(per)],
        switches=rep["shape_switches_by_reason"], padding_efficiency=rep["padding_efficiency"],
        mean_batch_fill=rep["mean_batch_fill"], batches=rep["batches_routed"],
        accounting_ok=rep["accounting_ok"], wall_s=rep["wall_s"])


def pct(v) -> str:
    return "" if v is None else f"{100 * v:.1f}"


def fmt_table(rows: list[dict]) -> str:
    head = ("| workload | cache | policy | bound % | reuse % | of bound % | makespan s | busy % c0/c1 | "
            "busy while queued % c0/c1 | items c0/c1 | switches (init/drain/take) | switches / shapes c0, c1 | "
            "shapes on both | pad eff % | fill % |")
    lines = [head, "|" + "|".join(["---"] * 15) + "|"]
    for r in rows:
        sw = r["switches"]
        cache = "" if r["cache"] is None else (f"{r['cache'] // 1024} Ki" if r["cache"] < 1 << 20 else "1 Mi")
        lines.append(
            f"| {r['workload']} | {cache} | {r['policy']} | {pct(r['bound'])} | {pct(r['prefix_reuse'])} | "
            f"{pct(r['share'])} | {r['makespan_s']:.2f} | {'/'.join(pct(b) for b in r['busy'])} | "
            f"{'/'.join(pct(b) for b in r['queued_busy'])} | {'/'.join(str(i) for i in r['items'])} | "
            f"{sw.get('initial', 0)}/{sw.get('drained', 0)}/{sw.get('takeover', 0)} | "
            f"{', '.join(f'{a}/{b}' for a, b in zip(r['consumer_switches'], r['shapes_served']))} | "
            f"{r['shapes_on_several']} of {r['shapes_run']} | "
            f"{pct(r['padding_efficiency'])} | {pct(r['mean_batch_fill'])} |")
    return "\n".join(lines)


def verdicts(rows: list[dict], demo_shapes: int | None) -> list[str]:
    out = []
    by = {(r["workload"], r["cache"], r["policy"], r.get("rep", 0)): r for r in rows}
    for r in rows:
        if r["workload"] == "demo":
            ok_eff = r["padding_efficiency"] >= DEMO_EFFICIENCY
            ok_sw = all(s <= n for s, n in zip(r["consumer_switches"], r["shapes_served"]))
            out.append(f"demo {r['policy']} rep {r.get('rep', 0)}: padding {100 * r['padding_efficiency']:.2f}% "
                       f"({'met' if ok_eff else 'MISSED'}); switches per consumer "
                       f"{', '.join(f'{a} of {b} shapes served' for a, b in zip(r['consumer_switches'], r['shapes_served']))} "
                       f"({'met' if ok_sw else 'MISSED'}); the workload has {demo_shapes} shapes")
            continue
        target = REUSE_SHARE_1M if r["cache"] == CACHES[1] else REUSE_SHARE_64K
        base = by.get((r["workload"], r["cache"], "most-tokens", r.get("rep", 0)))
        ratio = None if base is None else r["makespan_s"] / base["makespan_s"]
        out.append(
            f"{r['workload']} {r['cache']} {r['policy']} rep {r.get('rep', 0)}: reuse {pct(r['share'])}% of bound "
            f"(target {pct(target)}: {'met' if r['share'] >= target else 'MISSED'}); busy while queued "
            f"{'/'.join(pct(b) for b in r['queued_busy'])} ({'met' if min(r['queued_busy']) >= BUSY_TARGET else 'MISSED'}); "
            f"makespan / most-tokens {'' if ratio is None else f'{ratio:.3f}'}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="write every row and verdict as JSON here")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every GPU-bound row")
    parser.add_argument("--keep", metavar="DIR", help="keep each run's data directory (results files) here")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    parser.add_argument("--only", default="", help="comma-separated workloads (mooncake, demo-chat, demo)")
    args = parser.parse_args()
    policies = args.policies.split(",")
    only = set(filter(None, args.only.split(",")))
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-sched-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rows, meta = [], {}
    try:
        for w in workloads(args.quick):
            if only and w["name"] not in only:
                continue
            an = analyze(w)
            shape_of = shapes_by_payload(w["workload"], w["items"])
            meta[w["name"]] = dict(cost_s_per_padded_token=w["cost"], block=w["block"], **an)
            print(f"# {w['name']}: {an['shapes']} shapes, {an['input_tokens']:,} input tokens, bound "
                  + ", ".join(f"{c}: {pct(b)}%" for c, b in an["bounds"].items()), flush=True)
            for rep_i in range(args.repeat):
                for cache in CACHES:
                    for policy in policies:
                        opts = (f"cost_s_per_padded_token={w['cost']},cost_s_per_batch="
                                f"{w['cost'] * BATCH_COST_PER_TOKEN_COST:g},capacity_tokens={cache},"
                                f"block_size_tokens={w['block']}")
                        tag = f"{w['name']}-{cache}-{policy}-{rep_i}"
                        data_dir = scratch / tag
                        rep = launch([*w["launch"], "--engine-options", opts, *POLICIES[policy]],
                                     scratch / f"{tag}.json", data_dir)
                        row = row_of(w["name"], policy, cache, rep, data_dir, shape_of, an["bounds"][cache])
                        row["rep"] = rep_i
                        rows.append(row)
                        print(fmt_table([row]).splitlines()[-1], flush=True)
                        if not args.keep:
                            shutil.rmtree(data_dir, ignore_errors=True)
        demo_shapes = None
        if not only or "demo" in only:
            demo = subprocess.run([*runs.python_command(), "tools", "analyze", "demo", "--top", "0", "--json"],
                                  capture_output=True, text=True, env=runs.child_env(), check=True)
            demo_shapes = json.loads(demo.stdout)["shapes"]["count"]
            demo_items = 20000
            demo_shape_of = shapes_by_payload("demo", demo_items)
            for rep_i in range(args.repeat):
                for policy in policies:
                    tag = f"demo-{policy}-{rep_i}"
                    data_dir = scratch / tag
                    extra = ["--items", str(demo_items)]
                    rep = launch([*extra, *POLICIES[policy]], scratch / f"{tag}.json", data_dir)
                    row = row_of("demo", policy, None, rep, data_dir, demo_shape_of, None)
                    row["rep"] = rep_i
                    rows.append(row)
                    print(fmt_table([row]).splitlines()[-1], flush=True)
                    if not args.keep:
                        shutil.rmtree(data_dir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(fmt_table(rows))
    print()
    checks = verdicts(rows, demo_shapes)
    print("\n".join(checks))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, demo_shapes=demo_shapes, rows=rows,
                                                   verdicts=checks), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
