"""Stop strings and echo (prompt logprobs), served and verified: the engine stops at the first token whose
text holds a stop string and cuts the text there (checked against an unstopped run on fresh random prompts);
echo receipts bind every prompt position's logprob and top-n bits; `verify` passes them in both modes and
FAILs a node that cut early, went past a stop string, or changed one bit of a prompt score."""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.manifests.keys import load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import (
    ClientRequest,
    OutputRecord,
    Receipt,
    ScoringRecord,
    sign_receipt,
    verify_envelope,
)
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.stop_strings import find_stop

runner = CliRunner()
API = "openai/v1/completions"


def _body(prompt: list[int], params: SamplingParams, **extra) -> dict:
    """The /v1/completions body a client sends for this prompt and sampling (what the receipt binds)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "seed": params.seed, "ignore_eos": params.ignore_eos, **extra}
    if params.stop:
        body["stop"] = list(params.stop)
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    return body


@pytest.fixture(scope="module")
def setup(new_node) -> dict:
    root, ckpt, key, llm, node = new_node("echo-stop")
    return {"root": root, "ckpt": ckpt, "key": key, "llm": llm, "node": node, "jit": root / "jit"}


def _verify(s: dict, *paths: Path, mode: str = "rescore") -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(s["key"].public_path), "--model",
                              str(s["ckpt"]), "--cache-dir", str(s["jit"]), "--mode", mode, "--json",
                              "--workers", "1"])
    return res.exit_code, json.loads(res.stdout)


def _open(s: dict, path: Path) -> Receipt:
    return verify_envelope(path.read_bytes(), load_trusted_keys(s["key"].public_path)).receipt


def _resign(s: dict, receipt: Receipt, path: Path) -> Path:
    """The forged receipt, signed with the node's key, in a folder of its own under its request's name."""
    path = path.with_suffix("") / f"{receipt.request.request_id}.receipt"
    path.parent.mkdir(parents=True)
    path.write_bytes(sign_receipt(receipt, load_private_key(s["key"].private_path)))
    return path


def _stopped_runs(s: dict, n: int = 24) -> list[tuple[list[int], SamplingParams, object, object]]:
    """Fresh random prompts: an unstopped run, a stop string taken from its text, the stopped run."""
    llm, rng = s["llm"], random.Random()
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    free = llm.generate(prompts, SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True))
    cases = []
    for prompt, out in zip(prompts, free):
        text = out.text
        if len(text) < 5:
            continue
        start = rng.randrange(2, len(text) - 2)
        stop = text[start:start + rng.randint(1, 3)]
        if "\ufffd" in stop:
            continue
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True,
                                stop=("\x00never", stop))
        cases.append((prompt, params, out, stop))
    stopped = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    return [(p, params, free_out, got) for (p, params, free_out, _), got in zip(cases, stopped)]


def test_the_engine_stops_at_the_first_token_whose_text_holds_a_stop_string(setup) -> None:
    llm = setup["llm"]
    runs = _stopped_runs(setup)
    assert runs
    for _, params, free, got in runs:
        first = next(i for i in range(len(free.token_ids))
                     if find_stop(llm.tokenizer.decode(free.token_ids[:i + 1]), params.stop))
        assert got.token_ids == free.token_ids[:first + 1] and got.logprobs == free.logprobs[:first + 1]
        assert got.finish_reason == "stop"
        full = llm.tokenizer.decode(got.token_ids)
        assert got.text == full[:find_stop(full, params.stop).cut]
        assert not any(x in got.text for x in params.stop)


@pytest.fixture(scope="module")
def receipts(setup) -> dict:
    s, llm = setup, setup["llm"]
    out = {}
    for i, (prompt, params, _, got) in enumerate(_stopped_runs(s)):
        client = ClientRequest.of(API, _body(prompt, params))
        out[f"stop{i}"] = s["node"].sign(got, params, f"cmpl-stop{i}", client).path
    rng = random.Random()
    for i, (top_n, max_tokens) in enumerate([(1, 1), (3, 0), (0, 2), (None, 1)]):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(2, 30))]
        params = SamplingParams(temperature=0.0, max_tokens=max(1, max_tokens), logprobs=top_n)
        seq = llm.add_request(prompt, params, score_prompt=True)
        llm.run([seq])
        got = llm.output_of(seq)
        assert len(got.prompt_logprobs) == len(prompt) - 1
        assert all(len(t) == (top_n or 0) for t in got.prompt_top_logprobs)
        if max_tokens == 0:
            got = dataclasses.replace(got, token_ids=[], logprobs=[], top_logprobs=[], text="",
                                      finish_reason="length")
        client = ClientRequest.of(API, {**_body(prompt, params, echo=True), "max_tokens": max_tokens})
        out[f"echo{i}"] = s["node"].sign(got, params, f"cmpl-echo{i}", client, max_tokens=max_tokens).path
    return out


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_stop_and_echo_receipts_verify(setup, receipts, mode: str) -> None:
    code, report = _verify(setup, *receipts.values(), mode=mode)
    assert code == 0, report
    assert report["counts"]["OK"] == len(receipts)
    r = _open(setup, receipts["echo1"])
    assert r.request.sampling.max_tokens == 0 and r.output.token_ids == () and r.scoring.top_n == 3


def test_echo_prompt_scores_equal_a_teacher_forced_rescore(setup, receipts) -> None:
    for name in ("echo0", "echo1"):
        r = _open(setup, receipts[name])
        prompt = list(r.request.prompt_token_ids)
        again = setup["llm"].rescore_batch([(prompt[:1], prompt[1:])],
                                           [SamplingParams(temperature=0.0,
                                                           logprobs=r.scoring.top_n or None)])[0]
        assert struct.pack(f"<{len(again.logprobs)}f", *again.logprobs) == r.scoring.logprobs_f32le
        assert [[(t, struct.pack("<f", v)) for t, v in top] for top in again.tops] == \
            [[(t, struct.pack("<f", v)) for t, v in top] for top in r.scoring.tops]


def test_a_node_that_cuts_early_or_goes_past_a_stop_string_fails(setup, receipts, tmp_path: Path) -> None:
    stops = [p for n, p in receipts.items() if n.startswith("stop")
             and len(_open(setup, p).output.token_ids) > 1]
    r = _open(setup, stops[0])
    cut = OutputRecord.from_floats(r.output.token_ids[:-1], r.output.logprobs[:-1], "stop", r.output.text)
    early = dataclasses.replace(r, output=cut)
    code, report = _verify(setup, _resign(setup, early, tmp_path / "early.receipt"))
    assert code == 1 and "contains none of the stop strings" in report["outcomes"][0]["message"]
    # the same tokens under a stop string that an earlier token already completed
    text = setup["llm"].tokenizer.decode(r.output.token_ids[:1])
    # a first token with no text of its own completes no stop string
    if text[:1] and "\ufffd" not in text[:1]:
        past = dataclasses.replace(r, request=dataclasses.replace(
            r.request, sampling=dataclasses.replace(r.request.sampling, stop=(text[:1],))))
        code, report = _verify(setup, _resign(setup, past, tmp_path / "past.receipt"))
        assert code == 1 and "already contains the stop string" in report["outcomes"][0]["message"]
    # a stop claimed as a length limit
    length = dataclasses.replace(r, output=dataclasses.replace(r.output, finish_reason="length"))
    code, report = _verify(setup, _resign(setup, length, tmp_path / "length.receipt"))
    assert code == 1 and "completes a stop string" in report["outcomes"][0]["message"]


@pytest.mark.parametrize("what", ["logprob", "top_id", "top_logprob"])
def test_one_changed_prompt_score_bit_fails(setup, receipts, tmp_path: Path, what: str) -> None:
    r = _open(setup, receipts["echo1"])
    sc, rng = r.scoring, random.Random()
    lps, ids, tops = bytearray(sc.logprobs_f32le), list(sc.top_ids), bytearray(sc.top_logprobs_f32le)
    if what == "logprob":
        lps[4 * rng.randrange(sc.num_positions)] ^= 1 << rng.randrange(8)
    elif what == "top_id":
        i = rng.randrange(len(ids))
        ids[i] = (ids[i] + 1) % 256
    else:
        tops[4 * rng.randrange(len(ids))] ^= 1
    forged = dataclasses.replace(r, scoring=ScoringRecord(bytes(lps), sc.top_n, tuple(ids), bytes(tops)))
    code, report = _verify(setup, _resign(setup, forged, tmp_path / "forged.receipt"))
    assert code == 1 and "prompt token" in report["outcomes"][0]["message"], report


def test_scoring_receipts_round_trip_and_are_checked(setup, receipts) -> None:
    r = _open(setup, receipts["echo0"])
    assert Receipt.from_bytes(r.to_bytes()) == r
    plain = _open(setup, receipts["stop0"])
    assert plain.scoring is None and b"scoring" not in plain.to_bytes()
    from detent_audit.manifests.errors import InvalidReceipt
    with pytest.raises(InvalidReceipt, match="prompt logprobs for a prompt"):
        dataclasses.replace(r, scoring=ScoringRecord(r.scoring.logprobs_f32le[:-4], 0, (), b""))
    with pytest.raises(InvalidReceipt, match="alternatives per prompt position"):
        dataclasses.replace(r, scoring=ScoringRecord(r.scoring.logprobs_f32le, 0, (), b""))
    with pytest.raises(InvalidReceipt, match="0 only in a receipt that scores"):
        dataclasses.replace(r, scoring=None, request=dataclasses.replace(
            r.request, sampling=dataclasses.replace(r.request.sampling, max_tokens=0)),
            output=OutputRecord.from_floats((), (), "length"))
