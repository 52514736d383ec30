"""`import_gguf`: a llama.cpp GGUF file -> a Hugging Face checkpoint folder the engine loads.

The file is read with the `gguf` package (`GGUFReader`) and its tensors dequantized with
`gguf.quants.dequantize`: no dequantizer or BPE of our own. What is written:
- config.json from the GGUF metadata (Llama architecture only; any other is refused by name),
- model.safetensors: names mapped by `TENSOR_MAP`, the Q/K row permutation llama.cpp's converter applies
  undone (`unpermute_qk`), values cast to the chosen dtype,
- tokenizer.json built with `tokenizers` from the GGUF vocabulary, merges and control tokens (byte-level BPE,
  as transformers' own GGUF loader builds it), tokenizer_config.json, chat_template.jinja from
  `tokenizer.chat_template`, generation_config.json with the BOS/EOS ids.
The folder is written under a temporary sibling and renamed into place, so a crash leaves no partial model,
and of two imports racing for one folder the first rename wins and the other is `ImportRaced` (its copy
dropped). The same file and dtype give byte-identical files in any process (sorted JSON keys; the
safetensors file in `tensor_files.write_canonical`'s form).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from detent_audit.errors import BadInput
from detent_audit.manifests.encoding import JsonValue
from detent_audit.runtime.dtypes import DTYPES, RUN_DTYPES
from detent_audit.runtime.errors import UnsupportedModel
from detent_audit.runtime.tensor_files import write_canonical

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor
    from tokenizers import Tokenizer

IMPORT_VERSION = 2  # bump when the written files change, so cached imports are redone
GGUF_MAGIC = b"GGUF"
# the quantizations `gguf.quants.dequantize` handles that this importer accepts
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# GGUF tensor name -> HF name ({L}: layer)
TENSOR_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{L}.attn_norm.weight": "model.layers.{L}.input_layernorm.weight",
    "blk.{L}.attn_q.weight": "model.layers.{L}.self_attn.q_proj.weight",
    "blk.{L}.attn_k.weight": "model.layers.{L}.self_attn.k_proj.weight",
    "blk.{L}.attn_v.weight": "model.layers.{L}.self_attn.v_proj.weight",
    "blk.{L}.attn_output.weight": "model.layers.{L}.self_attn.o_proj.weight",
    "blk.{L}.ffn_norm.weight": "model.layers.{L}.post_attention_layernorm.weight",
    "blk.{L}.ffn_gate.weight": "model.layers.{L}.mlp.gate_proj.weight",
    "blk.{L}.ffn_up.weight": "model.layers.{L}.mlp.up_proj.weight",
    "blk.{L}.ffn_down.weight": "model.layers.{L}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile(re.escape(g).replace(r"\{L\}", r"(?P<L>\d+)")), h) for g, h in TENSOR_MAP.items()]
_CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token


class ImportRaced(BadInput):
    """Another import filled the target folder first (two first uses of a model at once)."""

    remedy = "use the folder the other import wrote, or choose a new --out folder"


@dataclass(frozen=True)
class GGUFImport:
    """What `import_gguf` wrote: the folder, the file's SHA-256, the tensor count and the quantizations
    met."""

    path: Path
    sha256: str
    num_tensors: int
    quantizations: tuple[str, ...]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _gguf() -> ModuleType:
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError as exc:
        raise BadInput("reading a GGUF file needs the gguf package, which is not installed",
                       remedy="pip install gguf") from exc
    return gguf


def open_gguf(file: str | Path) -> GGUFReader:
    """A `GGUFReader` over `file`; `BadInput` naming what is wrong for a missing, foreign or truncated
    file."""
    file = Path(file)
    if not file.is_file():
        raise BadInput(f"{file}: no such GGUF file")
    with file.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise BadInput(f"{file} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(file), "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on a short file
        raise BadInput(f"{file} is truncated or corrupt: the GGUF reader stopped with {exc!r}",
                       remedy="download the file again and check its SHA-256") from exc
    size = file.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise BadInput(f"{file} is truncated: tensor {t.name} needs bytes up to {end}, the file has "
                           f"{size}", remedy="download the file again and check its SHA-256")
    return reader


def _field(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise BadInput(f"the GGUF file lacks the metadata key {key}")
        return default
    value = field.contents()
    return value


def gguf_config(reader: GGUFReader) -> dict[str, Any]:
    """config.json (HF keys) from the metadata; `UnsupportedModel` for an architecture other than llama."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported by the importer (only 'llama')")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise UnsupportedModel(f"GGUF rope scaling {scaling!r} is not supported by the importer")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        # the file holds binary32 values: their exact binary64 value (as transformers reads them)
        "rms_norm_eps": float(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(np.float32(_field(reader, "llama.rope.freq_base", 10000.0))),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos), "eos_token_id": int(eos),
        "torch_dtype": "float32",
    }


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor; `UnsupportedModel` for one the importer does not know."""
    for pattern, template in _PATTERNS:
        m = pattern.fullmatch(gguf_name)
        if m:
            return template.format(L=m.group("L")) if "{L}" in template else template
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no Hugging Face name in the importer's table")


def unpermute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: its converter reorders each head's rows from rotate-half (HF) to
    interleaved pairs; rows [h, pair, 2] go back to [h, 2, pair]. weight: [heads * head_dim, in]."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def dequantized(reader_tensor: ReaderTensor) -> np.ndarray:
    """A tensor's float32 values in HF order ([out, in] for matrices)."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType(int(reader_tensor.tensor_type))
    if qtype.name not in SUPPORTED_TYPES:
        raise UnsupportedModel(f"GGUF tensor {reader_tensor.name} is quantized as {qtype.name}; the importer "
                               f"reads {', '.join(SUPPORTED_TYPES)}")
    values = gguf.quants.dequantize(reader_tensor.data, qtype)
    shape = tuple(int(d) for d in reversed(reader_tensor.shape))  # GGUF lists dimensions innermost first
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def build_tokenizer_json(reader: GGUFReader) -> tuple[Tokenizer, dict[str, JsonValue]]:
    """A `tokenizers` byte-level BPE from the GGUF vocabulary and merges, control tokens special; and the
    tokenizer_config.json entries. Only `gpt2`-style (BPE) vocabularies are read."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported by the importer (only 'gpt2' "
                               "BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(types) if kind == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def text(key: str) -> str | None:
        i = _field(reader, key, None)
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    bos = text("tokenizer.ggml.bos_token_id")
    if bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    tok_config: dict[str, JsonValue] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                  "eos_token": text("tokenizer.ggml.eos_token_id"),
                  "unk_token": text("tokenizer.ggml.unknown_token_id"),
                  "pad_token": text("tokenizer.ggml.padding_token_id"), "clean_up_tokenization_spaces": False,
                  "model_max_length": int(_field(reader, "llama.context_length"))}
    return tok, {k: v for k, v in tok_config.items() if v is not None}


def _write_json(file: Path, data: object) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_checkpoint(reader: GGUFReader, folder: Path, dtype: str, sha256: str,
                     progress: Callable[[int, int], None] | None = None) -> tuple[int, tuple[str, ...]]:
    """Write the HF files of `reader` into the (empty) `folder`; returns (tensors, quantizations)."""
    config = gguf_config(reader)
    config["torch_dtype"] = dtype
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    qtypes: set[str] = set()
    gguf = _gguf()
    for i, t in enumerate(reader.tensors):
        if t.name == "rope_freqs.weight":
            raise UnsupportedModel("GGUF tensor rope_freqs.weight (scaled RoPE) is not supported by the "
                                   "importer")
        name = hf_name(t.name)
        if name in tensors:
            raise BadInput(f"the GGUF file holds tensor {t.name} twice")
        qtypes.add(gguf.GGMLQuantizationType(int(t.tensor_type)).name)
        values = dequantized(t)
        if name.endswith("q_proj.weight"):
            values = unpermute_qk(values, heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_qk(values, kv_heads)
        tensors[name] = torch.from_numpy(np.array(values)).to(DTYPES[dtype])
        if progress is not None:
            progress(i + 1, len(reader.tensors))
    write_canonical(folder / "model.safetensors", tensors, {"format": "pt", "gguf_sha256": sha256})
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    tokenizer, tok_config = build_tokenizer_json(reader)
    tokenizer.save(str(folder / "tokenizer.json"), pretty=True)
    _write_json(folder / "tokenizer_config.json", tok_config)
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return len(tensors), tuple(sorted(qtypes))


def check_import(file: str | Path, out: str | Path, dtype: str) -> GGUFReader:
    """The checks of `import_gguf` before anything is written: the reader of `file`, or `BadInput`."""
    out = Path(out)
    if dtype not in RUN_DTYPES:
        raise BadInput(f"cannot import as {dtype}", remedy=f"use one of {', '.join(RUN_DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"{out} exists and is not an empty folder", remedy="choose a new --out folder")
    return open_gguf(file)


def import_gguf(file: str | Path, out: str | Path, dtype: str = "float32",
                progress: Callable[[int, int], None] | None = None) -> GGUFImport:
    """Import the GGUF `file` into the new folder `out` (refused if it exists and is not empty).

    Raises `BadInput` for a missing, foreign or truncated file, an existing `out` or an unknown dtype, and
    `UnsupportedModel` for an architecture, tensor, quantization or tokenizer the importer does not read.
    """
    file, out = Path(file), Path(out)
    reader = check_import(file, out, dtype)
    sha256 = sha256_file(file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache's model from other users
        count, qtypes = write_checkpoint(reader, tmp, dtype, sha256, progress)
        for f in tmp.iterdir():
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
        try:
            if out.exists():
                out.rmdir()  # empty (checked above), unless another import filled it since
            os.rename(tmp, out)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise ImportRaced(f"{out} was filled by another import while this one ran") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return GGUFImport(out, sha256, count, qtypes)
