"""The engine's fp32 logprobs and greedy tokens on SmolLM2-135M-Instruct against transformers' GGUF loader.

16 prompts x 32 greedy tokens: the engine runs them in one batch (detent mode), transformers one by one with
its KV cache and no logits processors. Reported: how many continuations are equal to the last token, where the
others part (and transformers' logit margin there: a near tie decides it), and the largest difference between
the engine's fp32 logprob and transformers' float64 log_softmax over the tokens both chose.
Needs the test extra (transformers, accelerate, gguf).
Usage: python benchmarks/real_model_agreement.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.named_models import REAL_MODEL, wheel_gguf
from detent_audit.runtime.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is", "Question: what is 2 + 2?\nAnswer:", "Once upon a time, there was a",
    "The three primary colors are", "def add(a, b):\n", "Water boils at",
           "The largest planet in the solar system is",
    "In 1492, Columbus", "A haiku about autumn:\n", "Photosynthesis is the process by which",
    "The square root of 144 is", "To make a cup of tea, first", "Python is a programming language that",
    "The opposite of hot is", "My favourite book is", "The speed of light is",
]


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Transformers' greedy decoding with its KV cache and no logits processors (generate's min_new_tokens
    would mask the EOS token, which the engine's ignore_eos still draws)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            step = hf_model(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    gguf = wheel_gguf(REAL_MODEL)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              torch_dtype=torch.float32).eval()
    llm = LLM(EngineConfig(model=REAL_MODEL, mode="detent"))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True))
    rows, worst = [], 0.0
    for text, ids, out in zip(PROMPTS, prompts, outs):
        theirs = hf_greedy(hf, ids, args.tokens)
        same = next((i for i, (a, b) in enumerate(zip(out.token_ids, theirs)) if a != b), args.tokens)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:].double()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        diff = (torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs()[:same + 1].max().item()
        worst = max(worst, diff)
        margin = ((logits[same, theirs[same]] - logits[same, out.token_ids[same]]).item()
                  if same < args.tokens else None)
        rows.append({"prompt": text, "equal_tokens": same, "max_abs_logprob_diff": diff,
                     "margin_at_part": margin})
    equal = sum(r["equal_tokens"] == args.tokens for r in rows)
    print(f"device: {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), torch "
          f"{torch.__version__}; "
          f"{REAL_MODEL} fp32, detent mode, {len(PROMPTS)} prompts x {args.tokens} greedy tokens\n")
    print("| prompt | equal tokens | max abs logprob diff | transformers' logit margin where they part |")
    print("|---|---|---|---|")
    for r in rows:
        m = "-" if r["margin_at_part"] is None else f"{r['margin_at_part']:.2e}"
        print(f"| {json.dumps(r['prompt'])[1:-1]} | {r['equal_tokens']}/{args.tokens} | "
              f"{r['max_abs_logprob_diff']:.2e} | {m} |")
    print(f"\n{equal}/{len(rows)} continuations equal to the last token; "
          f"largest logprob difference {worst:.2e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "equal": equal, "worst": worst}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
