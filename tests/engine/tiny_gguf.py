"""A tiny llama GGUF file written with gguf's own writer, seeded: what `import-gguf` reads, in ms."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2  # Q8_0 blocks are 32 wide
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "Ġa", "abc"]
MERGES = ["a b", "Ġ a", "ab c"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama GGUF with random weights (F32, F16 and Q8_0 tensors), a byte-level BPE vocabulary,
    control tokens and a chat template."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_merges(MERGES)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)

    def tensor(name: str, shape: tuple[int, ...], quant: str = "F32") -> None:
        values = rng.standard_normal(shape).astype(np.float32)
        if quant == "Q8_0":
            w.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, values.astype(np.float16) if quant == "F16" else values)

    tensor("token_embd.weight", (len(TOKENS), HIDDEN))
    tensor("output_norm.weight", (HIDDEN,))
    head_dim = HIDDEN // HEADS
    for layer in range(LAYERS):
        tensor(f"blk.{layer}.attn_norm.weight", (HIDDEN,))
        tensor(f"blk.{layer}.attn_q.weight", (HEADS * head_dim, HIDDEN), "Q8_0")
        tensor(f"blk.{layer}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), "F16")
        tensor(f"blk.{layer}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(f"blk.{layer}.attn_output.weight", (HIDDEN, HEADS * head_dim), "Q8_0")
        tensor(f"blk.{layer}.ffn_norm.weight", (HIDDEN,))
        tensor(f"blk.{layer}.ffn_gate.weight", (FFN, HIDDEN))
        tensor(f"blk.{layer}.ffn_up.weight", (FFN, HIDDEN), "F16")
        tensor(f"blk.{layer}.ffn_down.weight", (HIDDEN, FFN), "Q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
