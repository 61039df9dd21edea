"""Kill campaigns through the whole-run commands: kill -9 of the launcher
or of its broker under `pipeline launch`, and of the `pipeline run-batch` process, its
broker or a consumer; after each kill the run is taken up again the way a user does it (the
next `pipeline launch` on the data directory takes over what the killed one left; the same
`pipeline run-batch` command finishes the job), and the checker judges every item.

A launch is killed only once all of its workload is stored (the broker received it): a
launch killed while its producers submit leaves the rest of its workload unsubmitted, by
design (its report says how many; a rerun does not submit them), so those items were never
attempted. Kills during submission are the stage campaign's (`kills.producer_kills`, and
broker kills while `pipeline produce` runs).

Owner: one caller at a time per work directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time

from pipeline.batchjob.scan import envelope
from pipeline.batchjob.workload import job_workload
from lab.reliability.kills import Outcome, check, concatenate
from lab.reliability.procs import COMMAND_TIMEOUT_S, Stages, gone, kill, spawn, wait_until, write_workload
from pipeline.audit.sources import check_data_dir, results_dirs
from pipeline.runtime import daemon

# Settings of every run here: two sim consumers whose batches take a while (a run lasts
# seconds, so a kill lands in it), a fixed credit (the duplicate bound), a short heartbeat.
CONSUMERS = 2
MAX_BATCH = 16
CREDIT = 4
BATCH_COST_S = 0.05
RUN_SETTINGS = ("--consumers", str(CONSUMERS), "--max-batch", str(MAX_BATCH), "--set", f"consumer.credit={CREDIT}",
                "--set", "broker.heartbeat_timeout_s=1.0", "--set", f"engine_options.cost_s_per_batch={BATCH_COST_S}")
# Items one kill may deliver twice: what the consumers held (their credit and the batch in hand).
IN_FLIGHT_BOUND = CONSUMERS * (CREDIT + 1) * MAX_BATCH
# A kill lands this long after the run was seen working, at most (uniform from 0).
MAX_KILL_DELAY_S = 0.6


def _broker_lock_pid(data_dir: str) -> int | None:
    return daemon.read_pid(os.path.join(data_dir, "run", "broker.lock"))


def _wait_for_orphans(data_dir: str) -> None:
    """Until the killed run's broker is gone (its children stop on their own: PDEATHSIG)."""
    pid = _broker_lock_pid(data_dir)
    if pid is not None:
        wait_until(lambda: gone(pid), COMMAND_TIMEOUT_S, f"the killed run's broker (pid {pid}) to stop")


def launch_kills(work: str, kills: int, seed: int, items: int = 4000) -> Outcome:
    """`kills` launches, each of a fresh workload, killed (the launcher or its broker, seeded)
    once its workload is stored; a last launch runs to its end and takes over the rest."""
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(seed)
    out = Outcome("launcher and broker kill -9 (pipeline launch)")
    data = os.path.join(work, "data")
    stages = Stages(data)  # only for its status reader
    workloads = []
    for k in range(kills + 1):
        path = write_workload(os.path.join(work, f"w{k}.jsonl"), items, seed + k, key=f"l{k}")
        workloads.append(path)
        launch = spawn("launch", "--workload", path, "--data-dir", data, *RUN_SETTINGS)
        if k == kills:
            _err = launch.communicate(timeout=COMMAND_TIMEOUT_S)[1]
            if launch.returncode != 0:
                raise RuntimeError(f"the last launch failed: exit {launch.returncode}: {_err.strip()[-1500:]}")
            break

        def stored() -> bool:  # items_received: from rings, not recovered ones; adopted: earlier rings'
            status = stages.status()
            return launch.poll() is not None or (
                status is not None and status.items_received - status.items_adopted >= items)

        wait_until(stored, COMMAND_TIMEOUT_S, "the launch's workload to be stored")
        time.sleep(rng.uniform(0, MAX_KILL_DELAY_S))
        target = rng.choice(("launcher", "broker"))
        pid = launch.pid if target == "launcher" else _broker_lock_pid(data)
        if launch.poll() is not None or pid is None or gone(pid):
            out.notes.append(f"launch {k} ended before its kill")
            launch.communicate(timeout=COMMAND_TIMEOUT_S)
            continue
        kill(pid)
        out.faults[f"{target} kill -9"] = out.faults.get(f"{target} kill -9", 0) + 1
        launch.communicate(timeout=COMMAND_TIMEOUT_S)
        _wait_for_orphans(data)
    whole = concatenate(workloads, os.path.join(work, "all.jsonl"))
    out.verdict = check(data, whole, out.bound(IN_FLIGHT_BOUND))
    out.wall_s = time.monotonic() - started
    return out


def _answered(data_dir: str) -> int:
    lines = 0
    for path in results_dirs(data_dir):
        for name in os.listdir(path):
            if name.endswith(".jsonl"):
                with open(os.path.join(path, name), "rb") as file:
                    lines += file.read().count(b"\n")
    return lines


def run_batch_kills(work: str, kills: int, seed: int, requests_path: str, model_dir: str) -> Outcome:
    """`pipeline run-batch` of `requests_path`, killed `kills` times (the run-batch process,
    its broker or a consumer, seeded) once it answers, each time run again with the same
    command; then the output file (one line per request, status 200) and the checker."""
    os.makedirs(work, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(seed)
    out = Outcome("run-batch, broker and consumer kill -9 (pipeline run-batch)")
    data, output = os.path.join(work, "job"), os.path.join(work, "out.jsonl")
    args = ("run-batch", "--engine", "sim", "-i", requests_path, "-o", output, "--model", model_dir, "--data-dir", data,
            "--keep-data-dir", *RUN_SETTINGS)
    stages = Stages(data)
    faults = 0
    while not os.path.exists(output):
        job = spawn(*args)
        killed = False
        if faults < kills:
            base = _answered(data)
            wait_until(lambda: job.poll() is not None or _answered(data) > base, COMMAND_TIMEOUT_S, "answers")
            time.sleep(rng.uniform(0, MAX_KILL_DELAY_S / 3))
            target = rng.choice(("run-batch", "broker", "consumer"))
            pid = _target_pid(target, job.pid, data, stages)
            if job.poll() is None and pid is not None and not gone(pid):
                kill(pid)
                faults, killed = faults + 1, True
                out.faults[f"{target} kill -9"] = out.faults.get(f"{target} kill -9", 0) + 1
        _err = job.communicate(timeout=COMMAND_TIMEOUT_S)[1]
        if job.returncode != 0 and not killed:
            raise RuntimeError(f"run-batch failed on its own: exit {job.returncode}: {_err.strip()[-1500:]}")
        _wait_for_orphans(data)
    with open(requests_path, "rb") as file:
        wanted = [envelope(line.rstrip(b"\n")).custom_id for line in file if line.strip()]
    with open(output) as file:
        rows = [json.loads(line) for line in file]
    ids = [row["custom_id"] for row in rows]
    if ids != wanted or {row["response"]["status_code"] for row in rows} != {200}:
        out.notes.append(f"output file: {len(rows)} lines for {len(wanted)} requests, statuses "
                         f"{sorted({row['response']['status_code'] for row in rows})}: not one 200 line per request")
        out.verdict = {"passed": False}
    else:
        verdict = check_data_dir(job_workload(data, model_dir), data, out.bound(IN_FLIGHT_BOUND))
        out.verdict = {**dataclasses.asdict(verdict), "passed": verdict.passed}
    out.wall_s = time.monotonic() - started
    return out


def _target_pid(target: str, job_pid: int, data_dir: str, stages: Stages) -> int | None:
    if target == "run-batch":
        return job_pid
    if target == "broker":
        return _broker_lock_pid(data_dir)
    status = stages.status()
    return next((c.pid for c in status.consumers.values()), None) if status is not None else None
