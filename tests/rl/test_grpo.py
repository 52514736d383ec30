"""TRL's GRPO with the engine's rollouts and scorer: one tiny step on a random model (CI), three on SmolLM2
(slow). Every step's rollout-vs-trainer bit mismatch is 0; every sample has its own seed; the engine takes
the trained weights before the next rollout."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from rl_grpo import build_trainer  # noqa: E402

from detent_audit.manifests.keys import keyid  # noqa: E402
from detent_audit.manifests.receipt import verify_envelope  # noqa: E402
from detent_audit.rl.grpo import completion_pairs, sample_seed  # noqa: E402


def run(model: str, steps: int, receipts: list | None = None, **kwargs: int):
    """`receipts`: given, every rollout is signed and its receipt appended."""
    with tempfile.TemporaryDirectory() as tmp:
        key = Ed25519PrivateKey.generate() if receipts is not None else None
        trainer = build_trainer(model, steps, seed=0, out=tmp, node_key=key, **kwargs)
        trainer.train()
        if receipts is not None:
            for path in sorted((Path(tmp) / "signed" / "receipts").iterdir()):
                public = key.public_key()
                receipts.append(verify_envelope(path.read_bytes(), {keyid(public): public}).receipt)
    return trainer


def check(trainer, steps: int) -> None:
    assert len(trainer.step_log) == steps
    for entry in trainer.step_log:
        assert entry["tokens"] > 0
        assert entry["logprob_bit_mismatch_tokens"] == 0
        assert entry["train_rollout_logprob_abs_diff_max"] == 0.0
    seeds = [s for step in trainer.rollout_seeds for s in step]
    assert len(set(seeds)) == len(seeds)  # n > 1 samples of a prompt never share a seed
    assert trainer.llm.weights_digest == trainer.weights_digests[-1]


def test_one_grpo_step_on_a_random_model_has_no_bit_mismatch() -> None:
    receipts: list = []
    trainer = run("random-20m", 1, receipts, prompts=8, generations=2, batch=4, max_tokens=4)
    check(trainer, 1)
    # each rollout signed: its own seed, the policy's digest
    assert sorted(r.request.seed for r in receipts) == sorted(trainer.rollout_seeds[0])
    assert {r.deployment_facts["checkpoint"]["weights"] for r in receipts} == {trainer.weights_digests[0]}


def test_completion_pairs_strip_trl_padding() -> None:
    import torch

    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [1, 2, 3, 4, 9, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    assert completion_pairs(ids, mask, 3) == [([5, 6], [7, 8]), ([1, 2, 3, 4], [9])]
    assert len({sample_seed(0, s, i) for s in range(3) for i in range(50)}) == 150


@pytest.mark.slow
def test_grpo_on_smollm2_three_steps_zero_mismatch_while_stock_differs() -> None:
    trainer = run("smollm2-135m-instruct", 3, prompts=24, generations=4, batch=8, max_tokens=16)
    check(trainer, 3)
    assert len(set(trainer.weights_digests)) == 3  # every step's rollouts from its own policy version
    assert sum(e["stock_logprob_bit_mismatch_tokens"] for e in trainer.step_log) > 0
