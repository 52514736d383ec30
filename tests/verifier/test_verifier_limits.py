"""A receipt's signed claims do not size the verifier: a page size beyond the verifier's limit is bad
input, and within it the KV pool is the verifier's own; a prompt longer than the context can hold is refused
before it is tokenized; the alternatives are compared in one pass. Each in seconds and small memory,
re-signed with the node's own key."""

from __future__ import annotations

import dataclasses
import json
import random
import resource
import time
from types import SimpleNamespace

import pytest

from detent_audit.engine.llm import LLM
from detent_audit.engine.registration import POOL_TOKENS
from detent_audit.engine.registration import engine_config as _engine_config
from detent_audit.errors import BadInput
from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.manifests.receipt import ClientRequest, OutputRecord, verify_envelope
from detent_audit.runtime.rebuild import SIZE_LIMITS, RebuildRequest
from detent_audit.server.offline import serve_offline
from detent_audit.verifier.checks import refutation
from detent_audit.verifier.reexecute import _max_prompt_chars, _tops_problem

SECONDS = 5.0


def engine_config(facts: dict, tuple_values: dict, model: object, cache_dir: str):  # noqa: ANN201
    return _engine_config(RebuildRequest(facts, tuple_values, str(model), cache_dir))


@pytest.fixture(scope="module")
def served(new_node) -> dict:
    root, ckpt, key, llm, node = new_node("limits")
    (root / "in.jsonl").write_text(
        json.dumps({"id": "a", "prompt": "The cat sat on", "max_tokens": 4, "ignore_eos": True})
    )
    serve_offline(llm, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    receipt = verify_envelope(
        (root / "out" / "receipts" / "a.receipt").read_bytes(), load_trusted_keys(key.public_path)
    ).receipt
    return {"ckpt": ckpt, "llm": llm, "receipt": receipt, "jit": root / "jit"}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _with_scheduler(facts: dict, **sizes: int) -> dict:
    facts = json.loads(json.dumps(facts, default=dict))
    facts["scheduler"].update(sizes)
    return facts


@pytest.mark.parametrize("block_size", [256, 4096, 10**9])
def test_a_signed_block_size_never_sizes_the_verifiers_kv_pool(served, block_size: int) -> None:
    """Within the verifier's limit, the pool holds POOL_TOKENS tokens whatever the page size (1,024 pages of
    256 tokens would be ~12 GB on the default model); beyond it, bad input, before any engine."""
    r = served["receipt"]
    facts = _with_scheduler(r.deployment_facts, block_size=block_size)
    start = time.perf_counter()
    if block_size > SIZE_LIMITS["block_size"]:
        with pytest.raises(BadInput, match=f"scheduler.block_size is {block_size}, outside 1..1024"):
            engine_config(facts, r.tuple_values, served["ckpt"], str(served["jit"]))
        assert time.perf_counter() - start < SECONDS
        return
    config = engine_config(facts, r.tuple_values, served["ckpt"], str(served["jit"]))
    assert config.block_size == block_size and config.num_kv_blocks * block_size <= POOL_TOKENS + block_size
    llm = LLM(config)
    pages = llm.runner.kv_caches[0][0].shape[0]
    assert pages * block_size <= POOL_TOKENS + 2 * block_size, (pages, block_size)


@pytest.mark.parametrize("name", sorted(SIZE_LIMITS))
def test_each_size_a_receipt_states_is_bounded_by_the_verifiers_limit(served, name: str) -> None:
    r = served["receipt"]
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    section = (
        facts["scheduler"]
        if name in ("block_size", "max_num_batched_tokens")
        else facts["deployment"]["engine"]
    )
    section[name] = SIZE_LIMITS[name] + 1
    with pytest.raises(BadInput, match=f"{name} is {SIZE_LIMITS[name] + 1}, outside"):
        engine_config(facts, r.tuple_values, served["ckpt"], str(served["jit"]))


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_it_is_tokenized(served) -> None:
    """A 15.6 MB prompt in the bound body (the node's own key signs anything): a FAIL at the request step in
    seconds, never tokenized (which took 65 s and 4 GB)."""
    r, llm = served["receipt"], served["llm"]
    body = {**r.request.client.body(), "prompt": "the cat sat " * 1_300_000}
    forged = dataclasses.replace(
        r, request=dataclasses.replace(r.request, client=ClientRequest.of(r.request.client.api, body))
    )
    before = _peak_rss_mib()
    start = time.perf_counter()
    error = refutation(forged, llm, set(llm.tokenizer.eos_token_ids), _max_prompt_chars(llm))
    seconds = time.perf_counter() - start
    assert (
        error is not None
        and error.step.name == "REQUEST"
        and "15600000 characters of prompt text" in error.message
    ), error
    assert seconds < SECONDS and _peak_rss_mib() - before < 512, (seconds, _peak_rss_mib() - before)
    honest = refutation(r, llm, set(llm.tokenizer.eos_token_ids), _max_prompt_chars(llm))
    assert honest is None, honest


def test_the_alternatives_are_compared_in_one_pass() -> None:
    """4,000 output tokens with 20 alternatives each (190 s when each position rebuilt them all), the last
    position's alternatives changed: named in well under a second per thousand positions."""
    rng = random.Random(9)
    n, k = 4000, 20
    tops = [[(rng.randrange(50_000), -rng.random() * 10) for _ in range(k)] for _ in range(n)]
    output = OutputRecord.from_floats([t[0][0] for t in tops], [t[0][1] for t in tops], "length", "", tops)
    got = [list(t) for t in output.top_logprobs]
    got[-1][3] = (got[-1][3][0] + 1, got[-1][3][1])
    start = time.perf_counter()
    problem = _tops_problem(SimpleNamespace(output=output), got)
    assert problem is not None and f"at output position {n - 1}" in problem, problem
    assert time.perf_counter() - start < SECONDS
    assert _tops_problem(SimpleNamespace(output=output), output.top_logprobs) is None
