"""The cut is a minimum vertex cut (checked against brute force), nearest the selection points among
minimum ones, deterministic, and refuses to pin an Unpinnable input."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from detent_audit.selection.cut import min_cut, pin_selection_points, taint
from detent_audit.selection.errors import SelIRError
from detent_audit.selection.graph import DependenceGraph
from detent_audit.selection.ir import Builder, Op, toposort


def random_graph(seed: int, unpinnable: bool = False) -> DependenceGraph:
    rng = random.Random(seed)
    b = Builder()
    nodes = []
    for i in range(rng.randint(1, 3)):
        kind = "Unpinnable" if unpinnable and i == 0 else rng.choice(["Runtime", "Runtime", "Request"])
        nodes.append(b.make(Op.INPUT, (f"in{i}", kind), name=f"in{i}"))
    nodes.append(b.make(Op.KNOB, ("k", (1, 2), 1), name="k"))
    for i in range(rng.randint(3, 9)):
        srcs = rng.sample(nodes, min(len(nodes), rng.randint(1, 3)))
        nodes.append(b.make(Op.CALL, "max", [*srcs, b.const(i)], name=f"v{i}"))
    points = {f"p{j}": n for j, n in enumerate(rng.sample(nodes[-5:], min(3, len(nodes[-5:]))))}
    g = nx.DiGraph()
    for node in toposort(points.values()):
        g.add_node(node.id, node=node)
        for s in node.src:
            g.add_edge(s.id, node.id)
    return DependenceGraph(g, points)


def is_cut(dg: DependenceGraph, removed: set[int]) -> bool:
    t = taint(dg)
    g = dg.graph.subgraph(set(dg.graph.nodes) - removed)
    for s in t.sources:
        if s in removed:
            continue
        reach = nx.descendants(g, s) | {s}
        if any(dg.selection_points[p].id in reach for p in t.leaking_points):
            return False
    return True


@pytest.mark.parametrize("seed", range(60))
def test_cut_matches_brute_force_minimum(seed: int) -> None:
    dg = random_graph(seed)
    t = taint(dg)
    pins = min_cut(dg, t).pins
    assert is_cut(dg, {p.id for p in pins})
    candidates = sorted(t.tainted)
    best = None
    for size in range(0, len(candidates) + 1):
        for combo in itertools.combinations(candidates, size):
            if is_cut(dg, set(combo)):
                best = size
                break
        if best is not None:
            break
    assert len(pins) == best, (seed, pins, best)
    assert [p.id for p in pins] == sorted(p.id for p in pins)  # program order


@pytest.mark.parametrize("seed", range(30))
def test_among_minimum_cuts_pins_are_nearest_the_selection_points(seed: int) -> None:
    dg = random_graph(seed)
    t = taint(dg)
    cut = min_cut(dg, t)
    pins = cut.pins
    sub = dg.graph.subgraph(t.tainted).reverse()
    sinks = [dg.selection_points[p].id for p in t.leaking_points]

    def dist(v: int) -> int:
        return min((nx.shortest_path_length(sub, s, v) for s in sinks if nx.has_path(sub, s, v)), default=99)

    ours = sum(dist(p.id) for p in pins)
    # each pin's weight is one constant (BIG) plus its distance: the weights differ exactly as distances do
    assert len(cut.weights) == len(pins) and cut.total_weight == sum(cut.weights)
    if pins:
        big = cut.weights[0] - dist(pins[0].id)
        assert big > len(pins) * max(map(dist, (p.id for p in pins))) and all(
            w == big + dist(p.id) for p, w in zip(pins, cut.weights)), (seed, cut.weights)
    for combo in itertools.combinations(sorted(t.tainted), len(pins)):
        if is_cut(dg, set(combo)):
            assert ours <= sum(dist(v) for v in combo), (seed, pins, combo)


def test_cut_is_deterministic() -> None:
    for seed in range(20):
        a, b = (min_cut(random_graph(seed), taint(random_graph(seed))) for _ in range(2))
        assert [p.id for p in a.pins] == [p.id for p in b.pins] and a.weights == b.weights


def test_unpinnable_input_is_never_a_pin() -> None:
    for seed in range(40):
        dg = random_graph(seed, unpinnable=True)
        t = taint(dg)
        try:
            pins = min_cut(dg, t).pins
        except SelIRError as exc:
            assert "Unpinnable input `in0`" in str(exc)
            continue
        assert all(not (p.op is Op.INPUT and p.arg[1] == "Unpinnable") for p in pins)
        assert is_cut(dg, {p.id for p in pins})


def test_no_cut_ablation_pins_every_leaking_point() -> None:
    for seed in range(20):
        dg = random_graph(seed)
        t = taint(dg)
        cut = pin_selection_points(dg, t)
        assert {p.id for p in cut.pins} == {dg.selection_points[p].id for p in t.leaking_points}
        assert cut.weights == (0,) * len(cut.pins)  # the ablation does not weigh
        assert len(min_cut(dg, t).pins) <= len(cut.pins)
