"""The repository's own text stays true: docs/structure.md names every module (and nothing that is gone),
benchmarks/RESULTS.md cites raw files that exist, and no text cites documents outside the repository or
speaks of how the work was scheduled instead of what the project is."""

from __future__ import annotations

import ast
import glob
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
STRUCTURE = ROOT / "docs" / "structure.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SKIP_DIRS = {".git", ".venv", "build", "out", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".jsonl", ".sh"}
# documents of the people who build the project, which no user of the package has
OUTSIDE = re.compile(r"\bshared/|\breference/[\w-]+\.md\b|\bDESIGN(?: section)? [0-9]|\bSTYLE\.md\b")
# where a figure came from in the work's schedule, not what it is
HISTORY = re.compile(r"\bissues? [0-9]+|(?<!HTTP )(?<!client )(?<!test )\bsession\b|"
                     r"\b(?:first|second|third|fourth|fifth|this|that|next) slice\b|\bsitting\b|"
                     r"\bcalls? [0-9]+\b|\bnumbered by call\b")


def _files() -> list[Path]:
    found = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "Makefile"):
            found.append(path)
    return found


def _prose(path: Path) -> str:
    """The text a reader reads: all of a document, a Python file's comments and strings with a space in them
    (docstrings, messages; not `"session"` given to pytest, not code such as `slice(...)`)."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return text
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and " " in tok.string):
            parts.append(tok.string)
    return "\n".join(parts)


def _offending(pattern: re.Pattern[str]) -> list[str]:
    hits = []
    for path in _files():
        if path == Path(__file__):
            continue
        for line in _prose(path).splitlines():
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}: {line.strip()[:120]}")
    return hits


def test_no_text_cites_documents_outside_the_repository() -> None:
    hits = _offending(OUTSIDE)
    assert not hits, ("cite the upstream source (repo, file, version) or docs/design.md instead:\n"
                      + "\n".join(hits))


def test_no_text_speaks_of_the_work_schedule() -> None:
    hits = _offending(HISTORY)
    assert not hits, ("say what the figure or code is, not when or in which step it was made:\n"
                      + "\n".join(hits))


def test_the_patterns_catch_what_they_are_for() -> None:
    bad = ["see shared/reference/models.md", "(DESIGN 7)", "as in issue 5", "session 6: the crossover",
           "the first slice", "(call 2, gpu_tune.py)", "calls 4-5 ran it", "raw output numbered by call"]
    fine = ["an HTTP session", "once per test session", "every recorded call", "a call's runtime inputs",
            "docs/design.md section 7", "RFC 6962 section 2.1", "msgpack/msgpack#215", "one expert's slices"]
    for text in bad:
        assert OUTSIDE.search(text) or HISTORY.search(text), text
    for text in fine:
        assert not OUTSIDE.search(text) and not HISTORY.search(text), text


def _sections(text: str) -> dict[str, str]:
    """structure.md's `## <folder>/ ...` sections: folder -> its text."""
    found: dict[str, str] = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        folder = head.split()[0].rstrip("/")
        found[folder] = body
    return found


def _documented(path: Path) -> bool:
    """A module that needs its line: any but a package `__init__.py` that holds only its docstring."""
    if path.name != "__init__.py":
        return True
    body = [node for node in ast.parse(path.read_text()).body
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    only_docstring = (len(body) == 1 and isinstance(body[0], ast.Expr)
                      and isinstance(body[0].value, ast.Constant))
    return bool(body) and not only_docstring


@pytest.mark.parametrize("folder", ["selection", "kernels", "manifests", "verifier", "detent_audit",
                                    "benchmarks", "examples"])
def test_structure_names_every_module_of_each_folder(folder) -> None:
    section = _sections(STRUCTURE.read_text())[folder]
    named = set(re.findall(r"`([^`]+\.py)`", section))
    modules = {p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder).rglob("*.py")
               if "__pycache__" not in p.parts and _documented(p)}
    missing = sorted(modules - named)
    assert not missing, f"add a line to docs/structure.md, section {folder}/: {missing}"
    gone = {n for n in named if "*" not in n and not (ROOT / folder / n).exists()}
    assert not gone, f"docs/structure.md names modules that are gone: {sorted(gone)}"


def test_results_cites_raw_files_that_exist_and_every_raw_folder_is_cited() -> None:
    text = RESULTS.read_text()
    cited = set(re.findall(r"results/[\w.*/-]+", text))
    base = ROOT / "benchmarks"
    missing = sorted(c for c in cited if not glob.glob(str(base / c.rstrip(".,"))))
    assert not missing, f"RESULTS.md cites raw output that is not there: {missing}"
    folders = sorted(p.name for p in (base / "results").iterdir() if p.is_dir())
    assert folders, "benchmarks/results/ has no raw output"
    uncited = [f for f in folders if f"results/{f}/" not in text]
    assert not uncited, f"raw folders RESULTS.md never cites: {uncited}"
    dated = [f for f in folders if re.search(r"\d{4}-\d{2}-\d{2}|-s\d+$", f)]
    assert not dated, f"name raw folders by what they hold, not when they were made: {dated}"


def test_results_headline_rows_link_to_sections_scripts_and_raw_files() -> None:
    text = RESULTS.read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
               for h in re.findall(r"^#{2,3} (.+)$", text, flags=re.M)}
    head = text[text.index("## Headline figures"):]
    head = head[: head.index("\n## ", 1)]
    rows = [r for r in head.splitlines() if r.startswith("| ") and not r.startswith("| claim")]
    assert len(rows) >= 10
    for row in rows:
        links = re.findall(r"\]\(([^)]+)\)", row)
        sections = [link[1:] for link in links if link.startswith("#")]
        assert sections and all(s in anchors for s in sections), row
        for link in links:
            if not link.startswith("#"):
                assert (ROOT / "benchmarks" / link).exists(), (link, row)


RESULTS_MAX_LINES, HEADLINE_CELL_MAX = 500, 200
# how a lab log reads, not a record by claim: runs numbered in the text, fixes told as stories
LAB_LOG = re.compile(r"\bruns? [0-9]+(?:-[0-9]+| and [0-9]+)\b|\bfirst run of\b|\bit used to\b|"
                     r"\bthis round\b|\bbefore the fix\b|\bafter the fix\b|\bsession\b|\bissue [0-9]+")


def _headline_rows(text: str) -> list[list[str]]:
    head = text[text.index("## Headline figures"):]
    head = head[: head.index("\n## ", 1)]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")]
            for row in head.splitlines() if row.startswith("| ") and not row.startswith("| claim")]


def test_results_is_a_short_record_by_claim() -> None:
    text = RESULTS.read_text()
    lines = text.count("\n")
    assert lines <= RESULTS_MAX_LINES, f"RESULTS.md has {lines} lines: move long tables to its raw files"
    log = [line.strip()[:120] for line in text.splitlines() if LAB_LOG.search(line)]
    assert not log, "state the latest run of each claim; git keeps the history:\n" + "\n".join(log)
    rows = _headline_rows(text)
    assert len(rows) >= 10
    for claim, figure, section, command, raw in rows:
        long = [cell for cell in (claim, figure, section, command, raw) if len(cell) > HEADLINE_CELL_MAX]
        assert not long, f"headline cells over {HEADLINE_CELL_MAX} characters: {long}"
        assert re.search(r"\]\(#[\w-]+\)", section), f"{claim}: the section cell links no section"
        assert "`" in command, f"{claim}: the command cell names no command"
        assert re.search(r"\]\(results/[^)]+\)", raw), f"{claim}: the raw cell links no file under results/"
