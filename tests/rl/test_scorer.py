"""The trainer's scorer: values bit-identical to the engine's seeded rollouts in any batching, gradients of
the differentiable forward (float64 gradcheck; SmolLM2 against transformers' within a stated tolerance)."""

from __future__ import annotations

import random

import pytest
import torch

from detent_audit.engine.llm import LLM
from detent_audit.rl.forward import token_scores
from detent_audit.rl.scorer import Scorer, serving_values
from detent_audit.runtime.named_models import REAL_MODEL, resolve_model
from detent_audit.runtime.sampling_params import SamplingParams

# SmolLM2-135M fp32: the differentiable forward's logprobs against the serving bits, and its gradients
# against transformers' (relative to the gradient's largest element)
LOGPROB_ATOL = 1e-4
GRAD_RTOL = 1e-3


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).contiguous().view(torch.int32)


def rollouts(llm: LLM, n: int, seed: int, vocab: int, max_new: int = 8):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 24))] for _ in range(n)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=rng.randrange(1 << 63), ignore_eos=True,
                             max_tokens=rng.randint(1, max_new)) for _ in range(n)]
    return llm.generate(prompts, params)


@pytest.mark.parametrize("micro_batch", [1, 3, 7])
def test_scorer_values_are_the_rollout_bits_in_any_batching(micro_batch: int) -> None:
    llm = LLM(model="random:default-20m")
    outs = rollouts(llm, 9, seed=micro_batch, vocab=256)
    order = list(range(len(outs)))
    random.Random(micro_batch + 100).shuffle(order)  # another order, padding and grouping than generation's
    scored = Scorer(llm).score([(outs[i].prompt_token_ids, outs[i].token_ids) for i in order],
                               micro_batch=micro_batch)
    for lp, i in zip(scored.logprobs, order):
        assert lp.requires_grad
        assert torch.equal(bits(lp), bits(torch.tensor(outs[i].logprobs, dtype=torch.float32)))


def test_serving_values_keep_the_exact_bits_and_pass_the_gradient() -> None:
    diff = torch.randn(5, dtype=torch.float64, requires_grad=True)
    exact = torch.tensor([-0.0, -1e-30, -3.5, float.fromhex("-0x1.000002p-1"), -7.25], dtype=torch.float32)
    out = serving_values(diff, exact)
    assert torch.equal(out.to(torch.float32).view(torch.int32), exact.view(torch.int32))
    weights = torch.randn(5, dtype=torch.float64)
    (out * weights).sum().backward()
    assert diff.grad is not None and torch.equal(diff.grad, weights)


def test_differentiable_forward_gradcheck_float64() -> None:
    llm = LLM(model="random:tiny-llama")
    model = llm.model.to(torch.float64)
    rng = random.Random(3)
    pairs = [([rng.randrange(200) for _ in range(rng.randint(1, 5))], [rng.randrange(200) for _ in range(k)])
             for k in (1, 3, 2)]
    checked = ["layers.0.self_attn.qkv_proj.weight", "layers.1.mlp.down_proj.weight", "norm.weight"]
    params = dict(model.named_parameters())

    class Scoring(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self) -> torch.Tensor:
            return torch.cat(token_scores(self.model, pairs).logprobs)

    scoring = Scoring()

    def logprobs(*tensors: torch.Tensor) -> torch.Tensor:  # the checked parameters as the inputs
        return torch.func.functional_call(scoring, {f"model.{n}": t for n, t in zip(checked, tensors)}, ())

    g = torch.Generator().manual_seed(0)
    inputs = [(params[n].detach() + 0.01 * torch.randn(params[n].shape, generator=g, dtype=torch.float64))
              .requires_grad_(True) for n in checked]
    assert torch.autograd.gradcheck(logprobs, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


def test_differentiable_forward_entropy_matches_its_logits() -> None:
    llm = LLM(model="random:tiny-llama")
    pairs = [([5, 6, 7], [8, 9]), ([1], [2, 3, 4])]
    scores = token_scores(llm.model, pairs, entropy=True)
    assert scores.entropies is not None
    for ent in scores.entropies:
        assert bool((ent > 0).all()) and bool((ent <= torch.log(torch.tensor(320.0)) + 1e-5).all())


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(model=REAL_MODEL)


def test_scorer_values_are_the_rollout_bits_on_smollm2(smollm: LLM) -> None:
    prompts = ["What is 3 + 4?", "Name a colour."]
    ids = [smollm.tokenizer.encode(p) for p in prompts]
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True) for i in range(3)]
    outs = smollm.generate([ids[0], ids[1], ids[0]], params)
    scorer = Scorer(smollm)
    for micro_batch in (1, 3):
        pairs = [(o.prompt_token_ids, o.token_ids) for o in reversed(outs)]
        scored = scorer.score(pairs, micro_batch=micro_batch)
        for lp, o in zip(scored.logprobs, reversed(outs)):
            assert torch.equal(bits(lp), bits(torch.tensor(o.logprobs, dtype=torch.float32)))
            diff = token_scores(smollm.model, [(o.prompt_token_ids, o.token_ids)]).logprobs[0]
            assert torch.allclose(diff.detach(), lp.detach(), atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_gradients_match_transformers(smollm: LLM) -> None:
    transformers = pytest.importorskip("transformers")
    path = resolve_model(REAL_MODEL).path
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = smollm.tokenizer.encode("What is 12 + 5?")
    completion = smollm.tokenizer.encode(" The answer is 17.")
    # ours: the scorer (serving values, the differentiable forward's gradient)
    lp = Scorer(smollm).score([(prompt, completion)]).logprobs[0]
    lp.sum().backward()
    ours = smollm.model.layers[3].mlp.down_proj.weight.grad
    # transformers'
    ids = torch.tensor([prompt + completion[:-1]])
    logits = hf(ids).logits[0, len(prompt) - 1:].float()
    theirs_lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    theirs_lp.sum().backward()
    theirs = hf.model.layers[3].mlp.down_proj.weight.grad
    assert ours is not None and theirs is not None
    assert (ours - theirs).abs().max() <= GRAD_RTOL * theirs.abs().max()
    assert torch.allclose(lp.detach(), theirs_lp.detach(), atol=LOGPROB_ATOL, rtol=0)
