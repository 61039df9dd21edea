"""The cluster driver's loop against a cluster in memory (a stand-in for Ray whose node agents
answer what they were sent, a few items a poll): with windows far smaller than the job, the
driver holds only what is in flight at every step; a node lost while most of the job is not
read yet, and back later, loses nothing and duplicates nothing: one accepted row per item in
the results files, the lost node's late answers dropped. No Ray, no process: the loop's own
logic (real Ray: tests/cluster/test_ray_cluster.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pipeline.cluster import driver
from pipeline.cluster.driver import SLOT_RESOURCE_PREFIX, ClusterRun
from pipeline.runtime.settings import LaunchSettings

SLOTS = ("a", "b", "c")
# Small enough that the job is many windows long.
WINDOW = 8
BATCH = 4
ANSWERS_PER_POLL = 3


class RayError(Exception):
    pass


class Ref:
    """A call's result, computed when it is got (the agent's side effects happen then)."""

    def __init__(self, call) -> None:
        self.call = call


class Method:
    def __init__(self, agent: FakeAgent, name: str) -> None:
        self.agent, self.name = agent, name

    def remote(self, *args, **kwargs) -> Ref:
        return Ref(lambda: self.agent.call(self.name, *args, **kwargs))


class FakeAgent:
    """A node agent: what it was sent, answered a few at a time; dead with its node."""

    def __init__(self, cluster: FakeCluster, slot: str, epoch: int) -> None:
        self.cluster, self.slot, self.epoch = cluster, slot, epoch
        self.held: list[int] = []
        self.killed = False
        for name in ("start", "submit", "poll", "stop"):
            setattr(self, name, Method(self, name))

    def call(self, name: str, *args, **kwargs):
        if self.killed or self.slot not in self.cluster.up:
            raise RayError(f"the actor on node {self.slot} died")
        return getattr(self, f"_{name}")(*args, **kwargs)

    def _start(self) -> dict:
        return {"consumers": 1, "host": "memory"}

    def _submit(self, epoch: int, keys: list[int], items: list) -> int:
        assert epoch == self.epoch and [item.payload for item in items] == [b"%d" % k for k in keys]
        self.held.extend(keys)
        return len(keys)

    def _poll(self, epoch: int) -> dict:
        answered, self.held = self.held[:ANSWERS_PER_POLL], self.held[ANSWERS_PER_POLL:]
        self.cluster.on_poll(self.slot)
        rows = [(k, {"key": k, "node": self.slot, "prompt_tokens": 10, "cached_tokens": 4}) for k in answered]
        return {"epoch": self.epoch, "slot": self.slot, "rows": rows, "discarded": 0}

    def _stop(self, remove: bool = False) -> dict:
        return {"slot": self.slot, "node_exit": 0}


class FakeCluster:
    """The `ray` module as the driver uses it, over nodes that are up or not."""

    exceptions = type("exceptions", (), {"RayError": RayError})

    def __init__(self) -> None:
        self.up = set(SLOTS)
        self.agents: list[FakeAgent] = []
        self.polls = 0
        self.on_polls: dict[int, object] = {}  # poll count -> what happens then

    def on_poll(self, _slot: str) -> None:
        self.polls += 1
        event = self.on_polls.pop(self.polls, None)
        if event is not None:
            event()

    # The parts of `ray` the driver calls.
    def is_initialized(self) -> bool:
        return True

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "NodeID": f"id-{slot}", "Resources": {SLOT_RESOURCE_PREFIX + slot: 1}}
                for slot in sorted(self.up)]

    def remote(self, _cls):
        cluster = self

        class Options:
            def options(self, **_kwargs):
                return self

            def remote(self, slot: str, epoch: int, _spec) -> FakeAgent:
                cluster.agents.append(FakeAgent(cluster, slot, epoch))
                return cluster.agents[-1]

        return Options()

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        return list(refs), []

    def get(self, ref: Ref):
        return ref.call()

    def kill(self, agent: FakeAgent, no_restart: bool = True) -> None:
        agent.killed = True

    def shutdown(self) -> None:
        pass


@pytest.fixture
def small_windows(monkeypatch):
    monkeypatch.setattr(driver, "WINDOW_ITEMS", WINDOW)
    monkeypatch.setattr(driver, "BATCH_ITEMS", BATCH)
    monkeypatch.setattr(driver, "READ_AHEAD_ITEMS", BATCH)
    monkeypatch.setattr(driver, "POLL_INTERVAL_S", 0.0)
    monkeypatch.setattr(driver, "NODE_CHECK_S", 0.0)


def cluster_run(monkeypatch, tmp_path, source, cluster: FakeCluster, route: str = "shape") -> ClusterRun:
    monkeypatch.setattr(driver, "ray_module", lambda: cluster)
    run = ClusterRun(LaunchSettings(), source, node_root=str(tmp_path / "nodes"), results_dir=str(tmp_path / "results"),
                     address="memory", route=route)
    # One node holds at most its window and a batch queued; a lost node's are queued again
    # on the survivors, once. Nothing else is held per item.
    bound = len(SLOTS) * (WINDOW + BATCH) * 2
    run.on_progress = lambda done, total, nodes: (run.ledger.check_invariants(),
                                                   _at_most(run.ledger.in_flight(), bound))
    return run


def _at_most(value: int, bound: int) -> None:
    assert value <= bound, (value, bound)


def accepted_rows(tmp_path) -> Counter:
    return Counter(json.loads(line)["key"] for path in (tmp_path / "results").glob("node-*.jsonl")
                   for line in path.read_text().splitlines())


def job(list_source, count: int = 600):
    """Items under every other key, in 30 shapes of 3 families."""
    return list_source(2 * count + 5, {2 * k: (k % 3, 10 + k % 30) for k in range(count)})


@pytest.mark.parametrize("route", ["shape", "round-robin"])
def test_the_driver_holds_only_what_is_in_flight_and_answers_each_item_once(list_source, small_windows,
                                                                            monkeypatch, tmp_path, route):
    source = job(list_source)
    run = cluster_run(monkeypatch, tmp_path, source, FakeCluster(), route)
    report = run.run()
    assert report["total"]["items"] == 600 and report["total"]["answered"] == 600
    assert report["total"]["unanswered"] == 0 and run.ledger.in_flight() == 0
    assert accepted_rows(tmp_path) == Counter(source.shapes.keys())
    assert source.made == Counter({k: 2 for k in source.shapes})  # once per pass
    assert report["driver"]["shapes"] == 30 and report["driver"]["cursors"] == (3 if route == "shape" else 1)
    assert all(node["answered"] for node in report["nodes"].values())


def test_a_node_lost_before_most_of_the_job_is_read_loses_nothing(list_source, small_windows, monkeypatch,
                                                                  tmp_path):
    source = job(list_source)
    cluster = FakeCluster()
    run = cluster_run(monkeypatch, tmp_path, source, cluster)
    seen = {}

    def lose_c() -> None:
        seen["unread"] = not all(cursor.done for cursor in run.cursors)
        late = next(agent for agent in cluster.agents if agent.slot == "c")
        seen["late"] = late.held[:]  # what c's incarnation held: answered late, below
        cluster.up.discard("c")

    def late_answers() -> None:
        # The lost incarnation says something after all (an answer Ray delivers late): stale.
        for ref_owner in [agent for agent in cluster.agents if agent.slot == "c"][:1]:
            ref_owner.killed = False
            cluster.up.add("c")
            value = ref_owner._poll(ref_owner.epoch)
            run._accept(run.nodes["c"], value)
            cluster.up.discard("c")
            ref_owner.killed = True

    cluster.on_polls = {20: lose_c, 60: late_answers, 90: lambda: cluster.up.add("c")}
    report = run.run()
    assert seen["unread"] and seen["late"], "the node was lost with the job read through, or holding nothing"
    assert report["total"]["answered"] == 600 and report["total"]["unanswered"] == 0
    assert accepted_rows(tmp_path) == Counter(source.shapes.keys())  # one row per item
    c = report["nodes"]["c"]
    assert c["lost"] == 1 and c["epochs"] == 2 and c["resubmitted_from"] > 0, c
    assert report["total"]["stale_dropped"] > 0
    assert source.made == Counter({k: 2 for k in source.shapes})  # nothing made again: sent again from what was held


def test_a_source_with_no_item_runs_nothing(list_source, monkeypatch, tmp_path):
    cluster = FakeCluster()
    report = cluster_run(monkeypatch, tmp_path, list_source(10, {}), cluster).run()
    assert report["total"]["items"] == 0 and report["total"]["unanswered"] == 0 and not cluster.agents
