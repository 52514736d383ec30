"""Decode-step variants of the embedded engine on the GPU, timed as `gpu_decode_loop.py` times the engine
(wall per step, graph replay, host work, floor ratio), per batch size: the committed tuple's attention values
(KV tile, split stride: pinned knobs, so their bits differ from the default's), the GEMM's decode tile and
the decode attention's launch shape (harmless for the bits: a variant that changes neither pinned value must
give the default's outputs exactly, and the script says whether it does).

Usage (device): python3 benchmarks/gpu_decode_variants.py [--batches 1,32,256]
Writes $OUT/gpu_decode_variants_<shape>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
from typing import NamedTuple

import torch

import detent_audit.kernels.gpu as gpu_kernels
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.kernels.gpu import AttentionLaunch
from detent_audit.kernels.triton_gemm import TritonGemmConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode_loop import copy_bandwidth, engine_rows, matmul_rate  # noqa: E402

ENGINE_TILE = gpu_kernels.gemm_tile
ENGINE_DECODE_LAUNCH = gpu_kernels.DECODE_LAUNCH


def narrow_tile(m: int, n: int = 0, k: int = 0) -> TritonGemmConfig:
    """The engine's tiles, but twice the programs for a narrow (n <= 8192) call of at most 16 rows."""
    if m <= 16 and n <= 8192:
        return TritonGemmConfig(16, 16, 256, 8, 2, 4)
    return ENGINE_TILE(m, n, k)


class Variant(NamedTuple):
    committed: dict | None = None            # pinned values over the committed tuple's (None: as committed)
    tile: object = ENGINE_TILE               # gemm_tile
    decode_launch: AttentionLaunch = ENGINE_DECODE_LAUNCH


def previous_tile(m: int, n: int = 0, k: int = 0) -> TritonGemmConfig:
    """The engine's tiles before the per-projection decode tiles and the 128 x 256 tile at 129-256 rows."""
    wide = n > 8192
    if m <= 16:
        return TritonGemmConfig(16, 128, 128, 8, 4, 4) if wide else TritonGemmConfig(16, 32, 256, 8, 4, 4)
    if 64 < m <= 256:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4)
    return ENGINE_TILE(m, n, k)


VARIANTS: dict[str, Variant] = {
    "default": Variant(),
    "gemm-narrow": Variant(tile=narrow_tile),
    "kv128": Variant({"embedded.attention": {"embedded.attention.kv_tile": 128}}),
    "stride4096": Variant({"embedded.attention": {"embedded.attention.split_stride": 4096}}),
    "stride128": Variant({"embedded.attention": {"embedded.attention.split_stride": 128}}),
    "stride256": Variant({"embedded.attention": {"embedded.attention.split_stride": 256}}),
    "stride512": Variant({"embedded.attention": {"embedded.attention.split_stride": 512}}),
    "kv128-stride512": Variant({"embedded.attention": {"embedded.attention.kv_tile": 128,
                                                       "embedded.attention.split_stride": 512}}),
    "gemm-previous": Variant(tile=previous_tile),
    "attn-m64": Variant(decode_launch=AttentionLaunch(64, 4, 2)),
    "attn-st3": Variant(decode_launch=AttentionLaunch(64, 4, 3)),
    "attn-m16w1": Variant(decode_launch=AttentionLaunch(16, 1, 2)),
    "attn-m16w2": Variant(decode_launch=AttentionLaunch(16, 2, 2)),
    "attn-m16w4": Variant(decode_launch=AttentionLaunch(16, 4, 2)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.profile = False
    bw, rate = copy_bandwidth(), matmul_rate()
    rng = random.Random(0)
    biggest = max(args.batch_list)
    prompts = [[rng.randrange(1, 32000) for _ in range(args.prompt)] for _ in range(biggest)]
    blocks = biggest * (-(-(args.prompt + args.warmup + 2 * args.steps + 40) // 16)) + 64
    result: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape, "copy_bandwidth": bw}
    outputs: dict[str, dict[int, list]] = {}
    for name in args.variants.split(","):
        committed, tile, decode_launch = VARIANTS[name]
        gpu_kernels.gemm_tile = tile  # type: ignore[assignment]
        gpu_kernels.DECODE_LAUNCH = decode_launch
        try:
            llm = LLM(EngineConfig(model=f"random:{args.shape}", device="cuda", dtype="bfloat16",
                                   mode="detent", max_num_seqs=biggest,
                                   max_num_batched_tokens=max(8192, biggest),
                                   num_kv_blocks=blocks, max_model_len=args.max_model_len,
                                   attention_streaming=True, tuple=committed))
        except Exception as exc:  # a value the solver finds illegal here
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, result[name], flush=True)
            continue
        c = llm.model.config
        weight_bytes = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                           if "embed_tokens" not in n or c.tie_word_embeddings)
        kv_token_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
        result[name] = {"tuple": llm.selection.tuple}
        outputs[name] = {}
        for b in args.batch_list:
            row, outputs[name][b] = engine_rows(llm, prompts, b, args, kv_token_bytes)
            row.pop("profile")
            # the bytes floor, or the products' FLOPs at 2 bytes a weight, whichever is larger
            row["floor_ms"] = max((weight_bytes + row["kv_bytes"]) / bw, weight_bytes * b / rate) * 1e3
            row["floor_ratio_wall"] = row["wall_ms"] / row["floor_ms"]
            result[name][str(b)] = row
            print(f"{name} b={b}: wall {row['wall_ms']:.3f} ms, replay {row['replay_ms']:.3f}, host "
                  f"{row['host_ms']:.3f}, {row['tok_s']:.0f} tok/s, floor {row['floor_ms']:.3f} "
                  f"({row['floor_ratio_wall']:.3f}x)", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    gpu_kernels.gemm_tile = ENGINE_TILE  # type: ignore[assignment]
    gpu_kernels.DECODE_LAUNCH = ENGINE_DECODE_LAUNCH
    for name in [n for n in outputs if n != "default" and VARIANTS[n].committed is None]:
        if "default" in outputs:  # tiles and launch shapes are harmless: the default's bits, every batch
            result.setdefault("same_bits_as_default", {})[name] = outputs[name] == outputs["default"]
            print(f"{name} gives the default's bits:", outputs[name] == outputs["default"], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"gpu_decode_variants_{args.shape}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
