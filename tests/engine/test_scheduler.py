"""Scheduler: continuous batching, chunked prefill, prefix hits and preemption, driven by a fake model that
computes through the paged cache, so any wrongly served block changes the tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from functools import reduce

import pytest

from detent_audit.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from detent_audit.engine.sequence import Sequence, SequenceStatus
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams

VOCAB = 40
EOS = 0
ROOT = 0x5EED


def mix(a: int, b: int) -> int:
    return hash((a, b)) & 0xFFFF_FFFF_FFFF  # tuples of ints hash the same in every process


def sample(kv_values: SequenceOf[int], seed: int) -> tuple[int, float]:
    """The fake model's next token and its 'logprob', from every KV entry of the sequence so far."""
    value = reduce(mix, kv_values, seed)
    return value % VOCAB, -float(value % 1000) / 7


class FakeModel:
    """Computes through the paged cache: position p's KV is mix(KV of p - 1 read from the cache, token p); the
    token sampled after position p mixes every KV entry [0, p] read through the block table."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.blocks = scheduler.block_manager
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, chained value)

    def step(self, output: SchedulerOutput) -> tuple[dict[int, int | None], dict[int, float]]:
        size = self.blocks.block_size
        cached = self.blocks.cached_blocks()
        tokens: dict[int, int | None] = {}
        logprobs: dict[int, float] = {}
        for entry in output.scheduled:
            seq = entry.seq
            slots = self.blocks.slot_mapping(seq, 0, entry.end_pos)
            value = self.kv[slots[entry.start_pos - 1]][1] if entry.start_pos else ROOT
            for pos in range(entry.start_pos, entry.end_pos):
                assert slots[pos] // size not in cached, "a cached block was written"
                value = mix(value, seq.token_ids[pos])
                self.kv[slots[pos]] = (seq.token_ids[pos], value)
            tokens[seq.seq_id] = None
            if entry.samples_token:
                token, logprob = sample([self.kv[s][1] for s in slots], seq.sampling_params.seed)
                tokens[seq.seq_id], logprobs[seq.seq_id] = token, logprob
        return tokens, logprobs


def finish_reason(tokens: list[int], params: SamplingParams, num_prompt: int,
                  max_model_len: int) -> str | None:
    if tokens[-1] in params.stop_token_ids or (not params.ignore_eos and tokens[-1] == EOS):
        return "stop"
    if len(tokens) - num_prompt >= params.max_tokens or len(tokens) >= max_model_len:
        return "length"
    return None


def generate_alone(prompt: list[int], params: SamplingParams,
                   max_model_len: int) -> tuple[list[int], str, list[float]]:
    """The request served on its own, without a cache: output tokens, finish reason, logprobs."""
    tokens, values, logprobs = list(prompt), [], []
    value = ROOT
    while True:
        for token in tokens[len(values):]:
            value = mix(value, token)
            values.append(value)
        token, logprob = sample(values, params.seed)
        tokens.append(token)
        logprobs.append(logprob)
        reason = finish_reason(tokens, params, len(prompt), max_model_len)
        if reason is not None:
            return tokens[len(prompt):], reason, logprobs


@dataclass
class RunStats:
    steps: int = 0
    preemptions: int = 0
    chunked: int = 0  # prefill chunks that did not reach the end of their tokens
    hit_tokens: int = 0
    evictions: int = 0
    rejected: int = 0


def check_step(
    sched: Scheduler, out: SchedulerOutput, before: dict[int, tuple[SequenceStatus, int]], waiting: list[int]
) -> None:
    """Every property of one schedule() output, against the state just before it (`before`: status and
    uncomputed tokens by seq_id; `waiting`: the waiting queue's seq_ids)."""
    cfg = sched.config
    size = cfg.block_size
    assert out.scheduled, "unfinished sequences but nothing scheduled"
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({e.seq.seq_id for e in out.scheduled}) == len(out.scheduled)
    phases = []
    for entry in out.scheduled:
        seq = entry.seq
        status, uncomputed = before[seq.seq_id]
        assert 1 <= entry.num_new_tokens <= cfg.chunk_size
        assert entry.start_pos == seq.num_computed_tokens and entry.end_pos <= seq.num_tokens
        assert entry.samples_token == (entry.end_pos == seq.num_tokens)
        if status is SequenceStatus.RUNNING:
            phases.append((0 if uncomputed == 1 else 1, seq.arrival))
        else:  # admitted now: the hit is whole blocks and never covers the last token
            assert status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert entry.start_pos == seq.num_cached_tokens <= seq.num_tokens - 1
            assert seq.num_cached_tokens % size == 0
            phases.append((2, len(phases)))
        assert seq.status is SequenceStatus.RUNNING
    assert phases == sorted(phases), "order: decodes, then continuing prefills, then admissions"
    admitted = [e.seq.seq_id for e, (phase, _) in zip(out.scheduled, phases, strict=True) if phase == 2]
    assert admitted == waiting[: len(admitted)], "admissions are first come, first served"
    scheduled_ids = {e.seq.seq_id for e in out.scheduled}
    for seq in sched.running:  # the budget covers every decode: none waits while running
        assert before[seq.seq_id][1] != 1 or seq.seq_id in scheduled_ids
    if out.preempted:
        assert all(phase < 2 for phase, _ in phases), "admitted in a step that preempted"
        assert min(s.arrival for s in out.preempted) > max((s.arrival for s in sched.running), default=-1)
        assert list(sched.waiting)[: len(out.preempted)] == sorted(out.preempted, key=lambda s: s.arrival)
    for seq in out.preempted:
        assert seq.status is SequenceStatus.PREEMPTED
        assert seq.num_computed_tokens == 0 and seq.block_table == []


def run(cfg: SchedulerConfig, requests: list[tuple[int, Sequence]], stats: RunStats,
        abort: random.Random | None = None) -> None:
    """Serve (arrival step, sequence) pairs, checking every step; then compare each with its solo run. With
    `abort`, a live sequence (running, waiting or preempted) is aborted before one step in four: the others
    must not notice."""
    sched, pending = Scheduler(cfg), sorted(requests, key=lambda r: (r[0], r[1].seq_id))
    model = FakeModel(sched)
    accepted: list[Sequence] = []
    aborted: set[int] = set()
    while pending or sched.has_unfinished():
        live = [*sched.running, *sched.waiting]
        if abort is not None and live and abort.random() < 0.25:
            victim = abort.choice(live)
            sched.abort(victim)
            aborted.add(victim.seq_id)
            sched.block_manager.check_integrity()
        while pending and pending[0][0] <= stats.steps:
            seq = pending.pop(0)[1]
            longest = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, cfg.max_model_len)
            blocks_needed = -(-(longest - 1) // cfg.block_size)
            if seq.num_prompt_tokens >= cfg.max_model_len or blocks_needed > cfg.num_blocks:
                with pytest.raises(BadInput, match=f"request {seq.request_id}: "):
                    sched.add(seq)
                stats.rejected += 1
            else:
                sched.add(seq)
                accepted.append(seq)
        stats.steps += 1
        if not sched.has_unfinished():
            continue
        before = {s.seq_id: (s.status, s.num_uncomputed_tokens) for s in [*sched.running, *sched.waiting]}
        waiting = [s.seq_id for s in sched.waiting]
        out = sched.schedule()
        check_step(sched, out, before, waiting)
        tokens, logprobs = model.step(out)
        stats.chunked += sum(not e.samples_token for e in out.scheduled)
        finished = sched.update(out, tokens, logprobs)
        assert all(s.is_finished and s.block_table == [] for s in finished)
        sched.block_manager.check_integrity()
        for block_id, block_tokens in sched.block_manager.cached_blocks().items():
            slots = range(block_id * cfg.block_size, (block_id + 1) * cfg.block_size)
            assert tuple(model.kv[s][0] for s in slots) == block_tokens
        assert stats.steps < 5000, "no progress"
    for seq in accepted:
        if seq.seq_id in aborted:
            assert seq.finish_reason is None and seq.block_table == []
            continue
        outputs, reason, logprobs = generate_alone(list(seq.prompt_token_ids), seq.sampling_params,
                                                   cfg.max_model_len)
        assert (seq.output_token_ids, seq.finish_reason) == (outputs, reason), f"seq {seq.seq_id}"
        assert seq.output_logprobs == logprobs
        stats.preemptions += seq.num_preemptions
    block_stats = sched.block_manager.stats
    assert block_stats.num_used_blocks == 0
    stats.hit_tokens += block_stats.prefix_hit_tokens
    stats.evictions += block_stats.num_evictions


def random_requests(rng: random.Random, num: int, block_size: int,
                    max_arrival: int) -> list[tuple[int, Sequence]]:
    """Prompts built from a few shared prefixes (some repeated whole), random sampling params and stops."""
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(block_size, 3 * block_size))]
                for _ in range(3)]
    requests, prompts = [], []
    for seq_id in range(num):
        kind = rng.random()
        if kind < 0.15 and prompts:
            prompt = list(rng.choice(prompts))
        elif kind < 0.75:
            prefix = rng.choice(prefixes)
            prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 2 * block_size))]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8 * block_size))]
        prompts.append(prompt)
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7]),
            seed=rng.randrange(2**64),
            max_tokens=rng.randint(1, 24),
            stop_token_ids=tuple(rng.sample(range(1, VOCAB), rng.randint(0, 2))),
            ignore_eos=rng.random() < 0.2,
        )
        requests.append((rng.randint(0, max_arrival), Sequence(seq_id, prompt, params)))
    return requests


SCENARIOS = {
    # blocks to spare: arrivals spread out, so later prompts hit earlier ones' prefixes
    "roomy": dict(num_blocks=256, block_size=4, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32),
    # a pool a few sequences fill: decodes run out of blocks, preempt and evict
    "tight": dict(num_blocks=14, block_size=4, max_model_len=96, max_num_seqs=6, max_num_batched_tokens=24),
    # small budget and chunks: long prompts prefill over many steps; short max_model_len rejects some prompts
    "chunky": dict(
        num_blocks=40, block_size=2, max_model_len=12, max_num_seqs=4, max_num_batched_tokens=6,
        max_prefill_chunk=3,
    ),
    "block_size_1": dict(
        num_blocks=30, block_size=1, max_model_len=64, max_num_seqs=3, max_num_batched_tokens=8
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_random_runs_match_solo_runs(name: str) -> None:
    cfg = SchedulerConfig(eos_token_ids=(EOS,), **SCENARIOS[name])
    stats = RunStats()
    for seed in range(12):
        rng = random.Random(f"{name}-{seed}")
        run(cfg, random_requests(rng, num=32, block_size=cfg.block_size, max_arrival=50), stats)
    assert stats.hit_tokens > 0
    if name == "tight":
        assert stats.preemptions > 0 and stats.evictions > 0
    if name == "chunky":
        assert stats.chunked > 0 and stats.rejected > 0


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_random_runs_with_aborts_match_solo_runs(name: str) -> None:
    """Clients leaving at random (abort between steps, in any state): every other request's tokens, logprobs
    and finish equal its solo run, the cached blocks hold what they claim, and every block comes back."""
    cfg = SchedulerConfig(eos_token_ids=(EOS,), **SCENARIOS[name])
    stats = RunStats()
    for seed in range(12):
        rng = random.Random(f"abort-{name}-{seed}")
        run(cfg, random_requests(rng, num=32, block_size=cfg.block_size, max_arrival=50), stats,
            abort=random.Random(seed))
    assert stats.hit_tokens > 0


def scripted_step(sched: Scheduler, tokens: dict[int, int]) -> SchedulerOutput:
    """Schedule, then sample `tokens[seq_id]` for every sequence whose chunk samples."""
    out = sched.schedule()
    sched.update(out, {e.seq.seq_id: tokens[e.seq.seq_id] if e.samples_token else None
                       for e in out.scheduled})
    sched.block_manager.check_integrity()
    return out


def layout(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(e.seq.seq_id, e.start_pos, e.num_new_tokens) for e in out.scheduled]


def test_chunked_prefill_then_decodes_first() -> None:
    rng = random.Random(10)
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    a = Sequence(0, [rng.randrange(1, VOCAB) for _ in range(20)], SamplingParams(max_tokens=4))
    sched.add(a)
    steps = [layout(scripted_step(sched, {0: 5})) for _ in range(3)]
    assert steps == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 4)]]
    b = Sequence(1, [rng.randrange(1, VOCAB) for _ in range(11)], SamplingParams(max_tokens=4))
    sched.add(b)  # joins while a decodes: a's decode comes first, b gets the rest of the budget
    assert layout(scripted_step(sched, {0: 5, 1: 6})) == [(0, 20, 1), (1, 0, 7)]
    assert layout(scripted_step(sched, {0: 5, 1: 6})) == [(0, 21, 1), (1, 7, 4)]
    assert layout(scripted_step(sched, {0: 5, 1: 6})) == [(0, 22, 1), (1, 11, 1)]
    assert a.is_finished and a.finish_reason == "length" and a.output_token_ids == [5] * 4


def test_prefix_hit_skips_cached_blocks_but_not_the_last_token() -> None:
    rng = random.Random(11)
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    prompt = [rng.randrange(1, VOCAB) for _ in range(12)]
    sched.add(Sequence(0, prompt + [1, 2], SamplingParams(max_tokens=1)))
    scripted_step(sched, {0: 3})
    b = Sequence(1, prompt + [7], SamplingParams(max_tokens=1))
    c = Sequence(2, prompt, SamplingParams(max_tokens=1))  # all 3 blocks cached, the last token recomputed
    sched.add(b)
    sched.add(c)
    assert layout(scripted_step(sched, {1: 3, 2: 3})) == [(1, 12, 1), (2, 8, 4)]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 8)
    assert sched.block_manager.stats.prefix_hit_tokens == 20


def test_preemption_recomputes_prompt_and_outputs() -> None:
    rng = random.Random(12)
    cfg = SchedulerConfig(num_blocks=4, block_size=4, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    old = Sequence(0, [rng.randrange(1, VOCAB) for _ in range(7)], SamplingParams(max_tokens=5))  # 3 blocks
    new = Sequence(1, [rng.randrange(1, VOCAB) for _ in range(7)], SamplingParams(max_tokens=8))
    sched.add(old)
    sched.add(new)
    assert layout(scripted_step(sched, {0: 3, 1: 4})) == [(0, 0, 7), (1, 0, 7)]  # 2 blocks each: pool full
    assert layout(scripted_step(sched, {0: 3, 1: 4})) == [(0, 7, 1), (1, 7, 1)]
    # both need a third block: the newest is preempted, keeping its 2 outputs, and waits at the front
    out = scripted_step(sched, {0: 3})
    assert layout(out) == [(0, 8, 1)] and out.preempted == (new,)
    assert new.status is SequenceStatus.PREEMPTED and new.output_token_ids == [4, 4]
    assert new.num_computed_tokens == 0 and list(sched.waiting) == [new]
    while not old.is_finished:
        scripted_step(sched, {0: 3})
    # old took 1 of new's 2 cached blocks (the tail); readmitted, new hits the head, prefills the rest of
    # prompt + outputs and samples its third token
    out = scripted_step(sched, {1: 9})
    assert layout(out) == [(1, 4, 5)] and new.num_cached_tokens == 4
    assert new.output_token_ids == [4, 4, 9] and new.num_preemptions == 1


def test_finish_reasons() -> None:
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=12, max_num_seqs=4, eos_token_ids=(EOS,))
    cases = [
        (SamplingParams(max_tokens=5), [3, EOS], "stop"),
        (SamplingParams(max_tokens=5, ignore_eos=True), [EOS] * 5, "length"),
        (SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(7,)), [EOS, 7], "stop"),
        (SamplingParams(max_tokens=2), [3, EOS], "stop"),  # stop wins over length on the last token
        (SamplingParams(max_tokens=50), [3] * 6, "length"),  # 6 prompt + 6 = max_model_len
    ]
    for params, script, reason in cases:
        sched = Scheduler(cfg)
        seq = Sequence(0, [1, 2, 3, 4, 5, 6], params)
        sched.add(seq)
        for token in script:
            scripted_step(sched, {0: token})
        assert (seq.output_token_ids, seq.finish_reason, sched.has_unfinished()) == (script, reason, False)


def test_add_rejects_requests_that_can_never_run() -> None:
    cfg = SchedulerConfig(num_blocks=4, block_size=4, max_model_len=32, max_num_seqs=4)
    sched = Scheduler(cfg)
    with pytest.raises(BadInput, match="request 0: prompt of 32 tokens leaves no room for output within "
                                       "max_model_len 32"):
        sched.add(Sequence(0, [1] * 32, SamplingParams()))
    with pytest.raises(
        BadInput, match="request r9: 10 prompt tokens \\+ max_tokens 10 need up to 5 KV blocks of 4 tokens, "
                        "but the cache has 4"
    ):
        sched.add(Sequence(9, [1] * 10, SamplingParams(max_tokens=10), request_id="r9"))
    seq = Sequence(1, [1] * 10, SamplingParams(max_tokens=7))  # 16 tokens at most: its KV needs 15 slots
    sched.add(seq)
    with pytest.raises(ValueError, match="seq 1: only a new sequence can be added"):
        sched.add(seq)
    with pytest.raises(ValueError, match="seq 1: a live sequence already has this id"):
        sched.add(Sequence(1, [1], SamplingParams()))


def test_update_rejects_outputs_that_do_not_match_the_schedule() -> None:
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=4,
                          max_num_seqs=4)
    sched = Scheduler(cfg)
    sched.add(Sequence(0, [1] * 6, SamplingParams()))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="schedule\\(\\) called again before update\\(\\)"):
        sched.schedule()
    with pytest.raises(ValueError, match="sampled_tokens has keys \\[\\], expected \\[0\\]"):
        sched.update(out, {})
    with pytest.raises(ValueError, match="seq 0: chunk \\[0, 4\\) of 6 tokens samples no token, got 3"):
        sched.update(out, {0: 3})
    with pytest.raises(ValueError, match="logprobs has keys \\[0\\], expected the sampling seqs \\[\\]"):
        sched.update(out, {0: None}, {0: -1.0})
    sched.update(out, {0: None})
    with pytest.raises(RuntimeError, match="must receive the output of the oldest schedule\\(\\)"):
        sched.update(out, {0: None})
    out = sched.schedule()
    with pytest.raises(ValueError, match="seq 0: chunk \\[4, 6\\) of 6 tokens samples a token, got None"):
        sched.update(out, {0: None})
    with pytest.raises(BadInput, match="sampled tokens must be token ids in \\[0, 2\\*\\*32 - 1\\], got -1"):
        sched.update(out, {0: -1})
    sched.update(out, {0: 2})
    assert sched.running[0].output_token_ids == [2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0 \\(0 = greedy\\), got -0.5"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_k=-1), "top_k must be an integer >= 0 \\(0 = off\\), got -1"),
        (dict(top_p=0.0), "top_p must be a number in \\(0, 1\\], got 0.0"),
        (dict(top_p=1.5), "top_p must be a number in \\(0, 1\\], got 1.5"),
        (dict(top_p=1e-46), "top_p 1e-46 is 0 in float32"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
        (dict(seed=-1), "seed must be an integer in \\[0, 2\\*\\*64 - 1\\], got -1"),
        (dict(seed=2**64), "seed must be an integer in \\[0, 2\\*\\*64 - 1\\]"),
        (dict(seed=None), "seed must be an integer in \\[0, 2\\*\\*64 - 1\\], got None"),
        (dict(stop_token_ids=5), "stop_token_ids must be a tuple of token ids, got int"),
        (dict(stop_token_ids=(1, -2)), "stop_token_ids must be token ids in \\[0, 2\\*\\*32 - 1\\], got -2"),
        (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
        (dict(logprobs=21), "logprobs must be None or an integer in \\[0, 20\\], got 21"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation() -> None:
    params = SamplingParams(temperature=0, stop_token_ids=[3, 1])  # type: ignore[arg-type]
    assert params.is_greedy and params.seed == 0 and params.stop_token_ids == (3, 1)
    assert hash(params) == hash(SamplingParams(temperature=0, stop_token_ids=(3, 1)))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Sequence(0, [], SamplingParams(), request_id="r0"), "request r0: the prompt is empty"),
        (lambda: Sequence(0, [1, -1], SamplingParams()), "prompt_token_ids must be token ids .*got -1"),
        (lambda: Sequence(-1, [1], SamplingParams()), "seq_id must be an integer >= 0, got -1"),
        (lambda: SchedulerConfig(num_blocks=0, block_size=4, max_model_len=8),
         "num_blocks must be an integer >= 1"),
        (
            lambda: SchedulerConfig(num_blocks=4, block_size=4, max_model_len=8, max_num_batched_tokens=4),
            "max_num_batched_tokens \\(4\\) must be >= max_num_seqs \\(256\\)",
        ),
        (
            lambda: SchedulerConfig(num_blocks=4, block_size=4, max_model_len=8, max_prefill_chunk=0),
            "max_prefill_chunk must be None or an integer >= 1, got 0",
        ),
        (lambda: SchedulerConfig(num_blocks=4, block_size=4, max_model_len=1), "max_model_len must be >= 2"),
    ],
)
def test_construction_errors_name_the_bad_value(build, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        build()


def test_abort_frees_a_running_and_drops_a_waiting_sequence() -> None:
    """abort() between steps: a running sequence's blocks are freed (a full block stays cached), a waiting one
    leaves the queue, neither is ever returned as finished, the others go on; abort mid-step is refused."""
    rng = random.Random(13)
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=2,
                          max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    a, b, c = (Sequence(i, [rng.randrange(1, VOCAB) for _ in range(9)], SamplingParams(max_tokens=5))
               for i in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    scripted_step(sched, {0: 5, 1: 6})  # a and b run (max_num_seqs 2); c waits
    used = sched.block_manager.stats.num_used_blocks
    sched.abort(a)
    sched.abort(c)
    assert sched.block_manager.stats.num_used_blocks == used - 3 and a.status is SequenceStatus.FINISHED
    assert a.finish_reason is None and c not in sched.waiting and a not in sched.running
    sched.block_manager.check_integrity()
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        finished += sched.update(out, {e.seq.seq_id: 6 if e.samples_token else None for e in out.scheduled})
    assert finished == [b] and b.output_token_ids == [6] * 5
    with pytest.raises(ValueError, match="not live"):
        sched.abort(a)
    d = Sequence(3, [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add(d)
    sched.schedule()
    with pytest.raises(RuntimeError, match="between schedule"):
        sched.abort(d)
