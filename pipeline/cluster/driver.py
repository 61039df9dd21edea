"""The driver of a cluster run: a job's items over the nodes of a Ray cluster, shape-affine,
surviving node loss, into one results file per node on the driver's disk.

    run = ClusterRun(settings, source, node_root="/local/sbrk", results_dir=..., address="auto")
    report = run.run()            # every key answered once; report["total"], report["nodes"]

`source` (`stream.ItemSource`) is read twice and never held: the run's memory grows with the
items in flight and the job's distinct shapes, not with its length (`stream.py`).

What a run does:
    1. pass 1: reads every item of the source once, keeping per shape its chain and the
       tokens its node computes (prefixes once, suffixes each) and per key its shape id
       (`stream.tally_items`); nothing more happens for a source with no item;
    2. connects to Ray (`address`; a cluster this process already joined is used as it is);
    3. finds the nodes: each node that has a resource named SLOT_RESOURCE_PREFIX + NAME is
       the node NAME (a replacement started with the same resource takes its place); where
       no node has one, each alive node is a node of its own, by its Ray node id;
    4. the routing plan (`routing.py`) from the shapes, and one node agent per node
       (`agent.py`), placed there by its resource (or hard node affinity), each starting the
       node's broker and consumers on NODE_ROOT/NAME;
    5. pass 2: reads the items again through one cursor per node (`stream.Cursor`), each
       item routed as it is read to its key's node's queue while that holds fewer than
       READ_AHEAD_ITEMS, sends each node its queue in batches of BATCH_ITEMS, at most
       WINDOW_ITEMS not yet answered per consumer of the node, and polls every node for
       finished rows, which it appends to RESULTS_DIR/node-NAME.jsonl (one write per poll);
    6. a node lost (an actor call fails, or Ray says the node is dead) is fenced off (its
       epoch goes up: whatever it still says is dropped), leaves the router, and every item
       it held that has no answer yet is routed again over the survivors from what the
       driver keeps of the items in flight; items not read yet go to the survivors as they
       are read; a node that joins (or comes back) gets a new agent and epoch, and the
       items queued and not yet sent whose keys it now wins move to it;
    7. stops every agent (each stops its node's consumers, then its broker) and reports per
       node and in total.

Exactly one answer per key: the driver accepts the first row for a key from the node that
owns it at the current epoch, and drops the rest (counted: `duplicates_dropped`,
`stale_dropped`); the caller's output is made from the accepted rows only.

Owner: the calling process's main thread. Not thread-safe. Ray is imported here only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import resource
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.cluster.agent import NodeAgent
from pipeline.cluster.ledger import ACCEPTED, STALE, JobLedger
from pipeline.runtime.node import NodeSpec
from pipeline.cluster.routing import Router, RoutingPlan, ShapeTally
from pipeline.cluster.stream import Cursor, ItemSource, Routes, tally_items
from pipeline.runtime.settings import LaunchSettings
from pipeline.wire.errors import PipelineError

# A node's own resource: `ray start --resources '{"shape_broker_node_a": 1}'` makes it node "a".
SLOT_RESOURCE_PREFIX = "shape_broker_node_"
# An agent asks for this much CPU: an actor that asks for nothing ignores soft node affinity,
# and the agent only waits on its node's broker.
AGENT_CPUS = 0.01
# And this much of its node's own resource, so any number of runs can share a node.
AGENT_SLOT_SHARE = 0.001
# Items per submit call to an agent: one pickled message of a few MiB at most.
BATCH_ITEMS = 256
# Items routed to a node and not sent yet, at most (a cursor whose next item goes to a node
# with this many waits): one batch ready to send whenever the node's window opens; more
# would only hold items in the driver that the node cannot take yet.
READ_AHEAD_ITEMS = BATCH_ITEMS
# Items sent to a node and not answered yet, per consumer: enough for the broker to batch by
# shape (several full batches of every shape it holds), few enough that a lost node's share
# is small.
WINDOW_ITEMS = 2048
# How often each node is polled for finished rows.
POLL_INTERVAL_S = 0.2
# How often Ray is asked which nodes are alive (and whether new ones joined).
NODE_CHECK_S = 1.0
# How long the run waits for its first agents to start (a node's broker recovering its store).
START_WAIT_S = 180.0
# A node whose agent failed to start this many times is left out of the run (its broker
# cannot start there: the reason is in the report), rather than retried every NODE_CHECK_S.
MAX_AGENT_STARTS = 3
# How long the agents get to stop their nodes at the end.
STOP_WAIT_S = 60.0
# How long a HOST:PORT given to --ray gets to accept a TCP connection before the run fails.
# NOTE: ray.init on an address where nothing listens retries for minutes (measured: still
# retrying when stopped at 400 s, printing a warning every 5 s); a head node's GCS accepts
# in well under a second on a network that can reach it at all.
CONNECT_PROBE_S = 5.0


def _first_line(exc: BaseException) -> str:
    """An actor's failure in one line: the last line of its traceback that says what."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]


def check_address_answers(address: str, timeout_s: float = CONNECT_PROBE_S) -> None:
    """ClusterError unless something accepts a TCP connection at `address` (HOST:PORT, the
    head node's GCS) within `timeout_s`. "auto" and Ray Client addresses (ray://...) are
    left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"--ray {address!r}: expected HOST:PORT (the head node's address), or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterError(f"no Ray cluster answers at {address}: {exc.strerror or exc} "
                           f"(nothing accepted a connection within {timeout_s:g} s)") from None


def _gpus_of(node: dict) -> dict:
    """The actor option asking for all of a Ray node's GPUs ({} for a node without any)."""
    gpus = int(node.get("Resources", {}).get("GPU", 0))
    return {"num_gpus": gpus} if gpus > 0 else {}


class ClusterError(PipelineError):
    """A cluster run that cannot go on: Ray missing or not answering, no node found or left."""


def ray_module():
    """Ray, or a one-line error saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ClusterError("--ray needs Ray: pip install 'shape-broker[ray]'") from None
    return ray


# What the report counts per node (and in total).
NODE_COUNTS = ("sent", "answered", "resubmitted_from", "stale_dropped", "duplicates_dropped", "prompt_tokens",
               "cached_tokens", "epochs", "lost", "discarded_by_agent", "moved_to")


@dataclass(slots=True)
class NodeState:
    """The driver's view of one node. Owner: ClusterRun."""

    slot: str
    placement: dict  # ray actor options that put the agent on this node
    agent: object = None
    alive: bool = False
    info: dict = field(default_factory=dict)
    last_poll_s: float = 0.0
    polling: bool = False
    counts: dict = field(default_factory=lambda: dict.fromkeys(NODE_COUNTS, 0))

    def window(self) -> int:
        return WINDOW_ITEMS * max(1, int(self.info.get("consumers", 1)))


class ClusterRun:
    """One run of a source's items (their keys name them in the answers) on a Ray cluster.

    `on_progress(answered, items, nodes)` while it runs, `on_planning(items read)` in pass 1."""

    def __init__(self, settings: LaunchSettings, source: ItemSource, node_root: str, results_dir: str,
                 address: str | None, models: tuple[int, ...] = (0,),
                 on_progress: Callable[[int, int, dict], None] | None = None,
                 on_planning: Callable[[int], None] | None = None, route: str = "shape") -> None:
        assert route in ("shape", "round-robin"), route
        self.ray = ray_module()
        self.settings = settings
        self.source = source
        self.node_root = node_root
        self.results_dir = results_dir
        self.address = address
        self.models = models
        self.on_progress = on_progress or (lambda done, total, nodes: None)
        self.on_planning = on_planning
        self.route = route
        self.tally: ShapeTally | None = None
        self.ledger: JobLedger | None = None
        self.routes: Routes | None = None
        self.cursors: list[Cursor] = []
        self.plan_pass_s = 0.0
        self.make_s = 0.0  # pass 2's time in the source (reading and making items)
        self.nodes: dict[str, NodeState] = {}
        self.pending: dict = {}  # ray object ref -> (slot, epoch, kind)
        self.router: Router | None = None
        self.plan: RoutingPlan | None = None
        self._joined_here = False
        self._files: dict[str, int] = {}
        self._round_robin = 0

    # ----------------------------------------------------------------- run

    def run(self) -> dict:
        started_s = time.monotonic()
        self.tally = tally_items(self.source, self.on_planning)
        self.plan_pass_s = time.monotonic() - started_s
        if not self.tally.count:
            return self._report(time.monotonic() - started_s)
        ray = self.ray
        if not ray.is_initialized():
            self._join_cluster()
        try:
            found = self._find_nodes()
            if not found:
                raise ClusterError("the Ray cluster has no alive node")
            self.plan = RoutingPlan.build(self.tally.chains, self.tally.loads(), nodes=len(found))
            self.ledger = JobLedger(self.source.keys, self.tally.count)
            for slot, placement in found.items():
                self.nodes[slot] = NodeState(slot, placement)
                self._start_agent(self.nodes[slot])
            self._wait_started()
            self.router = Router(self.plan, [s for s, n in self.nodes.items() if n.alive])
            self.routes = Routes(self.tally, self.plan, self.router.placement)
            self.cursors = self._open_cursors()
            self._loop()
        finally:
            self._stop_all()
            for fd in self._files.values():
                os.close(fd)
            if self._joined_here:
                ray.shutdown()
        return self._report(time.monotonic() - started_s)

    def _join_cluster(self) -> None:
        """Join the cluster at `address`; "auto" is the cluster this machine runs (`ray start`),
        or, where it runs none, a Ray of this machine alone, started here."""
        options = {"logging_level": "WARNING", "log_to_driver": False}
        check_address_answers(self.address)
        try:
            self.ray.init(address=self.address, **options)
        except ConnectionError as exc:
            if self.address != "auto":
                raise ClusterError(f"no Ray cluster answers at {self.address}: {_first_line(exc)}") from None
            self.ray.init(**options)
        except (RuntimeError, ValueError) as exc:  # a malformed address, a version mismatch
            raise ClusterError(f"cannot join the Ray cluster at {self.address}: {_first_line(exc)}") from None
        self._joined_here = True

    def _find_nodes(self) -> dict[str, dict]:
        """Alive nodes, each by its slot name, with the actor options that place an agent
        there. The agent asks for all of its node's GPUs: Ray then sets CUDA_VISIBLE_DEVICES
        to them in the agent, and the node process (which inherits it) runs one consumer per
        GPU, and no other Ray work takes them meanwhile. Without slot resources, only the
        nodes with GPUs where any node has one, else every node."""
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        slots = {}
        for node in alive:
            for resource in node.get("Resources", {}):
                if resource.startswith(SLOT_RESOURCE_PREFIX):
                    slots[resource[len(SLOT_RESOURCE_PREFIX):]] = {"resources": {resource: AGENT_SLOT_SHARE},
                                                                   **_gpus_of(node)}
        if slots:
            return slots
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with_gpus = [node for node in alive if _gpus_of(node)]
        return {node["NodeID"][:12]: {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                                      **_gpus_of(node)}
                for node in with_gpus or alive}

    def _epoch(self, node: NodeState) -> int:
        return self.ledger.epoch[node.slot]

    def _start_agent(self, node: NodeState) -> None:
        epoch = self.ledger.open(node.slot)
        node.counts["epochs"] += 1
        node_settings = dataclasses.replace(self.settings, data_dir=os.path.join(self.node_root, node.slot),
                                            report=None, plots=None, metrics_port=None)
        actor = self.ray.remote(NodeAgent).options(num_cpus=AGENT_CPUS, max_restarts=0, **node.placement)
        node.agent = actor.remote(node.slot, epoch, NodeSpec(node_settings, self.models))
        self.pending[node.agent.start.remote()] = (node.slot, epoch, "start")

    def _wait_started(self) -> None:
        """Until every agent started, or START_WAIT_S passed: a node whose agent cannot be
        placed yet (its node is going away) joins later if it ever starts."""
        deadline_s = time.monotonic() + START_WAIT_S
        while any(kind == "start" for _s, _e, kind in self.pending.values()) and time.monotonic() < deadline_s:
            self._handle(self._ready(timeout_s=POLL_INTERVAL_S))
        if not any(n.alive for n in self.nodes.values()):
            why = "; ".join(f"{slot}: {n.info.get('lost_because', 'not placed')}" for slot, n in self.nodes.items())
            raise ClusterError(f"no node agent started ({why})")

    # ----------------------------------------------------------------- routing

    def _open_cursors(self) -> list[Cursor]:
        """Pass 2's cursors: one per node the run started on (`stream.py`); one in all for
        round-robin, which routes no key."""
        if self.route == "round-robin":
            return [Cursor(self.source.items(lambda k: self.tally.shape_of[k] != 0))]
        return [Cursor(self.source.items(self.routes.wanted_by(c))) for c in range(self.routes.cursors)]

    def _node_for(self, k: int) -> str:
        if self.route == "round-robin":  # the baseline: what an actor pool does
            live = sorted(s for s, n in self.nodes.items() if n.alive)
            self._round_robin += 1
            return live[self._round_robin % len(live)]
        return self.router.node_of(self.routes.route_key(k))

    def _fill(self) -> None:
        """Items from each cursor into their nodes' queues, while the next one's node has
        fewer than READ_AHEAD_ITEMS queued (a cursor's next item waits in the cursor)."""
        for cursor in self.cursors:
            while True:
                started_s = time.monotonic()
                ahead = cursor.peek()
                self.make_s += time.monotonic() - started_s
                if ahead is None:
                    break
                k, item = ahead
                node = self._node_for(k)
                if self.ledger.queued(node) >= READ_AHEAD_ITEMS:
                    break
                self.ledger.assign(k, node, item)
                cursor.pop()

    # ----------------------------------------------------------------- loop

    def _loop(self) -> None:
        next_check_s = time.monotonic() + NODE_CHECK_S
        while self.ledger.in_flight() or not all(cursor.done for cursor in self.cursors):
            now_s = time.monotonic()
            if now_s >= next_check_s:
                self._check_nodes()
                next_check_s = now_s + NODE_CHECK_S
            self._feed()
            now_s = time.monotonic()
            for node in self.nodes.values():
                if node.alive:
                    if not node.polling and now_s - node.last_poll_s >= POLL_INTERVAL_S:
                        node.polling, node.last_poll_s = True, now_s
                        epoch = self._epoch(node)
                        self.pending[node.agent.poll.remote(epoch)] = (node.slot, epoch, "poll")
            if not any(n.alive for n in self.nodes.values()) and not self.pending:
                raise ClusterError(f"every node is lost; {self.ledger.unanswered():,} items unanswered")
            self._handle(self._ready(timeout_s=POLL_INTERVAL_S))
            self.on_progress(self.ledger.answered, self.ledger.items, self.nodes)

    def _feed(self) -> None:
        """Read, route and send until every live node's window is full or what it would
        take next is not read yet (its cursor waits on another node's room, or is done)."""
        while True:
            self._fill()
            if not sum(self._send(node) for node in self.nodes.values() if node.alive):
                return

    def _send(self, node: NodeState) -> int:
        """Batches of the node's queue while its window has room; how many items went."""
        epoch = self._epoch(node)
        sent = 0
        while batch := self.ledger.take(node.slot, BATCH_ITEMS, node.window()):
            node.counts["sent"] += len(batch)
            sent += len(batch)
            ref = node.agent.submit.remote(epoch, batch, [self.ledger.work[k] for k in batch])
            self.pending[ref] = (node.slot, epoch, "submit")
        return sent

    def _ready(self, timeout_s: float) -> list:
        if not self.pending:
            time.sleep(timeout_s)
            return []
        refs = list(self.pending)
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return ready

    def _handle(self, ready: list) -> None:
        for ref in ready:
            slot, epoch, kind = self.pending.pop(ref)
            node = self.nodes[slot]
            try:
                value = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                if epoch == self._epoch(node) and (node.alive or kind == "start"):
                    self._lose(node, f"{kind} failed: {_first_line(exc)}")
                continue
            if epoch != self._epoch(node):
                if kind == "poll":
                    node.counts["stale_dropped"] += len(value["rows"])
                continue
            if kind == "start":
                node.info, node.alive = value, True
                if self.router is not None:
                    self._join(node)
            elif kind == "poll":
                node.polling = False
                self._accept(node, value)

    def _accept(self, node: NodeState, value: dict) -> None:
        """A current-epoch poll's rows: the first answer of each key it owns is kept."""
        lines = []
        node.counts["discarded_by_agent"] = value["discarded"]
        for key, row in value["rows"]:
            verdict = self.ledger.accept(node.slot, value["epoch"], key)
            if verdict != ACCEPTED:
                node.counts["stale_dropped" if verdict == STALE else "duplicates_dropped"] += 1
                continue
            node.counts["answered"] += 1
            node.counts["prompt_tokens"] += int(row.get("prompt_tokens") or 0)
            node.counts["cached_tokens"] += int(row.get("cached_tokens") or 0)
            lines.append(json.dumps(row, separators=(",", ":")))
        if lines:
            self._append(node.slot, lines)

    def _append(self, slot: str, lines: list[str]) -> None:
        """One write of whole lines to the node's results file on the driver's disk."""
        fd = self._files.get(slot)
        if fd is None:
            os.makedirs(self.results_dir, mode=0o700, exist_ok=True)
            path = os.path.join(self.results_dir, f"node-{slot}.jsonl")
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._files[slot] = fd
        os.write(fd, ("\n".join(lines) + "\n").encode())

    # ----------------------------------------------------------------- membership

    def _check_nodes(self) -> None:
        """Ray's view of the nodes: a dead one is lost, a new (or returned) one joins."""
        found = self._find_nodes()
        for slot, node in self.nodes.items():
            if node.alive and slot not in found:
                self._lose(node, "Ray reports its node dead")
        for slot, placement in found.items():
            node = self.nodes.get(slot)
            starting = any(s == slot and kind == "start" for s, _e, kind in self.pending.values())
            if node is None:
                node = self.nodes[slot] = NodeState(slot, placement)
            if not node.alive and not starting and node.counts["epochs"] < MAX_AGENT_STARTS:
                node.placement = placement
                self._start_agent(node)

    def _lose(self, node: NodeState, why: str) -> None:
        """Fence the node off and route what it held (unanswered) over the survivors."""
        was_alive = node.alive
        node.alive, node.polling = False, False
        moved = self.ledger.close(node.slot)  # fenced: anything the old incarnation still says is dropped
        node.counts["lost"] += int(was_alive)
        try:
            self.ray.kill(node.agent, no_restart=True)
        except Exception:  # noqa: BLE001 - an actor already gone
            pass
        node.info["lost_because"] = why
        if self.router is None:
            return
        if self.router.nodes == {node.slot}:
            raise ClusterError(f"node {node.slot} is lost ({why}) and it was the last one")
        self.router.remove(node.slot)
        node.counts["resubmitted_from"] += len(moved)
        for k, work in moved:
            self.ledger.assign(k, self._node_for(k), work)

    def _join(self, node: NodeState) -> None:
        """A node that started after the run began: into the router, and the items not sent
        yet whose keys it now wins move to it."""
        self.router.add(node.slot)
        node.counts["moved_to"] += self.ledger.move_queued(node.slot, lambda k: self._node_for(k) == node.slot)

    def _stop_all(self) -> None:
        finished = self.ledger is not None and self.ledger.unanswered() == 0  # its node stores are empty: removed
        refs = {n.agent.stop.remote(remove=finished): n for n in self.nodes.values() if n.alive and n.agent is not None}
        if refs:
            done, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=STOP_WAIT_S)
            for ref in done:
                try:
                    refs[ref].info["stop"] = self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    pass
        for node in self.nodes.values():
            if node.agent is not None:
                try:
                    self.ray.kill(node.agent, no_restart=True)
                except Exception:  # noqa: BLE001 - an actor already gone
                    pass

    # ----------------------------------------------------------------- report

    def _placement_report(self) -> dict:
        """Shape routing's placement: keys that fitted under no node's bound, and each node's
        load (the plan's tokens of the keys it holds now)."""
        if self.router is None or self.route != "shape":
            return {}
        return {"fallbacks": self.router.fallbacks,
                "planned_load_tokens": {node: round(load, 1) for node, load in sorted(self.router.loads.items())}}

    def _report(self, wall_s: float) -> dict:
        nodes = {}
        total = dict.fromkeys(NODE_COUNTS, 0)
        for slot, node in sorted(self.nodes.items()):
            counts = dict(node.counts)
            counts["prefix_reuse"] = counts["cached_tokens"] / counts["prompt_tokens"] if counts["prompt_tokens"] else None
            nodes[slot] = {**counts, "host": node.info.get("host"), "consumers": node.info.get("consumers"),
                           "lost_because": node.info.get("lost_because")}
            for name, value in node.counts.items():
                total[name] += value
        plan, ledger = self.plan, self.ledger
        answered = ledger.answered if ledger else 0
        return {
            "nodes": nodes,
            "total": {**total, "items": self.tally.count if self.tally else 0,
                      "unanswered": ledger.unanswered() if ledger else 0,
                      "prefix_reuse": total["cached_tokens"] / total["prompt_tokens"]
                      if total["prompt_tokens"] else None,
                      "wall_s": wall_s, "items_per_s": answered / wall_s if wall_s > 0 else None},
            "routing": {"route": self.route, "keys": len(plan.key_loads) if plan else 0,
                        "split_shapes": plan.splits if plan else 0, "sub_keys": plan.sub_keys if plan else 0,
                        "max_key_load_tokens": plan.max_key_load if plan else None,
                        **self._placement_report()},
            "driver": {"shapes": len(self.tally.chains) if self.tally else 0, "plan_pass_s": self.plan_pass_s,
                       "make_s": self.make_s, "cursors": len(self.cursors),
                       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
            "results_dir": self.results_dir,
        }
