"""A rescore's draws, from the prefill that scores it: the token the request's own sampling draws at every
output position, computed in SGLang's scheduler and handed back to `SglangEngine` beside SGLang's output.

`SglangEngine.rescore_batch` scores prompt + output in one prefill (SGLang's input logprobs, from the last
prompt token on). For a greedy receipt the token drawn at each position is the argmax, rank 1 of SGLang's
input top logprobs; for a sampled one it is the counter-hash draw of the request's seed, temperature, top-k
and top-p over that position's raw logits, which SGLang's input-logprob path never computes. So a rescore
request of a sampled receipt is submitted with the receipt's own sampling (and one new token) under a rid
that starts with `RID_PREFIX`, and `after_forward`, an AFTER hook of `LogitsProcessor.forward` in the
scheduler, draws at every row of that request's prefill that predicts a scored position, as generation's
sampler drew there (`cpu_kernels.sampling_rows`: the same LM head, the same draw at the same position), and
writes the draws to `<report_dir>/draws/`. The engine reads them once SGLang's future resolves (the scheduler
runs the forward before it sends the request's output) and removes them; a position without its draw is an
error, never a pass. Other requests (every served one) pass through untouched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

RID_PREFIX = "detent-rescore-"
TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
_FOLDER = "draws"


class RescoreDraws:
    """The scheduler's hook, writing each rescore request's draws under `report_dir`."""

    def __init__(self, report_dir: str) -> None:
        self.folder = Path(report_dir) / _FOLDER

    def hooks(self) -> dict[str, tuple[str, Any]]:
        """target -> (hook type name, hook)."""
        return {TARGET: ("AFTER", self.after_forward)}

    def after_forward(self, result: Any, processor: Any, input_ids: Any, hidden_states: torch.Tensor,
                      lm_head: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """For each sampled rescore request of an extend batch: the draw at each row from its first scored
        position on (row r holds the token at absolute position p and predicts p + 1; generation drew that
        token at position p). The logits output is returned unchanged."""
        rids = getattr(forward_batch, "rids", None)
        if not rids or not any(r.startswith(RID_PREFIX) for r in rids):
            return result
        if not forward_batch.forward_mode.is_extend() or forward_batch.extend_logprob_start_lens_cpu is None:
            return result
        from detent_audit.integrations.sglang.cpu_kernels import sampling_rows

        info = forward_batch.sampling_info
        meta = None
        row = 0
        lengths, starts = forward_batch.extend_seq_lens_cpu, forward_batch.extend_logprob_start_lens_cpu
        for i, (rid, length, start) in enumerate(zip(rids, lengths, starts, strict=True)):
            first, row = row + start, row + length
            if not rid.startswith(RID_PREFIX) or first >= row:
                continue
            meta = meta or _logits_metadata(forward_batch)
            # logits: [rows, vocab] fp32, through SGLang's LM-head path (the plugin's GEMM hook inside)
            logits = processor._get_logits(hidden_states[first:row], lm_head, meta, use_logits_buffer=False)
            positions = forward_batch.positions[first:row].to(torch.int64)
            tokens = sampling_rows(logits.float(), info, [i] * (row - first), positions)
            self._write(rid, positions.tolist(), tokens.tolist())
        return result

    def _write(self, rid: str, positions: list[int], tokens: list[int]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{rid}.{positions[0]}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"positions": positions, "tokens": tokens}))
        os.replace(partial, path)  # the engine never reads half a file


def _logits_metadata(forward_batch: Any) -> Any:
    """SGLang's `LogitsMetadata` of the batch, as `LogitsProcessor.forward` builds it."""
    from sglang.srt.layers.logits_processor import LogitsMetadata

    return LogitsMetadata.from_forward_batch(forward_batch)


def take_draws(report_dir: str | Path, rid: str) -> dict[int, int]:
    """The draws the scheduler wrote for `rid` (absolute position -> token), removed. Raises RuntimeError for
    a file that is not the hook's."""
    out: dict[int, int] = {}
    for path in sorted((Path(report_dir) / _FOLDER).glob(f"{rid}.*.json")):
        doc = json.loads(path.read_text())
        positions, tokens = doc.get("positions"), doc.get("tokens")
        if not isinstance(positions, list) or not isinstance(tokens, list) or len(positions) != len(tokens):
            raise RuntimeError(f"{path}: not the draws of a rescore request")
        out.update(zip(map(int, positions), map(int, tokens)))
        path.unlink()
    return out
