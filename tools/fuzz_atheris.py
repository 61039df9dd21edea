"""Fuzz campaign over the decoders of tests/fuzz/targets.py, for the
figures in RELIABILITY.md: N inputs per target, crashes (an exception that is not the
target's typed rejection), the slowest input and the largest allocation.

Two engines, the same targets and seeds:

    atheris   coverage-guided (libFuzzer), installed into a venv under /tmp on first use
              (`pip install atheris`; a wheel for Linux x86-64 CPython 3.11, no clang); each
              target runs in its own process with -runs=N, -timeout (a hang) and
              -rss_limit_mb (a memory blow-up) as libFuzzer's limits
    random    a seeded loop of the mutations the hypothesis tests use (tests/fuzz/mutations.py):
              no install, reproducible from --seed; times every input and tracks the
              tracemalloc peak against the target's bound

    python tools/fuzz_atheris.py --engine random --runs 100000
    python tools/fuzz_atheris.py --engine atheris --runs 100000 --targets frame control

Exit status 1 if any target crashed (the first crashing input is written beside the
report, `--out`), 2 if atheris cannot be installed (the pip error printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# What atheris instruments for coverage: the product, not numpy or the interpreter's
# library (instrumenting everything loaded took minutes before the first input).
INSTRUMENTED = ["pipeline", "shm"]
# The targets' names, known before the targets are imported (the child imports them under
# atheris's instrumentation).
TARGET_NAMES = ["batch", "control", "descriptor", "frame", "generation", "results", "segment_read", "segment_scan",
                "store_log", "workload"]

DEFAULT_VENV = "/tmp/atheris-venv"
# libFuzzer's limits for one input: a hang, and a process that grows past what any input
# may make it hold.
ATHERIS_TIMEOUT_S = 10
ATHERIS_RSS_LIMIT_MB = 2048
# How often the random engine measures an input's allocations (tracemalloc slows a run
# several times): every input of the first thousand, then one in this many.
TRACE_EVERY = 10


def random_input(target, rng: random.Random) -> bytes:
    """One fuzzed input: arbitrary bytes (one in eight), else a seed with 1 to 4 mutations."""
    from tests.fuzz import mutations  # noqa: PLC0415 - see TARGET_NAMES

    if rng.random() < 0.125:
        return rng.randbytes(rng.randrange(0, 4096))
    index = rng.randrange(len(target.seeds))
    data = target.seeds[index]
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["flip", "truncate", "insert", "delete", "field", "field", "json", "json"])
        fields = target.fields[index]
        if kind == "json" and target.text:
            new = rng.choice(mutations.ODD_JSON_VALUES)
            if target.name == "control":
                data = mutations.control_value(data, rng.randrange(8), rng.randrange(64), new)
            else:
                action = rng.choice(["value", "value", "value", "drop", "repeat", "whole"])
                data = mutations.mutate_lines(data, rng.randrange(8), action, rng.randrange(64), new)
        elif kind == "field" and fields:
            offset, size = rng.choice(fields)
            value = rng.choice(mutations.interesting_ints(size) + [rng.getrandbits(8 * size)])
            data = mutations.overwrite(data, offset, size, value)
        elif kind == "truncate":
            data = mutations.truncate(data, rng.randrange(len(data) + 1))
        elif kind == "insert":
            data = mutations.insert(data, rng.randrange(1 << 20), rng.randbytes(rng.randint(1, 64)))
        elif kind == "delete":
            data = mutations.delete(data, rng.randrange(1 << 20), rng.randint(1, 64))
        else:
            data = mutations.flip(data, rng.randrange(1 << 20), rng.randrange(8))
    return data


def run_random(target, runs: int, seed: int, out_dir: str) -> dict:
    from tests.fuzz.targets import MAX_MESSAGE_CHARS  # noqa: PLC0415 - see TARGET_NAMES

    rng = random.Random(f"{seed}-{target.name}")
    rejected = crashes = over_bound = 0
    slowest_s, worst_ratio, first_crash = 0.0, 0.0, None
    started = time.monotonic()
    for k in range(runs):
        data = random_input(target, rng)
        traced = k < 1000 or k % TRACE_EVERY == 0
        if traced:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
        t0 = time.monotonic()
        try:
            try:
                target.run(data)
            except target.allowed as exc:
                rejected += 1
                if not 0 < len(str(exc)) <= MAX_MESSAGE_CHARS:  # a rejection must say what, briefly
                    raise AssertionError(f"a {len(str(exc))}-character message: {str(exc)[:200]}") from exc
        except Exception as exc:  # the finding: anything but the typed rejection
            crashes += 1
            if first_crash is None:
                first_crash = f"{type(exc).__name__}: {str(exc)[:300]}"
                with open(os.path.join(out_dir, f"crash-{target.name}.bin"), "wb") as file:
                    file.write(data)
        slowest_s = max(slowest_s, time.monotonic() - t0)
        if traced:
            peak = tracemalloc.get_traced_memory()[1] - before
            tracemalloc.stop()
            bound = target.memory_bound_bytes(len(data))
            worst_ratio = max(worst_ratio, peak / bound)
            over_bound += peak > bound
    return {"target": target.name, "engine": "random", "runs": runs, "rejected": rejected,
            "decoded": runs - rejected - crashes, "crashes": crashes, "first_crash": first_crash,
            "over_memory_bound": over_bound, "worst_peak_over_bound": round(worst_ratio, 3),
            "slowest_input_s": round(slowest_s, 4), "seconds": round(time.monotonic() - started, 1)}


def ensure_atheris(venv: str) -> str:
    """The site-packages holding atheris (installed into `venv` if it is not there yet)."""
    site = os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    if os.path.isdir(os.path.join(site, "atheris")):
        return site
    for command in ([sys.executable, "-m", "venv", venv], [os.path.join(venv, "bin", "pip"), "install", "atheris"]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"fuzz_atheris: {' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}",
                  file=sys.stderr)
            raise SystemExit(2)
    return site


def run_atheris(name: str, runs: int, site: str, out_dir: str) -> dict:
    """One target under atheris in its own process (libFuzzer exits the process at the end)."""
    corpus = os.path.join(out_dir, f"corpus-{name}")
    os.makedirs(corpus, exist_ok=True)
    from tests.fuzz.targets import TARGETS  # noqa: PLC0415 - see TARGET_NAMES

    for k, seed in enumerate(TARGETS[name].seeds):
        with open(os.path.join(corpus, f"seed-{k}"), "wb") as file:
            file.write(seed)
    scratch = tempfile.mkdtemp(prefix="sbrk-fuzz-")  # libFuzzer exits the child: it cannot remove it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, site]), "SBRK_FUZZ_SCRATCH": scratch}
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--",
               f"-runs={runs}", f"-timeout={ATHERIS_TIMEOUT_S}", f"-rss_limit_mb={ATHERIS_RSS_LIMIT_MB}",
               f"-artifact_prefix={out_dir}/crash-{name}-", "-print_final_stats=1", corpus]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log = done.stdout + done.stderr
    with open(os.path.join(out_dir, f"atheris-{name}.log"), "w") as file:
        file.write(log)
    executed = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    peak = re.findall(r"stat::peak_rss_mb:\s*(\d+)", log)
    crashed = done.returncode != 0
    return {"target": name, "engine": "atheris", "runs": int(executed[-1]) if executed else None,
            "crashes": int(crashed), "exit_status": done.returncode,
            "first_crash": log[-1500:] if crashed else None, "peak_rss_mb": int(peak[-1]) if peak else None,
            "seconds": round(time.monotonic() - started, 1)}


def child(name: str, libfuzzer_args: list[str]) -> None:
    import atheris  # noqa: PLC0415 - only in the child, from the campaign's venv

    with atheris.instrument_imports(include=INSTRUMENTED):
        from tests.fuzz.targets import MAX_MESSAGE_CHARS, TARGETS, close_all  # noqa: PLC0415 - see TARGET_NAMES
    target = TARGETS[name]

    def one_input(data: bytes) -> None:
        try:
            target.run(data)
        except target.allowed as exc:
            if not 0 < len(str(exc)) <= MAX_MESSAGE_CHARS:  # a rejection must say what, briefly
                raise AssertionError(f"a {len(str(exc))}-character message: {str(exc)[:200]}") from exc

    atheris.Setup([sys.argv[0], *libfuzzer_args], one_input)
    try:
        atheris.Fuzz()
    finally:
        close_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["random", "atheris"], default="random")
    parser.add_argument("--runs", type=int, default=10_000, help="inputs per target")
    parser.add_argument("--targets", nargs="*", default=TARGET_NAMES, choices=TARGET_NAMES)
    parser.add_argument("--seed", type=int, default=0, help="the random engine's seed")
    parser.add_argument("--venv", default=DEFAULT_VENV, help="where atheris is installed (created if missing)")
    parser.add_argument("--out", default="/tmp/fuzz-campaign", help="report, logs and crashing inputs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, [a for a in rest if a != "--"])
        return
    from tests.fuzz.targets import TARGETS, close_all  # noqa: PLC0415 - see TARGET_NAMES

    assert sorted(TARGETS) == TARGET_NAMES, sorted(TARGETS)
    os.makedirs(args.out, exist_ok=True)
    site = ensure_atheris(args.venv) if args.engine == "atheris" else ""
    rows = []
    try:
        for name in args.targets:
            row = (run_atheris(name, args.runs, site, args.out) if args.engine == "atheris"
                   else run_random(TARGETS[name], args.runs, args.seed, args.out))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        close_all()
    with open(os.path.join(args.out, f"report-{args.engine}.json"), "w") as file:
        json.dump(rows, file, indent=1)
    if any(row["crashes"] for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
