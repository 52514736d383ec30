"""A fourth engine joins from this module alone: registered in the registry, it is served by `serve --engine`,
its receipts signed, and `verify` rebuilds it from their facts and checks their bits; nothing outside this
file names it. Its "model" is a seeded function of the context (no weights), batch-invariant by construction:
the logits at a position depend on the tokens before it only."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import struct
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.enums import Mode
from detent_audit.manifests.keys import generate_key
from detent_audit.runtime import registry
from detent_audit.runtime.base import EngineBase
from detent_audit.runtime.contract import (
    Engine,
    Facts,
    Prompt,
    RequestHandle,
    RequestOutput,
    Rescored,
    TopLogprobs,
    TupleValues,
)
from detent_audit.runtime.facts import format_facts
from detent_audit.runtime.finish import finish_cause
from detent_audit.runtime.rebuild import NotComparable, RebuildRequest, check_comparable, served_mode
from detent_audit.runtime.sampling_params import SamplingParams

runner = CliRunner()
NAME, VERSION, VOCAB = "toy", "1.0", 300


class ByteTokenizer:
    """Bytes are tokens 0-255; 256 is the EOS."""

    eos_token_ids = (256,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: SequenceOf[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def encode_chat(self, messages: SequenceOf[dict[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def max_token_chars(self) -> int:
        return 1

    def token_piece(self, token_id: int) -> str | None:
        return None


def logits_after(context: SequenceOf[int], salt: int) -> torch.Tensor:
    """The toy model: fp32 logits seeded by the context and the model's weights' `salt`."""
    digest = hashlib.sha256(struct.pack(f"<{len(context) + 1}q", salt, *context)).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(VOCAB, generator=gen, dtype=torch.float32) * 4


def draw(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    if params.temperature == 0:
        return int(logits.argmax())
    gen = torch.Generator().manual_seed((params.seed or 0) * 1_000_003 + position)
    gumbel = -torch.log(-torch.log(torch.rand(VOCAB, generator=gen, dtype=torch.float64)))
    return int((logits.double() / params.temperature + gumbel).argmax())


@dataclass
class ToyRequest:
    seq_id: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ToyConfig:
    mode: str
    num_threads: int
    salt: int


class ToyEngine(EngineBase[ToyRequest]):
    """One token per live request per step, every request in the step together."""

    name = NAME
    handle_type = ToyRequest
    max_model_len = 64
    vocab_size = VOCAB
    model_name = "toy-model"
    model_positions = 64
    block_size = 16

    def __init__(self, config: ToyConfig) -> None:
        self.config = config
        self.tokenizer = ByteTokenizer()
        self._live: dict[int, ToyRequest] = {}
        self._ids: Iterator[int] = iter(range(1 << 62))

    def facts(self) -> Facts:
        return {"engine": {"name": NAME, "version": VERSION, "mode": self.config.mode},
                "checkpoint": {"weights": str(self.config.salt), "name": "toy-model", "source": "this test"},
                "runtime": {"num_threads": self.config.num_threads}, "tuple": {}, "format": format_facts()}

    def tuple_values(self) -> TupleValues:
        return {"mode": {"name": self.config.mode}}

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *,
                    score_prompt: bool = False) -> ToyRequest:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq_id = next(self._ids)
        req = ToyRequest(seq_id, request_id or str(seq_id), ids, params)
        self._live[seq_id] = req
        return req

    def step(self) -> list[ToyRequest]:
        finished = []
        for req in list(self._live.values()):
            context = req.prompt + req.tokens
            logits = logits_after(context, self.config.salt)
            token = draw(logits, req.params, len(context))
            req.tokens.append(token)
            req.output_logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            cause = finish_cause(token, len(req.tokens), len(context) + 1, req.params,
                                 set(self.tokenizer.eos_token_ids), self.max_model_len)
            if cause is not None:
                req.finish_reason = cause.reason
                finished.append(self._live.pop(req.seq_id))
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def output_of(self, seq: RequestHandle) -> RequestOutput:
        req = self.own(seq)
        return RequestOutput(req.request_id, list(req.prompt), list(req.tokens),
                             self.tokenizer.decode(req.tokens), list(req.output_logprobs), req.finish_reason)

    def top_logprobs_so_far(self, seq: RequestHandle) -> TopLogprobs:
        self.own(seq)
        return []

    def abort(self, seq: RequestHandle) -> None:
        self._live.pop(self.own(seq).seq_id, None)

    def reset(self, *, max_prefill_chunk: int | None = None, drop_unfinished: bool = False) -> None:
        if self._live and not drop_unfinished:
            raise RuntimeError("reset() with requests still running")
        self._live.clear()

    def rescore_batch(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                      params: SequenceOf[SamplingParams] | None = None) -> list[Rescored]:
        out = []
        for i, (prompt, output) in enumerate(pairs):
            sp = params[i] if params is not None else SamplingParams(temperature=0.0)
            context, scored = list(prompt), Rescored([], [], [])
            for token in output:
                logits = logits_after(context, self.config.salt)
                scored.logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                scored.tokens.append(draw(logits, sp, len(context)))
                context.append(token)
            out.append(scored)
        return out


WEIGHTS = {"salt": 7}  # the toy model's "weights" on this machine


def build(options: registry.EngineOptions) -> Engine:
    return ToyEngine(ToyConfig(options.mode.value, options.threads, WEIGHTS["salt"]))


def rebuild(request: RebuildRequest) -> Engine:
    mode = served_mode(request)
    engine = ToyEngine(ToyConfig(mode.value, 1, WEIGHTS["salt"]))
    check_comparable(dict(request.facts), engine.facts())
    return engine


@pytest.fixture
def toy_engine() -> Iterator[None]:
    registry.register(registry.EngineEntry(NAME, NAME, build, rebuild))
    yield
    registry.unregister(NAME)


def _serve(tmp_path: Path, requests: list[dict]) -> tuple[Path, Path]:
    key = generate_key(tmp_path / "node.key")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    res = runner.invoke(app, ["serve", "--engine", NAME, "--key", str(key.private_path), "--manifest-out",
                              str(tmp_path / "out"), "--input", str(tmp_path / "in.jsonl"),
                              "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 0, res.output
    return key.public_path, tmp_path / "out"


def _verify(public: Path, *paths: Path) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(public), "--workers", "1", "--json"])
    return res.exit_code, json.loads(res.stdout)


def test_a_registered_engine_is_served_signed_and_verified(toy_engine, tmp_path: Path) -> None:
    rng = random.Random()
    requests = [{"id": f"r{i}", "prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 20))],
                 "max_tokens": rng.randint(1, 12), "temperature": t, "seed": rng.randrange(1 << 32)}
                for i, t in enumerate((0.0, 0.7, 1.3))]
    public, out = _serve(tmp_path, requests)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["r0", "r1", "r2"]
    code, report = _verify(public, out)
    assert code == 0, [o.get("message") for o in report["outcomes"]]
    assert sorted(o["status"] for o in report["outcomes"] if o.get("request_id")) == ["OK"] * 3, report


def test_a_registered_engine_refutes_a_flipped_bit_and_refuses_other_weights(toy_engine, tmp_path: Path,
                                                                              monkeypatch) -> None:
    from detent_audit.manifests.keys import load_private_key, load_trusted_keys
    from detent_audit.manifests.receipt import sign_receipt, verify_envelope

    public, out = _serve(tmp_path, [{"id": "r0", "prompt_token_ids": [5, 6, 7], "max_tokens": 6}])
    receipt_path = out / "receipts" / "r0.receipt"
    receipt = verify_envelope(receipt_path.read_bytes(), load_trusted_keys(public)).receipt
    flipped = bytearray(receipt.output.logprobs_f32le)
    flipped[random.randrange(len(flipped))] ^= 1 << random.randrange(8)  # one bit of one logprob
    output = dataclasses.replace(receipt.output, logprobs_f32le=bytes(flipped))
    forged = dataclasses.replace(receipt, output=output)
    (tmp_path / "forged").mkdir()
    key = load_private_key(tmp_path / "node.key")
    (tmp_path / "forged" / "r0.receipt").write_bytes(sign_receipt(forged, key))
    code, report = _verify(public, tmp_path / "forged" / "r0.receipt")
    assert code == 1 and report["outcomes"][0]["status"] == "FAIL", report

    monkeypatch.setitem(WEIGHTS, "salt", WEIGHTS["salt"] + 1)  # the verifier's weights differ from the node's
    code, report = _verify(public, receipt_path)
    assert code == 3 and report["outcomes"][0]["fields"] == ["checkpoint.weights"], report


def test_an_unregistered_engine_is_not_comparable() -> None:
    with pytest.raises(NotComparable) as err:
        registry.entry_for_facts({"engine": {"name": NAME}})
    assert err.value.fields == ["engine.name"]


def test_an_engine_refuses_a_handle_it_did_not_make() -> None:
    from detent_audit.engine.sequence import Sequence
    from detent_audit.runtime.base import ForeignHandle

    toy = ToyEngine(ToyConfig(Mode.DETENT.value, 1, WEIGHTS["salt"]))
    mine = toy.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    for method in (toy.output_of, toy.abort, toy.top_logprobs_so_far):
        with pytest.raises(ForeignHandle, match="toy engine was handed a Sequence"):
            method(Sequence(mine.seq_id, [1, 2, 3], SamplingParams()))
    toy.abort(mine)
    assert not toy.has_unfinished()
