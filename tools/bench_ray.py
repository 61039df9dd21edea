#!/usr/bin/env python3
"""Benchmark `pipeline run-batch --ray` on a local Ray cluster (needs the `ray` extra:
`python3 quickstart.py test-ray` builds .venv-ray).

    .venv-ray/bin/python tools/bench_ray.py [--requests 900] [--out /tmp/bench-ray]

Three runs of one job, each on a fresh local cluster, with GPU-bound sim consumers (the sim
cost model, so that the makespan is the consumers' simulated GPU time, not this machine's
cores): one node with the whole cache; three nodes, a third of the cache each, routed by
shape; the same three nodes routed round-robin (what an actor pool does). Reported per run:
the consumers' makespan (first dispatch to last completion over every node, one clock: the
nodes share this machine), throughput over it, prefix reuse (cached / prompt tokens), and
the routing's keys and splits. Throughput is also given over the driver's wall time, which
includes starting the nodes. Per node: items, batches, the routing's planned load, the
simulated GPU seconds the cost model charged (the floor of the node's makespan, whatever
this machine's load) and the node's own makespan; and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# And for every process the runs start (the driver, Ray's workers, the node processes they
# spawn): a venv with the project installed in editable mode points at whichever checkout
# installed it, which need not be this one.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

# The sim's cost model: a 7B prefill on one GPU and a step's fixed cost (engines/sim.py).
COST = {"cost_s_per_padded_token": 1e-4, "cost_s_per_batch": 5e-3}
# The total prefix cache of the job, in tokens: one node holds it all, three a third each.
TOTAL_CACHE_TOKENS = 3 * 8192
HEALTH_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
OBJECT_STORE_BYTES = 128 << 20
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def job(requests: int, seed: int = 0) -> list[dict]:
    """Chat requests under 4 system prompts (~150 words) x 30 few-shot blocks (~100 words)
    each, a short question each: 120 shapes whose prefixes together outgrow a third of the
    cache, in random order."""
    rng = random.Random(seed)
    systems = [text(rng, 150) for _ in range(4)]
    shots = [[text(rng, 60), text(rng, 40)] for _ in range(120)]
    records = []
    for k in range(requests):
        family = rng.randrange(120)
        messages = [{"role": "system", "content": systems[family % 4]},
                    {"role": "user", "content": shots[family][0]}, {"role": "assistant", "content": shots[family][1]},
                    {"role": "user", "content": f"question {k}: {text(rng, 12)}"}]
        records.append({"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "tiny-llama", "messages": messages, "max_completion_tokens": 4}})
    return records


def run(label: str, nodes: int, route: str, source: Path, model_dir: str, out: Path) -> dict:
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    os.makedirs(os.path.join(root, "ray"))
    os.environ["RAY_TMPDIR"] = root
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"shape_broker_node_0": 1}, "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False, "_system_config": HEALTH_CONFIG})
    for k in range(1, nodes):
        cluster.add_node(num_cpus=1, resources={f"shape_broker_node_{k}": 1}, object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    config = out / f"{label}.toml"
    options = {**COST, "capacity_tokens": TOTAL_CACHE_TOKENS // nodes}
    config.write_text("[engine_options]\n" + "".join(f"{k} = {v!r}\n" for k, v in options.items()))
    data = out / f"{label}.job"
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", "-i", str(source),
                               "-o", str(out / f"{label}.out.jsonl"), "--model", model_dir, "--data-dir", str(data),
                               "--report", str(out / f"{label}.json"), "--consumers", "1", "--config", str(config),
                               "--ray", cluster.address, "--ray-node-dir", os.path.join(root, "n"),
                               "--ray-route", route], capture_output=True, text=True, cwd=ROOT)
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{label}: run-batch failed: {done.stderr[-2000:]}")
    report = json.loads((out / f"{label}.json").read_text())["cluster"]
    by_node = {path.stem[len("node-"):]: [json.loads(line) for line in path.read_text().splitlines()]
               for path in sorted(data.glob("results/ray-*/node-*.jsonl"))}
    rows = [row for node_rows in by_node.values() for row in node_rows]
    makespan_s = (max(r["done_ns"] for r in rows) - min(r["dispatch_ns"] for r in rows)) / 1e9
    planned = report["routing"].get("planned_load_tokens", {})
    per_node = {slot: {**node_figures(node_rows), "planned_load_tokens": planned.get(slot)}
                for slot, node_rows in by_node.items()}
    return {"run": label, "nodes": nodes, "route": route, "items": len(rows), "makespan_s": makespan_s,
            "items_per_s": len(rows) / makespan_s, "prefix_reuse": report["total"]["prefix_reuse"],
            "wall_s": report["total"]["wall_s"], "wall_items_per_s": report["total"]["items_per_s"],
            "keys": report["routing"]["keys"], "split_shapes": report["routing"]["split_shapes"],
            "per_node_items": {slot: node["answered"] for slot, node in report["nodes"].items()},
            "per_node": per_node}


def node_figures(rows: list[dict]) -> dict:
    """One node's makespan, and what the sim's cost model charged its consumers (each batch:
    its padded tokens less the cached ones, times the per-token cost, plus the batch cost):
    the node's simulated GPU time, which its makespan cannot be shorter than."""
    batches: dict[int, list[dict]] = {}
    for row in rows:
        batches.setdefault(row["batch_id"], []).append(row)
    charged_tokens = sum(len(b) * b[0]["pad_to_tokens"] - sum(r["cached_tokens"] for r in b) for b in batches.values())
    return {"items": len(rows), "batches": len(batches),
            "makespan_s": (max(r["done_ns"] for r in rows) - min(r["dispatch_ns"] for r in rows)) / 1e9,
            "sim_gpu_s": charged_tokens * COST["cost_s_per_padded_token"] + len(batches) * COST["cost_s_per_batch"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=900)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench-ray"))
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    load_at_start = os.getloadavg()
    import pipeline
    from tools.tiny_llama import build

    print(f"pipeline from {Path(pipeline.__file__).parent}", file=sys.stderr)

    model_dir = str(out / "tiny-llama")
    build(model_dir)
    source = out / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in job(args.requests)))
    results = [run("one-node", 1, "shape", source, model_dir, out),
               run("three-nodes-shape", 3, "shape", source, model_dir, out),
               run("three-nodes-round-robin", 3, "round-robin", source, model_dir, out)]
    base = results[0]["items_per_s"]
    print("| run | nodes | route | makespan s | items/s | x one node | prefix reuse | keys | splits | items per node |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['nodes']} | {r['route']} | {r['makespan_s']:.2f} | {r['items_per_s']:.1f} | "
              f"{r['items_per_s'] / base:.2f} | {r['prefix_reuse']:.1%} | {r['keys']} | {r['split_shapes']} | "
              f"{r['per_node_items']} |")
    print()
    print("| run | node | items | batches | planned load tokens | sim GPU s | makespan s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for slot, node in r["per_node"].items():
            print(f"| {r['run']} | {slot} | {node['items']} | {node['batches']} | {node['planned_load_tokens']} | "
                  f"{node['sim_gpu_s']:.2f} | {node['makespan_s']:.2f} |")
    print(f"\nload average at the start: {load_at_start}, at the end: {os.getloadavg()}")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
