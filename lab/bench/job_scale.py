"""`pipeline bench job-scale`: a batch job of any size on one node: memory flat in the job's
size, time linear in it, a fast start, a resume that reads what it has once.

Chat requests over a few dozen shared system prompts with short user turns and 16 new
tokens each, through `pipeline run-batch --engine sim` (zero cost: the job's own machinery is
what is measured) at SIZES requests, each a fresh command, with the total PSS of every
process of the job sampled every SAMPLE_INTERVAL_S. Beside them, in the same run: the tree
before the streaming job path (BASELINE_REV, checked out from this repository) on the
BASELINE_SIZE file, and the largest job killed at about half its answers and resumed.

Figures per size: requests/s over the whole command; peak total PSS; time from the command's
start to its first batch dispatched (the earliest `dispatch_ns` of the results files: the
consumers write CLOCK_MONOTONIC, the machine's one clock). The resume: the time from the
second command's start to its first new dispatch, against the time to read every file of
the job's answers once (the results files and the job's answer log and records).

Targets: the largest job completes; its peak PSS within 1.3x of the smallest's and
under 2 GiB; its requests/s within 10% of the smallest's; at BASELINE_SIZE at least 4x the
baseline tree's requests/s; first dispatch under 10 s at 1,000,000 and under 60 s at
10,000,000; the resume's first new dispatch within 2x the read, and one line per custom_id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from lab.bench.harness import BenchContext, Outcome, Target, table

SIZES = (100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (2_000, 20_000)
BASELINE_SIZE = 1_000_000
QUICK_BASELINE_SIZE = 2_000
# The tree before the streaming job path: the side-by-side baseline.
BASELINE_REV = "cc205da"
SYSTEM_PROMPTS = 40
SAMPLE_INTERVAL_S = 0.5
# Any run of the largest job here takes well under this; it only stops a hung one.
RUN_TIMEOUT_S = 4 * 3600
ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()
# Bytes of the job's answer files read at a time when their read is timed.
READ_CHUNK_BYTES = 8 << 20


def write_requests(path: Path, count: int, ignore_eos: bool = True) -> None:
    """`count` chat requests, SYSTEM_PROMPTS system prompts in turn, short user turns, 16 new
    tokens each (ignore_eos: the sim ends an answer early at its end-of-sequence token).
    Without `ignore_eos` for BASELINE_REV, which refuses the parameter and whose sim always
    generates max_tokens: the same answers' length either way."""
    systems = [json.dumps(f"You are assistant {k} of our support team. " + "Answer briefly, politely and "
                          "precisely; cite the manual where you can. " * (4 + k % 9))[1:-1] for k in range(SYSTEM_PROMPTS)]
    head = '{"custom_id":"req-%d","method":"POST","url":"/v1/chat/completions","body":{"model":"tiny-llama",' \
           '"messages":[{"role":"system","content":"%s"},{"role":"user","content":"%s?"}],"max_tokens":16' + \
           (',"ignore_eos":true}}\n' if ignore_eos else '}}\n')
    with open(path, "w") as f:
        chunk = []
        for i in range(count):
            question = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 11))
            chunk.append(head % (i, systems[i % SYSTEM_PROMPTS], question))
            if len(chunk) == 10_000:
                f.write("".join(chunk))
                chunk = []
        f.write("".join(chunk))


# The parts of a process's PSS the peak is broken into (/proc/PID/smaps_rollup): its heap and
# other private memory, the files it maps (segments, libraries), shared memory (the rings).
PSS_PARTS = ("Pss_Anon", "Pss_File", "Pss_Shmem")


class TreeSampler:
    """The peak total PSS of a process and its descendants, sampled on a thread, and its
    parts (PSS_PARTS) at that peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_bytes = 0
        self.peak_parts = dict.fromkeys(PSS_PARTS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            try:
                tree = [psutil.Process(self.pid)]
                tree += tree[0].children(recursive=True)
            except psutil.Error:
                continue
            parts = dict.fromkeys(PSS_PARTS + ("Pss",), 0)
            for process in tree:
                for key, value in _rollup(process.pid).items():
                    parts[key] += value
            if parts["Pss"] > self.peak_bytes:
                self.peak_bytes = parts.pop("Pss")
                self.peak_parts = parts

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def _rollup(pid: int) -> dict[str, int]:
    """A process's PSS and its PSS_PARTS in bytes; nothing for one gone meanwhile."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                key, _, value = line.partition(":")
                if key == "Pss" or key in PSS_PARTS:
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return found


def run_job(source: Path, work: Path, tree: Path | None = None, kill_at_half: int | None = None) -> dict[str, Any]:
    """One `pipeline run-batch` of `source` (the tree at `tree`, default this one); figures."""
    out, data = work / "out.jsonl", work / "data"
    env = dict(os.environ, PYTHONPATH=str(tree or ROOT))
    command = [sys.executable, "-m", "pipeline", "run-batch", "--engine", "sim", "-i", str(source), "-o", str(out),
               "--model", str(MODEL_DIR), "--data-dir", str(data)]
    started_ns = time.monotonic_ns()
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                           cwd=str(tree or ROOT))
    sampler = TreeSampler(job.pid)
    killed = False
    try:
        if kill_at_half is not None:
            killed = _kill_at(job, data, kill_at_half)
        _out, err = job.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        peak = sampler.stop()
        if job.poll() is None:
            job.kill()
    wall_s = (time.monotonic_ns() - started_ns) / 1e9
    if job.returncode != 0 and not killed:
        raise RuntimeError(f"run-batch failed ({job.returncode}): {err[-2000:]}")
    return {"wall_s": wall_s, "peak_pss_bytes": peak, "peak_pss_parts_bytes": sampler.peak_parts,
            "first_dispatch_s": _first_dispatch_s(data, started_ns),
            "killed": killed, "out": str(out), "data": str(data), "stderr_tail": err[-600:]}


def _kill_at(job: subprocess.Popen, data: Path, answers: int) -> bool:
    """kill -9 of the command once its answer records hold `answers` (its children stop
    with it); whether it was killed (it may have finished first)."""
    records = data / "job" / "answers.bin"
    while job.poll() is None:
        if records.exists() and records.stat().st_size // 40 >= answers:
            job.send_signal(signal.SIGKILL)
            job.wait()
            return True
        time.sleep(0.2)
    return False


def _first_dispatch_s(data: Path, started_ns: int, after_ns: int = 0) -> float | None:
    """From `started_ns` to the earliest dispatch in the results files (each file's first
    line is its consumer's earliest batch), counting only batches dispatched after `after_ns`."""
    first = None
    for path in data.glob("results/*/*.jsonl"):
        with open(path, "rb") as f:
            for line in f:
                dispatch = json.loads(line).get("dispatch_ns")
                if isinstance(dispatch, int) and dispatch > after_ns:
                    first = dispatch if first is None else min(first, dispatch)
                    break
    return None if first is None else (first - started_ns) / 1e9


def read_answers_once_s(data: Path) -> float:
    """The time to read every file of the job's answers once (results, answer log, records)."""
    files = [p for p in data.glob("results/**/*.jsonl")] + [p for p in (data / "job").glob("answers.*")]
    started = time.monotonic()
    for path in files:
        with open(path, "rb") as f:
            while f.read(READ_CHUNK_BYTES):
                pass
    return time.monotonic() - started


def check_output(path: Path, count: int) -> bool:
    """One line per custom_id `req-0` .. `req-<count-1>`, every one status 200."""
    seen = bytearray(count)
    with open(path, "rb") as f:
        for line in f:
            row = json.loads(line)
            index = int(row["custom_id"][4:])
            if seen[index] or row["response"]["status_code"] != 200:
                return False
            seen[index] = 1
    return all(seen)


def baseline_tree(ctx: BenchContext) -> Path:
    """BASELINE_REV's files, extracted from this repository into the scratch directory."""
    tree = ctx.work_dir / "baseline-tree"
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE_REV], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def _sized(ctx: BenchContext, count: int, name: str, tree: Path | None = None) -> dict[str, Any]:
    source = ctx.work_dir / (f"requests-{count}.jsonl" if tree is None else f"requests-{count}-{name}.jsonl")
    if not source.exists():
        ctx.log(f"  writing {count:,} requests")
        write_requests(source, count, ignore_eos=tree is None)
    work = ctx.work_dir / f"{name}-{count}"
    work.mkdir(parents=True, exist_ok=True)
    ctx.log(f"  {name}: {count:,} requests")
    row = run_job(source, work, tree)
    row.update(requests=count, requests_per_s=count / row["wall_s"], output_ok=check_output(Path(row["out"]), count))
    subprocess.run(["rm", "-rf", str(work)], check=True)
    return row


def resume_at_half(ctx: BenchContext, source: Path, count: int) -> dict[str, Any]:
    """The job of `source` (`count` requests) killed at about half its answers, then the same
    command again: the read of its answers once and its first new dispatch."""
    work = ctx.work_dir / f"resume-{count}"
    work.mkdir(parents=True, exist_ok=True)
    ctx.log(f"  resume: {count:,} requests, killed at half")
    first = run_job(source, work, kill_at_half=count // 2)
    data = Path(first["data"])
    lock = data / "run" / "broker.lock"
    deadline = time.monotonic() + 300
    while lock.exists() and _holder_alive(lock) and time.monotonic() < deadline:
        time.sleep(0.2)
    read_s = read_answers_once_s(data)
    started_ns = time.monotonic_ns()
    second = run_job(source, work)
    first_new_s = _first_dispatch_s(data, started_ns, after_ns=started_ns)
    ok = check_output(Path(second["out"]), count)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    return {"requests": count, "killed": first["killed"], "read_once_s": read_s, "first_new_dispatch_s": first_new_s,
            "second_wall_s": second["wall_s"], "output_ok": ok}


def _holder_alive(lock: Path) -> bool:
    try:
        return psutil.pid_exists(int(lock.read_text()))
    except (OSError, ValueError):
        return False


def measure(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.size(SIZES, QUICK_SIZES)
    base_size = ctx.size(BASELINE_SIZE, QUICK_BASELINE_SIZE)
    subprocess.run([sys.executable, "-c", f"from tools.tiny_llama import build; build({str(MODEL_DIR)!r})"],
                   cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    tree = baseline_tree(ctx)
    figures: dict[str, Any] = {"sizes": {}, "baseline_rev": BASELINE_REV, "baseline_size": base_size}
    figures["baseline"] = _sized(ctx, base_size, "baseline", tree)
    for count in sizes:
        figures["sizes"][str(count)] = _sized(ctx, count, "product")
    figures["resume"] = resume_at_half(ctx, ctx.work_dir / f"requests-{sizes[-1]}.jsonl", sizes[-1])
    return figures


def judge(figures: dict[str, Any]) -> list[Target]:
    sizes = figures["sizes"]
    small, large = sizes[min(sizes, key=int)], sizes[max(sizes, key=int)]
    at_base = sizes.get(str(figures["baseline_size"]))
    pss = large["peak_pss_bytes"] / small["peak_pss_bytes"]
    rate = large["requests_per_s"] / small["requests_per_s"]
    targets = [
        Target(f"the {large['requests']:,}-request job completes, one line per custom_id", large["output_ok"], ""),
        Target("peak PSS at the largest within 1.3x of the smallest and under 2 GiB",
               pss <= 1.3 and large["peak_pss_bytes"] < 2 << 30,
               f"{large['peak_pss_bytes'] / 2**20:,.0f} MiB against {small['peak_pss_bytes'] / 2**20:,.0f} MiB: "
               f"{pss:.2f}x"),
        Target("requests/s at the largest within 10% of the smallest", rate >= 0.9,
               f"{large['requests_per_s']:,.0f} against {small['requests_per_s']:,.0f}: {rate:.2f}x"),
    ]
    if at_base is not None and not figures["baseline"]["output_ok"]:
        targets.append(Target(f"at {figures['baseline_size']:,} requests, at least 4x the requests/s of "
                              f"{figures['baseline_rev']}", False,
                              "not judged: the baseline did not answer every request: "
                              + figures["baseline"]["stderr_tail"][-300:]))
    elif at_base is not None:
        speedup = at_base["requests_per_s"] / figures["baseline"]["requests_per_s"]
        targets.append(Target(f"at {figures['baseline_size']:,} requests, at least 4x the requests/s of "
                              f"{figures['baseline_rev']}", speedup >= 4,
                              f"{at_base['requests_per_s']:,.0f} against {figures['baseline']['requests_per_s']:,.0f}: "
                              f"{speedup:.2f}x"))
    for count, limit_s in (("1000000", 10.0), ("10000000", 60.0)):
        if count in sizes and sizes[count]["first_dispatch_s"] is not None:
            first = sizes[count]["first_dispatch_s"]
            targets.append(Target(f"first batch dispatched under {limit_s:g} s at {int(count):,} requests",
                                  first < limit_s, f"{first:.1f} s"))
    resume = figures["resume"]
    if resume["first_new_dispatch_s"] is not None:
        targets.append(Target("resume at half: first new batch within 2x the time to read the answers once, and "
                              "one line per custom_id",
                              resume["first_new_dispatch_s"] <= 2 * resume["read_once_s"] and resume["output_ok"],
                              f"{resume['first_new_dispatch_s']:.1f} s against a read of {resume['read_once_s']:.1f} s"))
    return targets


def markdown(figures: dict[str, Any]) -> str:
    head = ["tree", "requests", "requests/s", "peak total PSS MiB", "of it anon / file / shmem MiB",
            "first dispatch s", "output"]
    runs = [(figures["baseline_rev"], figures["baseline"])]
    runs += [("this", row) for _count, row in sorted(figures["sizes"].items(), key=lambda kv: int(kv[0]))]
    rows = [[tree, f"{row['requests']:,}", f"{row['requests_per_s']:,.0f}", f"{row['peak_pss_bytes'] / 2**20:,.0f}",
             " / ".join(f"{row.get('peak_pss_parts_bytes', {}).get(part, 0) / 2**20:,.0f}" for part in PSS_PARTS),
             _seconds(row["first_dispatch_s"]), "ok" if row["output_ok"] else "WRONG"] for tree, row in runs]
    resume = figures["resume"]
    return (f"`pipeline run-batch --engine sim` (zero cost) on chat requests over {SYSTEM_PROMPTS} system prompts, "
            "16 new tokens each, the tiny model (Llama 3's turn tokens); each size a fresh command, total PSS of the "
            f"job's processes sampled every {SAMPLE_INTERVAL_S} s. Baseline: `{figures['baseline_rev']}`, the tree "
            "before the streaming job path, in the same run.\n\n" + table(head, rows) +
            f"\n\nResume: the {resume['requests']:,}-request job killed (kill -9 of run-batch) at half its answers, "
            f"then the same command: first new batch dispatched {_seconds(resume['first_new_dispatch_s'])} s after "
            f"its start, against {resume['read_once_s']:.1f} s to read the job's answer files once; output "
            f"{'one line per custom_id' if resume['output_ok'] else 'WRONG'}.")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


class JobScaleComparison:
    name = "job-scale"
    title = "Jobs of any size: memory flat in the job's size, time linear in it"

    def run(self, ctx: BenchContext) -> Outcome:
        figures = measure(ctx)
        return Outcome(figures, markdown(figures), judge(figures), None)


COMPARISON = JobScaleComparison()
