"""The SSA dependence graph of a partially evaluated program (networkx).

Nodes are `Node.id`s with the node under the attribute `node`; an edge u -> v means v reads u. Edges into a
SELECT from its condition are `control` dependences, all others `data`.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from detent_audit.selection.ir import Node, Op, toposort
from detent_audit.selection.pe_values import IRProgram


@dataclass
class DependenceGraph:
    graph: nx.DiGraph
    selection_points: dict[str, Node]  # field -> node (runtime-valued fields only)

    @property
    def num_values(self) -> int:
        return self.graph.number_of_nodes()

    def node(self, node_id: int) -> Node:
        return self.graph.nodes[node_id]["node"]

    def check_integrity(self) -> None:
        """Acyclic, every edge matches a node's arguments, every selection point present."""
        if not nx.is_directed_acyclic_graph(self.graph):
            raise AssertionError("dependence graph has a cycle")
        for v, data in self.graph.nodes(data=True):
            node = data["node"]
            want = {s.id for s in node.src}
            got = set(self.graph.predecessors(v))
            if want != got:
                raise AssertionError(f"node {node!r}: edges {sorted(got)} != arguments {sorted(want)}")
            for s in node.src:
                if s.id >= node.id:
                    raise AssertionError(f"node {node!r} reads a later node {s!r}")
        for name, node in self.selection_points.items():
            if node.id not in self.graph:
                raise AssertionError(f"selection point {name} missing")


def build_graph(prog: IRProgram) -> DependenceGraph:
    """Pass: the SSA dependence graph with control-dependence edges."""
    g = nx.DiGraph()
    for node in toposort(prog.roots()):
        g.add_node(node.id, node=node)
        for i, s in enumerate(node.src):
            kind = "control" if node.op is Op.SELECT and i == 0 else "data"
            g.add_edge(s.id, node.id, kind=kind)
    points = {k: v for k, v in prog.outputs.items() if isinstance(v, Node)}
    return DependenceGraph(g, points)
