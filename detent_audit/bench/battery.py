"""The invariance battery (docs/design.md section 8): does a request's output depend on its batch?

A target request (greedy, 16 output tokens) is run alone on a fresh engine: the reference. Each cell runs it
again under other batch conditions and compares the bits of its first 16 output logprobs (fp32) and its
tokens with the reference. 26 cells: 2 rerun the same batch, 14 change the co-batched requests, 4 move the
target's row, 6 change its prefix-cache hit; 9 strong cells: 1, 8 or 32 short, long or mixed neighbours, the
target's row moved and half of the neighbours joining while it decodes.

The target's length and the prefix cells' share unit are parameters: by default a 40-token target and
16-token shares (the embedded engine's KV page); an engine with larger pages (vLLM CPU: 32 tokens) shares in
its own pages (`prefix_block`), and a long target (`target_len`, e.g. 600) crosses the context lengths
where an engine's attention changes how it splits the KV (vLLM CPU: past about 256 context tokens).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from detent_audit.errors import BadInput
from detent_audit.runtime.contract import Engine
from detent_audit.runtime.sampling_params import SamplingParams

NUM_TOKENS = 16
TARGET_LEN = 40        # the target with 16-token pages (the embedded engine)
LONG_TARGET_LEN = 600  # with larger pages: past the context where vLLM CPU's attention splits KV differently


@dataclass(frozen=True)
class CellResult:
    name: str
    group: str
    description: str
    passed: bool
    first_diff: int | None        # first output position whose token or logprob bits differ
    expected_bits: str | None     # at that position, hex of the fp32 logprob (reference)
    got_bits: str | None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Cell:
    name: str
    group: str
    description: str
    run: Callable[[Engine, list[int], random.Random], tuple[list[int], list[float]]]


def _bits(x: float) -> int:
    return torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


def _greedy(n: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]  # byte tokens exist in every shipped tokenizer


def _neighbours(rng: random.Random, k: int, kind: str) -> list[list[int]]:
    lengths = {"short": (4, 24), "long": (120, 300)}
    out = []
    for i in range(k):
        pick = kind if kind != "mixed" else ("short" if i % 2 == 0 else "long")
        out.append(_prompt(rng, rng.randint(*lengths[pick])))
    return out


def _run_batch(llm: Engine, target: list[int], others: list[list[int]], row: int,
               late: Sequence[list[int]] = (), late_after: int = 4) -> tuple[list[int], list[float]]:
    """Submit `others` with the target at `row`; `late` ones join after `late_after` steps."""
    prompts = others[:row] + [target] + others[row:]
    seqs = [llm.add_request(p, _greedy(NUM_TOKENS if p is target else 8)) for p in prompts]
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if steps == late_after:
            seqs += [llm.add_request(p, _greedy(8)) for p in late]
    seq = seqs[row]
    return seq.output_token_ids, list(seq.output_logprobs)


def _alone(llm: Engine, target: list[int], rng: random.Random) -> tuple[list[int], list[float]]:
    return _run_batch(llm, target, [], 0)


def _cobatched(k: int, kind: str) -> Callable:
    return lambda llm, target, rng: _run_batch(llm, target, _neighbours(rng, k, kind), 0)


def _row(row: int) -> Callable:
    return lambda llm, target, rng: _run_batch(llm, target, _neighbours(rng, 7, "mixed"), row)


def prefix_block(llm: Engine) -> int:
    """The prefix cells' share unit for `llm`: its KV page (`block_size`) where it is of 16 tokens or more,
    else 16 (the embedded engine's page; an engine paging by token shares in 16-token units)."""
    return max(16, llm.block_size)


def default_target_len(block: int) -> int:
    return TARGET_LEN if block <= 16 else LONG_TARGET_LEN


def _warm_then(shared: Callable[[list[int]], list[int]], chunk: int | None = None) -> Callable:
    """Finish a request sharing a prefix with the target first (it fills the prefix cache), then the
    target."""
    def run(llm: Engine, target: list[int], rng: random.Random) -> tuple[list[int], list[float]]:
        if chunk is not None:
            llm.reset(max_prefill_chunk=chunk)
        llm.generate([shared(target)], _greedy(4))
        return _run_batch(llm, target, [], 0)
    return run


def _concurrent_prefix(block: int) -> Callable:
    def run(llm: Engine, target: list[int], rng: random.Random) -> tuple[list[int], list[float]]:
        twin = target[:2 * block] + _prompt(rng, 20)  # shares two blocks, submitted in the same batch, first
        return _run_batch(llm, target, [twin], 1)
    return run


def _rerun_batch(llm: Engine, target: list[int], rng: random.Random) -> tuple[list[int], list[float]]:
    others = _neighbours(rng, 3, "mixed")
    first = _run_batch(llm, target, others, 1)
    llm.reset()
    second = _run_batch(llm, target, others, 1)
    if first != second:
        return second[0], [float("nan")] * len(second[1])  # the same batch twice must agree with itself
    return second


def _strong(k: int, kind: str, seed: int) -> Callable:
    def run(llm: Engine, target: list[int], rng: random.Random) -> tuple[list[int], list[float]]:
        others = _neighbours(rng, k, kind)
        row = random.Random(seed).randint(0, len(others) // 2)
        early, late = others[: (k + 1) // 2], others[(k + 1) // 2:]
        return _run_batch(llm, target, early, min(row, len(early)), late=late)
    return run


def cells(block: int = 16) -> list[Cell]:
    """The 35 cells; the prefix cells share whole `block`-token pages of the target (16: the embedded
    engine's)."""
    b = block
    out = [Cell("rerun-alone", "rerun", "the target alone again", _alone),
           Cell("rerun-batch", "rerun", "the same 4-request batch twice", _rerun_batch)]
    for kind in ("short", "long"):
        for k in (1, 2, 3, 5, 7, 11, 15):
            out.append(Cell(f"co-{kind}-{k}", "co-batched", f"{k} {kind} neighbours", _cobatched(k, kind)))
    for row in (1, 3, 5, 7):
        out.append(Cell(f"row-{row}", "row", f"target at row {row} of 8", _row(row)))
    out += [
        Cell("prefix-full", "prefix", "the same prompt cached first (all full blocks hit)",
             _warm_then(lambda t: t)),
        Cell("prefix-1-block", "prefix", f"a prompt sharing {b} tokens cached first",
             _warm_then(lambda t: t[:b] + [7] * 9)),
        Cell("prefix-2-blocks", "prefix", f"a prompt sharing {2 * b} tokens cached first",
             _warm_then(lambda t: t[:2 * b] + [9] * 5)),
        Cell("prefix-partial", "prefix", f"a prompt sharing {b - 1} tokens cached first (no whole block)",
             _warm_then(lambda t: t[:b - 1] + [11] * 12)),
        Cell("prefix-concurrent", "prefix", f"a prompt sharing {2 * b} tokens in the same batch",
             _concurrent_prefix(b)),
        Cell("prefix-chunked", "prefix", "1-block hit, then the rest prefilled in chunks of 7 tokens",
             _warm_then(lambda t: t[:b] + [5] * 3, chunk=7)),
    ]
    for k in (1, 8, 32):
        for kind in ("short", "long", "mixed"):
            out.append(Cell(f"strong-{kind}-{k}", "strong",
                            f"{k} {kind} neighbours, row moved, half join late", _strong(k, kind, seed=k)))
    return out


def run_battery(llm: Engine, seed: int = 0, progress: Callable[[str], None] | None = None, *,
                target_len: int | None = None, block: int = 16) -> list[CellResult]:
    """Run all 35 cells on `llm` (reset between cells); the target is a seeded random prompt of `target_len`
    tokens (default: `TARGET_LEN` with 16-token blocks, `LONG_TARGET_LEN` with larger ones), the prefix cells
    share `block`-token pages of it."""
    target_len = default_target_len(block) if target_len is None else target_len
    if block < 2 or target_len < 2 * block + 1:
        raise BadInput(f"the battery's target of {target_len} tokens must be longer than two {block}-token "
                       "blocks",
                       remedy=f"use a target of at least {2 * block + 1} tokens, or a smaller block")
    rng = random.Random(seed)
    target = _prompt(rng, target_len)
    llm.reset()
    ref_tokens, ref_lps = _alone(llm, target, rng)
    results = []
    for i, cell in enumerate(cells(block)):
        llm.reset()
        tokens, lps = cell.run(llm, target, random.Random(seed * 1000 + i))
        llm.reset()
        diff = next((j for j in range(NUM_TOKENS) if j >= len(tokens) or tokens[j] != ref_tokens[j]
                     or _bits(lps[j]) != _bits(ref_lps[j])), None)
        got = lps[diff] if diff is not None and diff < len(lps) else None
        results.append(CellResult(cell.name, cell.group, cell.description, diff is None, diff,
                                  None if diff is None else f"{_bits(ref_lps[diff]):08x}",
                                  None if got is None else f"{_bits(got):08x}"))
        if progress:
            progress(cell.name)
    return results
