"""Imports follow the arrows of docs/design.md section 2, read from the source (AST) of every installed
module.

Each module belongs to one layer; `ALLOWED` lists the layers each layer may import. For the arrows every
import counts, also one inside a function or under `TYPE_CHECKING`: a lazy import is still a dependency. An
import cycle is one of modules that import each other as they load. `from P import x` is an edge to `P.x`
when that is a module, and always to `P` itself (the form runs P's `__init__` and reads its names), so a
submodule that imports its own package's `__init__` closes a cycle. A new layer, a new arrow or a new cycle
fails here, with what to change.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[1]

# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    # detent_audit/__init__.py, errors.py, atomic.py, cache_dir.py, enums.py, isa.py: imported by every layer
    "core": frozenset(),
    "manifests": frozenset({"core"}),
    "selection": frozenset({"manifests", "core"}),
    "kernels": frozenset({"core"}),
    # detent_audit/runtime/: the engine contract and what every engine shares; it imports no engine (the
    # registry names the engines' packages, which register themselves)
    "runtime": frozenset({"selection", "kernels", "manifests", "core"}),
    # the engines, side by side above the runtime: none imports another
    "engine": frozenset({"runtime", "selection", "kernels", "manifests", "core"}),
    "integrations": frozenset({"runtime", "selection", "kernels", "manifests", "core"}),
    # above the contract only: no engine is imported, each is found in the registry
    "bench": frozenset({"runtime", "manifests", "core"}),
    "server": frozenset({"runtime", "manifests", "core"}),
    # the trainer side of RL: scores through an engine it builds, gates, plugs into TRL
    "rl": frozenset({"runtime", "engine", "kernels", "manifests", "core"}),
    # the verifier reads a client's request with the server's own parsers (server/protocol.py, offline.py)
    "verifier": frozenset({"server", "runtime", "selection", "manifests", "core"}),
    "cli": frozenset({"verifier", "server", "bench", "runtime", "engine", "integrations", "selection",
                      "kernels", "manifests", "core"}),
}
# arrows against the layers, each named with why; each must be an import inside a function (never at load)
EXCEPTIONS: dict[tuple[str, str], str] = {
    # random-20m and random:<shape>: their tensors are laid out by the embedded model's parameter table
    ("detent_audit.runtime.named_models", "detent_audit.engine.checkpoint"): "the random-20m writer",
    ("detent_audit.runtime.named_models", "detent_audit.engine.generated"): "a random:<shape> model's card",
}
CORE = frozenset({"detent_audit", "detent_audit.errors", "detent_audit.atomic", "detent_audit.cache_dir",
                  "detent_audit.enums", "detent_audit.isa"})
NO_TORCH = frozenset({"manifests", "selection"})  # they run where torch is not installed
# modules other layers must not reach into: (module, the layers that may import it)
INTERNAL = {
    # the random-checkpoint writer (torch, the model); the byte-level BPE alphabet lives in engine.tokenizer
    "detent_audit.engine.checkpoint": frozenset({"engine", "cli"}),
}
# the CLI's command modules never import its app (the package's __init__ imports them and registers them);
# only `python -m detent_audit.cli` runs it
CLI_APP = frozenset({"detent_audit.cli", "detent_audit.cli.app"})
CLI_RUNNER = "detent_audit.cli.__main__"


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject's `package-dir`: import name -> folder."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Every module's dotted name -> its file (the most specific package-dir wins)."""
    found: dict[str, Path] = {}
    for package, folder in sorted(dirs.items(), key=lambda kv: -kv[0].count(".")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
            found.setdefault(name, path)
    return found


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, and whether it runs when the module loads: at module or class level, not
    inside a function and not under `if TYPE_CHECKING:`."""
    def walk(node: ast.AST, at_load: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, at_load
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(ast.Module(body=child.body, type_ignores=[]), False)
                yield from walk(ast.Module(body=child.orelse, type_ignores=[]), at_load)
            else:
                yield from walk(child, at_load)
    yield from walk(tree, True)


def _imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, runs at load) for every import of the project in one module."""
    is_package = path.name == "__init__.py"
    for node, at_load in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "detent_audit":
                    yield alias.name, node.lineno, at_load
            continue
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        if source.split(".")[0] != "detent_audit":
            continue
        yield source, node.lineno, at_load
        for alias in node.names:
            if f"{source}.{alias.name}" in known:
                yield f"{source}.{alias.name}", node.lineno, at_load


def import_graph(root: Path) -> nx.DiGraph:
    """Modules as nodes, imports as edges (self-imports left out), each edge with the line it comes from and
    whether any import behind it runs when the module loads (`at_load`)."""
    known = modules(package_dirs(root))
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        for target, line, at_load in _imports(name, path, known):
            if target == name:
                continue
            if graph.has_edge(name, target):
                edge = graph.edges[name, target]
                if at_load and not edge["at_load"]:
                    edge.update(where=f"{path.relative_to(root)}:{line}", at_load=True)
            else:
                graph.add_edge(name, target, where=f"{path.relative_to(root)}:{line}", at_load=at_load)
    return graph


def layer(module: str) -> str | None:
    if module in CORE:
        return "core"
    parts = module.split(".")
    return parts[1] if parts[1] in ALLOWED else None


def wrong_arrows(graph: nx.DiGraph) -> list[str]:
    wrong = []
    for a, b, data in sorted(graph.edges(data=True)):
        la, lb = layer(a), layer(b)
        if la is None or lb is None:
            continue  # reported by unplaced()
        if (a, b) in EXCEPTIONS and not data["at_load"]:
            continue
        if la != lb and lb not in ALLOWED[la]:
            wrong.append(f"{data['where']}: {a} ({la}) imports {b} ({lb}); {la} may import "
                         f"{sorted(ALLOWED[la])}")
        if b in INTERNAL and la not in INTERNAL[b]:
            wrong.append(f"{data['where']}: {a} reaches into {b}, which only {sorted(INTERNAL[b])} "
                         "may import")
    return wrong


def new_cycles(graph: nx.DiGraph) -> list[str]:
    """Import cycles: modules that import each other as they load (an import inside a function or under
    `TYPE_CHECKING` runs later, so it breaks a cycle; the layer arrows still count it)."""
    loading = graph.edge_subgraph([(a, b) for a, b, at_load in graph.edges(data="at_load") if at_load])
    cycles = []
    for component in nx.strongly_connected_components(loading):
        if len(component) > 1:
            cycle = nx.find_cycle(loading.subgraph(component))
            cycles.append(" -> ".join(f"{a} ({graph.edges[a, b]['where']})"
                                      for a, b in cycle) + f" -> {cycle[0][0]}")
    return sorted(cycles)


def unplaced(graph: nx.DiGraph) -> list[str]:
    return sorted(m for m in graph if layer(m) is None)


def torch_importers(root: Path) -> list[str]:
    found = []
    for name, path in modules(package_dirs(root)).items():
        if layer(name) in NO_TORCH:
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and not node.level else [])
                if any(n.split(".")[0] == "torch" for n in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph(ROOT)


def test_every_module_is_in_a_layer(graph) -> None:
    assert len(graph) > 50  # the whole package was read
    missing = unplaced(graph)
    assert not missing, f"give these a layer in ALLOWED (and docs/design.md section 2): {missing}"


def test_imports_follow_the_arrows(graph) -> None:
    assert not wrong_arrows(graph), "\n".join(wrong_arrows(graph))


def test_no_import_cycle(graph) -> None:
    assert not new_cycles(graph), "\n".join(new_cycles(graph))


def cli_commands_importing_the_app(graph: nx.DiGraph) -> list[str]:
    return sorted(f"{data['where']}: {a} imports {b}" for a, b, data in graph.edges(data=True)
                  if layer(a) == "cli" and a not in CLI_APP | {CLI_RUNNER} and b in CLI_APP)


def test_cli_commands_do_not_import_the_app(graph) -> None:
    assert "detent_audit.cli.app" in graph and graph.has_edge("detent_audit.cli", "detent_audit.cli.app")
    wrong = cli_commands_importing_the_app(graph)
    assert not wrong, "register the command in detent_audit/cli/__init__.py instead:\n" + "\n".join(wrong)


def test_manifests_and_selection_import_no_torch() -> None:
    assert not torch_importers(ROOT), torch_importers(ROOT)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "detent_audit" = "detent_audit", "detent_audit.kernels" = '
        '"kernels" }\n')
    for rel, text in {"detent_audit/__init__.py": "", "detent_audit/errors.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_checker_finds_a_package_cycle_a_wrong_arrow_and_a_stray_module(tmp_path) -> None:
    root = _tree(tmp_path, {
        "kernels/__init__.py": "from detent_audit.kernels import moe\n",
        "kernels/moe.py": "from detent_audit.kernels import gemm\n",  # names the package: its __init__ runs
        "kernels/gemm.py": "def f():\n    from detent_audit.engine.model import CausalLM\n",
        "detent_audit/engine/__init__.py": "",
        "detent_audit/engine/model.py": "from ..kernels import gemm\n",
        "detent_audit/stray.py": "import detent_audit.errors\n",
    })
    g = import_graph(root)
    assert g.has_edge("detent_audit.kernels.moe", "detent_audit.kernels")
    assert g.has_edge("detent_audit.engine.model", "detent_audit.kernels.gemm")  # relative import resolved
    cycles = new_cycles(g)
    assert len(cycles) == 1 and "detent_audit.kernels.moe (kernels/moe.py:1)" in cycles[0], cycles
    assert wrong_arrows(g) == [
        "kernels/gemm.py:2: detent_audit.kernels.gemm (kernels) imports detent_audit.engine.model (engine); "
        "kernels may import ['core']"]
    assert unplaced(g) == ["detent_audit.stray"]


def test_the_checker_accepts_the_fixed_forms(tmp_path) -> None:
    root = _tree(tmp_path, {
        "kernels/__init__.py": "from detent_audit.kernels import moe\nfrom detent_audit.kernels.gemm import "
        "f\n",
        "kernels/moe.py": "from detent_audit.kernels.gemm import f\nimport detent_audit.kernels.gemm\n",
        "kernels/gemm.py": "from detent_audit.errors import DetentError\n",
    })
    g = import_graph(root)
    assert not new_cycles(g) and not wrong_arrows(g) and not unplaced(g)


def test_an_import_that_runs_later_breaks_a_cycle_but_still_counts_as_an_arrow(tmp_path) -> None:
    root = _tree(tmp_path, {
        "kernels/__init__.py": "",
        "kernels/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from "
        "detent_audit.kernels.b import B\n",
        "kernels/b.py": "import detent_audit.kernels.a\n\ndef f():\n    from detent_audit.engine.llm import "
        "LLM\n", "detent_audit/engine/__init__.py": "",
        # a class body runs at load
        "detent_audit/engine/llm.py": "class LLM:\n    import detent_audit.kernels.b\n",
    })
    g = import_graph(root)
    assert not g.edges["detent_audit.kernels.a", "detent_audit.kernels.b"]["at_load"]
    assert not g.edges["detent_audit.kernels.b", "detent_audit.engine.llm"]["at_load"]
    assert g.edges["detent_audit.engine.llm", "detent_audit.kernels.b"]["at_load"]
    assert not new_cycles(g)
    assert [w.split(": ")[0] for w in wrong_arrows(g)] == ["kernels/b.py:4"]


def test_the_checker_finds_a_cli_command_that_imports_the_app(tmp_path) -> None:
    root = _tree(tmp_path, {
        "detent_audit/cli/__init__.py": "from detent_audit.cli import good, bad\nfrom detent_audit.cli.app "
        "import app\n", "detent_audit/cli/app.py": "import typer\n",
        "detent_audit/cli/options.py": "import typer\n",
        "detent_audit/cli/good.py": "from detent_audit.cli.options import JSON\n",
        "detent_audit/cli/bad.py": "def f():\n    from detent_audit.cli.app import app\n",
    })
    g = import_graph(root)
    assert not new_cycles(g) and not wrong_arrows(g) and not unplaced(g)
    assert cli_commands_importing_the_app(g) == [
        "detent_audit/cli/bad.py:2: detent_audit.cli.bad imports detent_audit.cli.app"]
