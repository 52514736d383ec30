"""The decode step's device-resident inputs (`cuda_graphs.DecodeRows`), driven by the real scheduler on the
CPU: after every placement each row holds exactly what a step laid out from scratch would (its token, its
position, its block table padded with the scratch block), and every row past the batch is padding, through
admissions, finishes, preemptions and eager steps in between. And the engine's replay path (rows placed,
slots computed from them, tokens advanced on the device) with the graph taken out gives the eager bits."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from detent_audit.engine.cuda_graphs import Captured, DecodeGraphs, DecodeRows, capture_sizes, slots_of
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.scheduler import Scheduler, SchedulerConfig
from detent_audit.engine.sequence import Sequence
from detent_audit.kernels import AttentionMetadata
from detent_audit.runtime.sampling_params import SamplingParams

SCRATCH = 999


def expected_rows(order: list[Sequence], positions: dict[int, int], num_rows: int, max_blocks: int):
    ids = torch.zeros(num_rows, dtype=torch.int64)
    pos = torch.zeros(num_rows, dtype=torch.int64)
    tables = torch.full((num_rows, max_blocks), SCRATCH, dtype=torch.int64)
    for r, seq in enumerate(order):
        p = positions[seq.seq_id]
        ids[r], pos[r] = seq.token_ids[p], p
        tables[r, :len(seq.block_table)] = torch.tensor(seq.block_table)
    return ids, pos, tables


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_hold_each_step_as_laid_out_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    block_size, max_len, num_rows = 4, 64, 16
    max_blocks = -(-max_len // block_size)
    # few blocks: decodes that cross a block boundary preempt the youngest sequence
    sched = Scheduler(SchedulerConfig(num_blocks=60, block_size=block_size, max_model_len=max_len,
                                      max_num_seqs=num_rows, max_num_batched_tokens=64, max_prefill_chunk=24))
    rows = DecodeRows(num_rows, max_blocks, SCRATCH, "cpu")
    next_id = 0
    placed = preempted = eager_decodes = 0
    for _ in range(400):
        if rng.random() < 0.15:  # arrivals at random times: admissions turn the next steps into mixed ones
            for _ in range(rng.randint(1, 4)):
                prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
                sched.add(Sequence(next_id, prompt, SamplingParams(max_tokens=rng.randint(1, 30),
                                                                   ignore_eos=True)))
                next_id += 1
        out = sched.schedule()
        preempted += len(out.preempted)
        if not out.scheduled:
            sched.update(out, {})
            continue
        entries = out.scheduled
        decode_only = all(e.num_new_tokens == 1 and e.samples_token for e in entries)
        tokens = {e.seq.seq_id: rng.randrange(1000) if e.samples_token else None for e in entries}
        if decode_only and rng.random() < 0.8:  # the rest run eagerly, as a replay that was not possible
            positions = {e.seq.seq_id: e.start_pos for e in entries}
            order = rows.place([e.seq for e in entries], [e.start_pos for e in entries])
            assert sorted(s.seq_id for s in order) == sorted(positions)
            for got, want in zip((rows.ids, rows.positions, rows.tables),
                                 expected_rows(order, positions, num_rows, max_blocks)):
                assert torch.equal(got, want)
            placed += 1
            rows.advance(torch.tensor([tokens[s.seq_id] for s in order], dtype=torch.int64))
        elif decode_only:
            eager_decodes += 1
        sched.update(out, tokens)
        sched.block_manager.check_integrity()
    assert placed > 50 and preempted > 0 and eager_decodes > 0  # the walk met what it is here to meet


def test_advance_takes_one_token_per_placed_row() -> None:
    rows = DecodeRows(4, 2, SCRATCH, "cpu")
    seq = Sequence(0, [5, 6], SamplingParams())
    seq.block_table = [3]
    rows.place([seq], [1])
    with pytest.raises(ValueError, match="one token per placed row"):
        rows.advance(torch.tensor([1, 2]))


def test_capture_sizes_pad_little_up_to_the_largest() -> None:
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(40)[-2:] == (32, 40) and capture_sizes(41)[-2:] == (40, 41)
    for limit in (1, 7, 32, 100, 256):
        sizes = capture_sizes(limit)
        # every batch up to the limit pads to a size at most 7 rows (and at most 2x) past it
        assert all(0 <= min(s for s in sizes if s >= b) - b <= min(7, b) for b in range(1, limit + 1))


class RowsReplayedEagerly(DecodeGraphs):
    """The replay path with the CUDA graph taken out: a size's 'replay' runs the decode step of the rows in
    use eagerly, through the engine's CPU kernels, into that size's logits."""

    def _capture(self, b: int):
        rows = self.rows
        logits = torch.empty(b, self.model.config.vocab_size)
        slots = torch.empty(b, dtype=torch.int64)

        def replay() -> None:
            ids, pos, tables = rows.ids[:b], rows.positions[:b], rows.tables[:b]
            meta = AttentionMetadata(cu_seqlens_q=torch.arange(b + 1), context_lens=pos, seq_lens=pos + 1,
                                     block_tables=tables, slot_mapping=slots_of(tables, pos, self.block_size,
                                                                                slots),
                                     max_seqlen_q=1, max_seqlen_k=int(pos.max()) + 1)
            hidden = self.model(ids, pos, meta, self.kv_caches, self.kernels)
            logits.copy_(self.model.compute_logits(hidden, self.kernels))

        return Captured(replay, logits, lambda: logits)


def test_the_replay_path_gives_the_eager_bits() -> None:
    seed = int(torch.randint(0, 1 << 20, ()))
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(2, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=0.7 if i % 3 else 0.0, seed=rng.randrange(1 << 30),
                             logprobs=2 if i % 4 == 1 else None, max_tokens=rng.randint(1, 24),
                             ignore_eos=True) for i in range(12)]
    config = EngineConfig(model="random:tiny-llama", max_num_seqs=8, max_num_batched_tokens=48, block_size=4,
                          num_kv_blocks=40, max_model_len=96)
    eager = LLM(config).generate(prompts, params)
    llm = LLM(config)
    blocks = config.num_kv_blocks  # the last one is the padding rows' scratch block, as on a GPU
    llm._scheduler_config = dataclasses.replace(llm._scheduler_config, num_blocks=blocks - 1)
    llm.reset()
    llm.runner.graphs = RowsReplayedEagerly(llm.model, llm.selection.kernels, llm.runner.kv_caches, 4,
                                            llm.max_model_len, blocks - 1, "cpu", max_size=8)
    graphs = llm.runner.graphs
    for n in (12, 5, 12):  # a reset between runs: the rows forget every request, the graphs stay
        replayed = llm.generate(prompts[:n], params[:n])
        for a, b in zip(replayed, eager):
            assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs), \
                seed
        llm.reset()
        assert graphs.rows.num_rows_used == 0 and llm.runner.graphs is graphs
    assert len(graphs.graphs) >= 3  # decode batches of several sizes replayed


def test_clear_leaves_every_row_padding_in_the_same_buffers() -> None:
    rows = DecodeRows(4, 3, SCRATCH, "cpu")
    buffers = (rows.ids, rows.positions, rows.tables)
    seqs = [Sequence(i, [5, 6, 7], SamplingParams()) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i, 10 + i]
    rows.place(seqs, [2, 2, 2])
    rows.clear()
    assert all(a is b for a, b in zip(buffers, (rows.ids, rows.positions, rows.tables)))
    assert not rows.ids.any() and not rows.positions.any() and bool((rows.tables == SCRATCH).all())
    # the same sequence placed again after clear() is written whole, as a new one
    order = rows.place(seqs[2:], [1])
    ids, pos, tables = expected_rows(order, {2: 1}, 4, 3)
    assert torch.equal(rows.ids, ids) and torch.equal(rows.positions, pos)
    assert torch.equal(rows.tables, tables)


def replaying_engine(config: EngineConfig, **kw) -> LLM:
    """An engine whose decode-only steps go the replay path (rows, slots on the device, steps queued ahead)
    with the graph taken out."""
    llm = LLM(dataclasses.replace(config, **kw))
    blocks = config.num_kv_blocks  # the last one is the padding rows' scratch block, as on a GPU
    llm._scheduler_config = dataclasses.replace(llm._scheduler_config, num_blocks=blocks - 1)
    llm.reset()
    llm.runner.graphs = RowsReplayedEagerly(llm.model, llm.selection.kernels, llm.runner.kv_caches,
                                            config.block_size, llm.max_model_len, blocks - 1, "cpu",
                                            max_size=config.max_num_seqs)
    return llm


def test_steps_queued_ahead_give_the_eager_bits_and_drop_what_finished(until_queued_ahead) -> None:
    """A replayed decode step is followed by the next one before its tokens are recorded: sequences that its
    tokens finish (stop tokens, EOS) have their step ahead dropped, the others keep the eager bits; an abort
    records the step ahead first."""
    seed = int(torch.randint(0, 1 << 20, ()))
    rng = random.Random(seed)
    n = 10
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(2, 30))] for _ in range(n)]
    stops = tuple(rng.sample(range(256), 24))  # each draw stops a sequence now and then
    # those without stop tokens run long, so that the last steps (nothing waiting) are queued ahead
    params = [SamplingParams(temperature=0.9 if i % 2 else 0.0, seed=rng.randrange(1 << 30),
                             logprobs=2 if i % 3 == 1 else None,
                             max_tokens=rng.randint(1, 30) if i % 4 else rng.randint(16, 30),
                             stop_token_ids=stops if i % 4 else ()) for i in range(n)]
    config = EngineConfig(model="random:tiny-llama", max_num_seqs=8, max_num_batched_tokens=48, block_size=4,
                          num_kv_blocks=60, max_model_len=96)
    eager = LLM(config).generate(prompts, params)
    assert any(o.finish_reason == "stop" for o in eager)  # some finish by their token, not their length
    llm = replaying_engine(config)
    ahead = 0
    schedule_ahead = llm.scheduler.schedule_ahead

    def counted(out):
        nonlocal ahead
        step = schedule_ahead(out)
        ahead += step is not None
        return step

    llm.scheduler.schedule_ahead = counted  # type: ignore[method-assign]
    replayed = llm.generate(prompts, params)
    for a, b in zip(replayed, eager):
        assert (a.token_ids, a.logprobs, a.top_logprobs, a.finish_reason) == (
            b.token_ids, b.logprobs, b.top_logprobs, b.finish_reason), seed
    assert ahead >= 5, seed
    assert not llm.has_unfinished() and llm._ahead is None

    # an abort while a step is queued ahead: that step is recorded first, the others go on unchanged
    llm.reset()
    handles = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = max(range(n), key=lambda i: len(eager[i].token_ids))
    until_queued_ahead(llm, handles[victim], seed)
    llm.abort(handles[victim])
    assert llm._ahead is None
    cut = handles[victim].output_token_ids
    assert cut == eager[victim].token_ids[:len(cut)], seed
    llm.run([h for i, h in enumerate(handles) if i != victim and not h.is_finished])
    for i, h in enumerate(handles):
        if i != victim:
            assert llm.output_of(h).token_ids == eager[i].token_ids, seed


def test_a_gpu_engine_holds_256_sequences_by_default() -> None:
    assert EngineConfig(device="cuda").max_num_seqs == 256  # and its decode graphs go up to them
    assert EngineConfig().max_num_seqs == 32
    assert EngineConfig(device="cuda", max_num_seqs=8).max_num_seqs == 8
    assert EngineConfig(device="cuda", max_num_batched_tokens=128).max_num_seqs == 128  # within the budget
    assert dataclasses.replace(EngineConfig(device="cuda"), device="cpu").max_num_seqs == 256  # as resolved


def test_an_abort_while_a_step_is_queued_ahead_leaves_the_engine_serving() -> None:
    """The step queued ahead is recorded before an abort: a request it finishes ends aborted all the same
    (never returned as finished), and one finished when nothing else runs is returned by the next step, after
    which the engine serves on."""
    seed = int(torch.randint(0, 1 << 20, ()))
    rng = random.Random(seed)
    # both prompts prefill in one step (48 tokens), so the second step is a decode that is queued ahead of
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 12)]
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(2, 24))] for _ in range(2)]
    config = EngineConfig(model="random:tiny-llama", max_num_seqs=8, max_num_batched_tokens=48, block_size=4,
                          num_kv_blocks=60, max_model_len=96)
    eager = LLM(config).generate(prompts, params)
    llm = replaying_engine(config)

    def until_ahead_of_last_token(short: Sequence) -> None:
        for _ in range(10):
            if llm._ahead is not None and short.num_output_tokens == 2:
                return
            llm.step()
        raise AssertionError(f"no step was queued ahead of the last token (seed {seed})")

    # the step ahead gives the aborted request its last token
    short, long = (llm.add_request(p, sp) for p, sp in zip(prompts, params))
    until_ahead_of_last_token(short)
    llm.abort(short)
    assert short.finish_reason is None and short.is_finished
    finished = []
    while llm.has_unfinished():
        finished += llm.step()
    assert finished == [long] and llm.output_of(long).token_ids == eager[1].token_ids
    # the step ahead finishes the last request still running after the abort
    llm.reset()
    short, long = (llm.add_request(p, sp) for p, sp in zip(prompts, params))
    until_ahead_of_last_token(short)
    llm.abort(long)
    assert llm.has_unfinished() and llm.step() == [short] and not llm.has_unfinished()
    assert llm.output_of(short).token_ids == eager[0].token_ids
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in eager], seed
