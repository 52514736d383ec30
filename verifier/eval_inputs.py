"""`verify-eval`'s inputs, read and checked before anything is rebuilt: lm-eval's `results_<time>.json` and
its `samples_<task>_<time>.jsonl` files, each through a bounded reader (regular files only: a FIFO named like
one is refused, never waited on), each refused as `BadInput` naming the file, line and field where it is not
what lm-eval writes. What this module returns has the shape the audit relies on."""

from __future__ import annotations

import json
import re
from pathlib import Path

from detent_audit.errors import BadInput
from detent_audit.manifests import decoding as dec
from detent_audit.manifests.errors import InvalidReceipt

MAX_RESULTS_BYTES = 64 << 20
MAX_SAMPLES_BYTES = 1 << 30  # a task's logged samples: its documents, requests and responses
MAX_DEPTH = 64  # JSON nesting lm-eval's files need is under 10
_RESULTS = re.compile(r"results_(.+)\.json")
_ARG_KEY = re.compile(r"(gen_args|arg)_(0|[1-9][0-9]{0,5})")
_REMEDY = "give the folder lm-eval --output_path wrote with --log_samples, unedited"


def find_run(path: Path) -> tuple[Path, dict[str, Path]]:
    """The results file (`path`, or the newest results_*.json under the folder `path`) and its samples files
    by task (same timestamp, same folder)."""
    if path.is_dir():
        found = sorted((p for p in path.rglob("results_*.json") if _RESULTS.fullmatch(p.name)),
                       key=lambda p: p.name)
        if not found:
            raise BadInput(f"{path}: no lm-eval results_*.json in this folder",
                           remedy="give lm-eval's --output_path folder (run with --log_samples)")
        path = found[-1]
    match = _RESULTS.fullmatch(path.name)
    if match is None:
        raise BadInput(f"{path}: not an lm-eval results_<time>.json file")
    stamp = match.group(1)
    samples = {p.name[len("samples_"):-len(f"_{stamp}.jsonl")]: p
               for p in path.parent.glob(f"samples_*_{stamp}.jsonl")}
    if not samples:
        raise BadInput(f"{path.parent}: no samples_*_{stamp}.jsonl beside {path.name}",
                       remedy="run lm-eval with --log_samples: the score is recomputed from each logged "
                              "sample")
    return path, samples


def _read_text(path: Path, max_bytes: int, what: str) -> str:
    try:
        data = dec.read_bounded(path, max_bytes, what=what)
    except InvalidReceipt as exc:
        raise BadInput(exc.message, remedy=_REMEDY) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 text (byte {exc.start})", remedy=_REMEDY) from None


def _json(text: str, where: str) -> object:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadInput(f"{where}: not JSON ({str(exc)[:200]})", remedy=_REMEDY) from None
    _check_depth(value, where)
    return value


def _check_depth(value: object, where: str) -> None:
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadInput(f"{where}: nested deeper than {MAX_DEPTH} levels", remedy=_REMEDY)
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise BadInput(f"{where}: expected a JSON object, got {dec.describe(value)}", remedy=_REMEDY)
    return value


def read_results(path: Path) -> dict:
    """lm-eval's results file: an object whose `results` maps each task to its object of metrics, whose
    `config` (when present) is an object with `model_args` a string or an object."""
    text = _read_text(path, MAX_RESULTS_BYTES, "lm-eval results file")
    results = _object(_json(text, str(path)), str(path))
    reported = _object(results.get("results"), f"{path}: results")
    for task, metrics in reported.items():
        _object(metrics, f"{path}: results.{task}")
    config = _object(results.get("config", {}), f"{path}: config")
    args = config.get("model_args")
    if args is not None and not isinstance(args, (str, dict)):
        raise BadInput(f"{path}: config.model_args: expected a string or an object, got {dec.describe(args)}",
                       remedy=_REMEDY)
    return results


def read_samples(path: Path) -> list[dict]:
    """One logged sample per document (lm-eval writes one line per document and filter: the first is kept,
    the requests and responses are the same in each), each checked: `doc_id` a whole number, `doc` an
    object, `arguments` each request's arguments (an object of `gen_args_<i>` objects of `arg_<j>`, or a
    list of lists; its first argument a string or a list), `resps` a list per request."""
    seen: dict[int, dict] = {}
    text = _read_text(path, MAX_SAMPLES_BYTES, "lm-eval samples file")
    for n, line in enumerate(text.split("\n"), 1):  # JSON lines: a U+2028 inside a string ends no line
        if not line.strip():
            continue
        where = f"{path}:{n}"
        sample = _object(_json(line, where), where)
        missing = [k for k in ("doc_id", "doc", "arguments", "resps") if k not in sample]
        if missing:
            raise BadInput(f"{where}: not an lm-eval logged sample (no {', '.join(missing)})", remedy=_REMEDY)
        doc_id = sample["doc_id"]
        if isinstance(doc_id, bool) or not isinstance(doc_id, int) or doc_id < 0:
            raise BadInput(f"{where}: doc_id: expected a whole number, got {dec.describe(doc_id)}",
                           remedy=_REMEDY)
        _object(sample["doc"], f"{where}: doc")
        args = arguments(sample, where)
        resps = sample["resps"]
        if not isinstance(resps, list) or len(resps) != len(args) or \
                any(not isinstance(x, list) for x in resps):
            raise BadInput(f"{where}: resps: expected a list of {len(args)} lists (one per request), got "
                           f"{dec.describe(resps)}", remedy=_REMEDY)
        seen.setdefault(doc_id, sample)
    if not seen:
        raise BadInput(f"{path}: no logged sample in this file", remedy=_REMEDY)
    return [seen[k] for k in sorted(seen)]


def arguments(sample: dict, where: str = "sample") -> list[tuple]:
    """A logged sample's request arguments as lm-eval's `Instance.args`: lm-eval writes them as
    {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...} (or as lists); `BadInput` where they are neither."""
    args = sample["arguments"]
    if isinstance(args, dict):
        out = []
        for name in _indexed(args, "gen_args", f"{where}: arguments"):
            one = _object(args[name], f"{where}: arguments.{name}")
            out.append(tuple(one[k] for k in _indexed(one, "arg", f"{where}: arguments.{name}")))
    elif isinstance(args, list) and all(isinstance(a, list) for a in args):
        out = [tuple(a) for a in args]
    else:
        raise BadInput(f"{where}: arguments: expected an object of gen_args_<i> or a list of lists, got "
                       f"{dec.describe(args)}", remedy=_REMEDY)
    if not out:
        raise BadInput(f"{where}: arguments: no request", remedy=_REMEDY)
    for i, a in enumerate(out):
        if not a or not isinstance(a[0], (str, list)):
            raise BadInput(f"{where}: arguments of request {i}: expected the prompt (a string or a list) "
                           f"first, got {dec.describe(a[0] if a else a)}", remedy=_REMEDY)
    return out


def _indexed(obj: dict, prefix: str, where: str) -> list[str]:
    """`obj`'s keys, which must be `<prefix>_0` .. `<prefix>_<n-1>`, in index order."""
    names = [f"{prefix}_{i}" for i in range(len(obj))]
    if sorted(obj) != sorted(names) or not all(_ARG_KEY.fullmatch(k) for k in obj):
        raise BadInput(f"{where}: expected the keys {prefix}_0 .. {prefix}_{len(obj) - 1}, got "
                       f"{sorted(obj)[:5]}", remedy=_REMEDY)
    return names
