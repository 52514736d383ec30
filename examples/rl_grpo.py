"""GRPO with TRL on SmolLM2-135M-Instruct, rollouts from the detent engine, trainer logprobs with its bits.

A seeded set of arithmetic prompts, a programmatic reward (1 if the completion's last integer is the sum),
n samples per prompt each with its own seed. Per optimizer step it prints the rollout-vs-trainer bit mismatch
of the detent scorer (expected 0 of N tokens) beside TRL's stock scorer on the same generations (transformers'
forward: its mismatch and the importance-sampling ratio TRL would apply), and the time per step.

Run: .venv/bin/python examples/rl_grpo.py [--steps 3] [--out benchmarks/results/rl-grpo]   (CPU, minutes)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from detent_audit.engine.llm import LLM  # noqa: E402
from detent_audit.rl.grpo import DetentGRPOTrainer  # noqa: E402
from detent_audit.runtime.named_models import REAL_MODEL, resolve_model  # noqa: E402
from detent_audit.server.node import ServingNode  # noqa: E402


def arithmetic_prompts(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": a + b})
    return rows


def arithmetic_reward(completions: list[str], answer: list[int], **_: object) -> list[float]:
    """1.0 where the completion's last integer is the answer; a wrong integer earns up to 0.5 by how near
    it is (so a group's samples differ and GRPO's advantages are not all zero); no integer, 0."""
    rewards = []
    for text, want in zip(completions, answer):
        found = re.findall(r"-?\d+", text)
        got = int(found[-1]) if found else None
        near = 0.5 * max(0.0, 1 - abs(got - want) / 10) if got is not None else 0.0
        rewards.append(1.0 if got == want else near)
    return rewards


def build_trainer(model: str, steps: int, *, prompts: int, generations: int, batch: int, max_tokens: int,
                  seed: int, out: str, node_key: object = None) -> DetentGRPOTrainer:
    """`node_key`: an Ed25519 private key; given, every rollout is signed into `out`/receipts."""
    path = resolve_model(model).path
    torch.manual_seed(seed)
    policy = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    llm = LLM(model=model)
    node = ServingNode(llm, node_key, Path(out) / "signed") if node_key is not None else None
    config = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                        num_generations=generations, max_completion_length=max_tokens, temperature=1.0,
                        top_p=1.0, learning_rate=1e-5, beta=0.0, logging_steps=1, report_to=[], use_cpu=True,
                        save_strategy="no", seed=seed, bf16=False, dataloader_num_workers=0)
    return DetentGRPOTrainer(model=policy, processing_class=tokenizer, reward_funcs=arithmetic_reward,
                             args=config, train_dataset=Dataset.from_list(arithmetic_prompts(prompts, seed)),
                             llm=llm, run_seed=seed, node=node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=REAL_MODEL)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the per-step log here (JSON)")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args.model, args.steps, prompts=max(64, args.steps * args.batch),
                                generations=args.generations, batch=args.batch, max_tokens=args.max_tokens,
                                seed=args.seed, out=tmp)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    print(f"{'step':>4} {'detent mismatch':>18} {'stock mismatch':>18} {'stock IS ratio min/mean/max':>30} "
          f"{'step s':>7} {'x stock':>7}")
    worst = 0
    for i, e in enumerate(trainer.step_log):
        detent_step = e["step_s"] - e["comparison_s"]
        stock_step = detent_step - e["exact_scorer_s"]
        e["step_ratio_detent_over_stock"] = detent_step / stock_step
        worst = max(worst, int(e["logprob_bit_mismatch_tokens"]))
        print(f"{i:>4} {int(e['logprob_bit_mismatch_tokens']):>8} of {int(e['tokens']):>5} "
              f"{int(e['stock_logprob_bit_mismatch_tokens']):>8} of {int(e['tokens']):>5} "
              f"{e['stock_importance_ratio_min']:>10.6f}/{e['stock_importance_ratio_mean']:.6f}/"
              f"{e['stock_importance_ratio_max']:.6f} {detent_step:>7.2f} "
              f"{e['step_ratio_detent_over_stock']:>7.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        machine = f"{platform.machine()} {platform.processor() or ''}".strip()
        record = {"model": args.model, "machine": machine,
                  "cpu_count": os.cpu_count(), "torch": torch.__version__, "command": " ".join(sys.argv),
                  "wall_s": wall, "steps": trainer.step_log, "rollout_seeds": trainer.rollout_seeds,
                  "weights_digests": trainer.weights_digests}
        (args.out / "run.json").write_text(json.dumps(record, indent=1))
    raise SystemExit(1 if worst else 0)


if __name__ == "__main__":
    main()
