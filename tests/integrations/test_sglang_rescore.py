"""A rescore's draws in SGLang's scheduler (`integrations/sglang/rescore.py`), on a stand-in of the batch
SGLang hands `LogitsProcessor.forward`: for a sampled rescore request, the counter-hash draw of its own
sampling at every row it scores, at that row's absolute position, written for the engine and taken once;
other requests (served ones, greedy rescores) get nothing, and the logits output is returned as it came."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from detent_audit.integrations.sglang import rescore
from detent_audit.kernels.sampling import sample


class _Processor:
    """SGLang's LM-head path: hidden rows -> fp32 logits."""

    def _get_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, meta: object,
                    use_logits_buffer: bool = True) -> torch.Tensor:
        return hidden @ lm_head.T


def test_rescore_draws_are_the_draws_of_each_request_at_each_scored_row(tmp_path, monkeypatch) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    torch.manual_seed(seed)
    vocab, width = 97, 12
    lm_head = torch.randn(vocab, width)
    # three requests in one extend: a served one, a sampled rescore, a greedy rescore (no prefix: no draws)
    rids = ["f3a9c0", f"{rescore.RID_PREFIX}{rng.randrange(100)}", "detent-7"]
    lengths = [rng.randint(3, 9) for _ in rids]
    starts = [lengths[0] - 1, rng.randint(0, lengths[1] - 1), 1]
    prefixes = [rng.randint(0, 20) for _ in rids]  # cached tokens before this extend
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, lengths, strict=True)])
    hidden = torch.randn(sum(lengths), width)
    info = SimpleNamespace(temperatures=torch.tensor([[0.7], [0.9], [1.0]]),
                           top_ks=torch.tensor([1 << 30, 40, 1]), top_ps=torch.tensor([1.0, 0.95, 1.0]),
                           sampling_seed=torch.tensor([rng.randrange(1 << 62) for _ in rids]),
                           is_all_greedy=False)
    batch = SimpleNamespace(rids=rids, forward_mode=SimpleNamespace(is_extend=lambda: True),
                            extend_seq_lens_cpu=lengths, extend_logprob_start_lens_cpu=starts,
                            positions=positions, sampling_info=info)
    monkeypatch.setattr(rescore, "_logits_metadata", lambda forward_batch: None)
    output = object()
    assert rescore.RescoreDraws(str(tmp_path)).after_forward(output, _Processor(), None, hidden, lm_head,
                                                             batch) is output
    first, stop = lengths[0] + starts[1], lengths[0] + lengths[1]
    rows = stop - first
    expected = sample(hidden[first:stop] @ lm_head.T, torch.full((rows,), 0.9), torch.full((rows,), 40),
                      torch.full((rows,), 0.95), info.sampling_seed[1].repeat(rows), positions[first:stop])
    draws = rescore.take_draws(tmp_path, rids[1])
    assert draws == dict(zip(positions[first:stop].tolist(), expected.tolist(), strict=True)), seed
    assert rescore.take_draws(tmp_path, rids[1]) == {}  # taken once
    assert not list((tmp_path / "draws").iterdir())  # nothing for the served request or the greedy one
