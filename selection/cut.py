"""Taint and the pin cut.

Taint: every value reachable from a `Runtime` or `Unpinnable` input is batch-dependent. A batch-dependent
selection point is a leak unless every path to it from those inputs passes through a pinned value.

Cut: a weighted minimum vertex cut by node splitting and max flow. Each tainted value v becomes
`v_in -> v_out` with capacity BIG + dist(v), where dist is its distance to the nearest batch-dependent
selection point and BIG exceeds any sum of distances: so the cut has the fewest pins first and, among cuts of
that size, pins nearest the selection points. `Unpinnable` inputs and dependence edges have infinite
capacity. Pins come out sorted in program order (node id), so the answer is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from detent_audit.selection.errors import SelIRError
from detent_audit.selection.graph import DependenceGraph
from detent_audit.selection.ir import Node, Op

CUT_WEIGHTS_VERSION = "fewest-then-nearest-v1"


@dataclass(frozen=True, slots=True)
class Taint:
    tainted: frozenset[int]             # node ids reachable from batch-dependent inputs
    sources: tuple[int, ...]            # batch-dependent input node ids
    leaking_points: tuple[str, ...]     # selection points (fields) that are batch-dependent


def taint(dg: DependenceGraph) -> Taint:
    """Pass: values reachable from Runtime/Unpinnable inputs."""
    g = dg.graph
    sources = sorted(v for v, d in g.nodes(data=True)
                     if d["node"].op is Op.INPUT and d["node"].arg[1] in ("Runtime", "Unpinnable"))
    tainted: set[int] = set()
    for s in sources:
        tainted.add(s)
        tainted |= nx.descendants(g, s)
    points = tuple(name for name, node in dg.selection_points.items() if node.id in tainted)
    return Taint(frozenset(tainted), tuple(sources), points)


@dataclass(frozen=True, slots=True)
class Cut:
    """The pins (program order) and each pin's weight: its vertex capacity in the flow network (BIG plus its
    distance to the nearest batch-dependent selection point; for the `no-cut` ablation, 0: not weighed)."""

    pins: tuple[Node, ...]
    weights: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.pins) != len(self.weights):
            raise SelIRError(f"a cut of {len(self.pins)} pins has {len(self.weights)} weights")

    @property
    def total_weight(self) -> int:
        return sum(self.weights)


def min_cut(dg: DependenceGraph, t: Taint, checked_inputs: frozenset[int] = frozenset()) -> Cut:
    """Pass: the pins, a minimum weighted vertex cut between batch inputs and leaking selection points.

    `checked_inputs`: Runtime inputs a require/assume reads. A check is about the real batch, so such an
    input is pinned only when nothing else cuts its paths: its capacity exceeds any cut of other values.
    """
    if not t.leaking_points:
        return Cut((), ())
    g = dg.graph
    sinks = sorted({dg.selection_points[p].id for p in t.leaking_points})
    sub = g.subgraph(t.tainted)
    dist = _distance_to(sub, sinks)
    big = (len(t.tainted) + 1) * (max(dist.values(), default=0) + 1)
    last_resort = big * (len(t.tainted) + 1)
    flow = nx.DiGraph()
    capacity: dict[int, int] = {}
    for v in sub.nodes:
        node = dg.node(v)
        if node.op is Op.INPUT and node.arg[1] == "Unpinnable":
            flow.add_edge(("in", v), ("out", v))  # no capacity attribute: infinite
            continue
        capacity[v] = (last_resort if v in checked_inputs else big) + dist.get(v, big)
        flow.add_edge(("in", v), ("out", v), capacity=capacity[v])
    for u, v in sub.edges:
        flow.add_edge(("out", u), ("in", v))
    for s in t.sources:
        flow.add_edge("S", ("in", s))
    for v in sinks:
        flow.add_edge(("out", v), "T")
    try:
        _, (reach, _) = nx.minimum_cut(flow, "S", "T")
    except nx.NetworkXUnbounded:
        raise _unpinnable_leak(dg, t) from None
    pins = sorted((dg.node(v) for v in sub.nodes if ("in", v) in reach and ("out", v) not in reach),
                  key=lambda n: n.id)
    return Cut(tuple(pins), tuple(capacity[p.id] for p in pins))


def pin_selection_points(dg: DependenceGraph, t: Taint) -> Cut:
    """Ablation `no-cut`: pin every batch-dependent selection point itself."""
    pins = {dg.selection_points[p].id: dg.selection_points[p] for p in t.leaking_points}
    for node in pins.values():
        if node.op is Op.INPUT and node.arg[1] == "Unpinnable":
            raise _unpinnable_leak(dg, t)
    ordered = tuple(sorted(pins.values(), key=lambda n: n.id))
    return Cut(ordered, (0,) * len(ordered))


def _distance_to(g: nx.DiGraph, sinks: list[int]) -> dict[int, int]:
    rev = g.reverse(copy=False)
    dist: dict[int, int] = {}
    for s in sinks:
        for v, d in nx.single_source_shortest_path_length(rev, s).items():
            dist[v] = min(dist.get(v, d), d)
    return dist


def _unpinnable_leak(dg: DependenceGraph, t: Taint) -> SelIRError:
    g = dg.graph
    for p in t.leaking_points:
        target = dg.selection_points[p]
        for v in sorted(nx.ancestors(g, target.id) | {target.id}):
            node = dg.node(v)
            if node.op is Op.INPUT and node.arg[1] == "Unpinnable":
                return SelIRError(
                    f"selection point `{p}` depends on the Unpinnable input `{node.arg[0]}` through no "
                    "pinnable value", remedy="make the input Runtime[...] or select from a pinnable value")
    return SelIRError("no finite cut separates the batch inputs from the selection points")
