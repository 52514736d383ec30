"""Slow tier: the real SGLang CPU server (sglang.Engine, its scheduler in its own process) on
SmolLM2-135M-Instruct, the plugin loaded through its `sglang.srt.plugins` entry point in the launcher and the
scheduler.

The battery: detent passes all 35 cells, stock fails some (listed in the test's output). Served -> verified:
16 mixed requests (greedy, seeded sampling, chat, stop strings, top-n logprobs) through `serve --input` on the
detent engine, then `verify` rebuilds SGLang from each receipt and re-executes: every receipt OK in rescore
and in replay mode; a receipt with one flipped logprob bit, or one changed token, fails at that position. Then
the stock battery. One SGLang runs at a time (about 4.5 GB: launcher, scheduler, detokenizer): the serving
engine stops before verify starts its own, and verify stops each of its own when it is done.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from typer.testing import CliRunner  # noqa: E402

from detent_audit.bench.battery import run_battery  # noqa: E402
from detent_audit.cli import app  # noqa: E402
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys  # noqa: E402
from detent_audit.manifests.receipt import OutputRecord, sign_receipt, verify_envelope  # noqa: E402
from detent_audit.runtime.contract import Engine  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
runner = CliRunner()


def _engine(mode: str):
    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine

    return SglangEngine(SglangConfig(model=MODEL, mode=mode, max_model_len=1024))


@pytest.fixture(scope="module")
def detent():
    engine = _engine("detent")
    yield engine
    engine.shutdown()


def test_the_first_request_of_an_engine_equals_its_hundredth(request) -> None:
    """The GEMM form is proven on the model's shapes before the scheduler serves: request 1 of a fresh engine
    equals the same request on the module's engine after 99 others (batched, every length). It runs before
    the module's engine starts (the first test of the module)."""
    import random

    import torch

    from detent_audit.runtime.sampling_params import SamplingParams

    rng = random.Random(13)
    target = [rng.randrange(100, 40000) for _ in range(41)]
    others = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 80))] for _ in range(99)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    fresh = _engine("detent")
    try:
        first = fresh.generate([target], params)[0]
    finally:
        fresh.shutdown()
    # one SGLang at a time: the module's starts after this one stops
    detent = request.getfixturevalue("detent")
    detent.generate(others, SamplingParams(temperature=0.0, max_tokens=2))
    later = detent.generate([target], params)[0]
    assert first.token_ids == later.token_ids
    assert torch.equal(torch.tensor(first.logprobs, dtype=torch.float32),
                       torch.tensor(later.logprobs, dtype=torch.float32))


def test_the_engine_implements_the_boundary_with_the_plugin_in_the_scheduler(detent) -> None:
    assert isinstance(detent, Engine)
    facts = detent.facts()
    assert facts["engine"]["name"] == "sglang" and facts["engine"]["mode"] == "detent"
    from detent_audit.integrations.sglang import control, guard, rescore
    from detent_audit.integrations.sglang.cpu_kernels import TARGETS

    assert set(facts["engine"]["plugin"]["hooks"]) == {*TARGETS, guard.TARGET, control.TARGET, rescore.TARGET}
    from detent_audit.integrations.sglang.engine import attention_names

    assert facts["engine"]["plugin"]["attention"] == attention_names()[detent.attention]
    assert facts["tuple"]["embedded.gemm"]  # the GEMM form the probe proved, a fact of every receipt


def test_battery_detent_passes_every_cell(detent) -> None:
    cells = run_battery(detent, progress=lambda name: print("detent", name, flush=True))
    assert len(cells) == 35
    assert [c.name for c in cells if not c.passed] == []


def _requests() -> list[dict]:
    """16 mixed requests: greedy and seeded prompts, chat, stop strings, top-n logprobs, a shared prefix."""
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    lines = []
    for i in range(16):
        line: dict = {"id": f"r{i}", "max_tokens": 12 + (i % 3) * 6}
        if i % 4 == 0:
            question = ["What is 2 + 2?", "Name a color.", "Say hello in French.", "Count to five."][i // 4]
            line["messages"] = [{"role": "user", "content": question}]
        else:
            verb = ["rowed", "sang", "dreamed", "walked"][i % 4]
            line["prompt"] = f"{story} {verb} every day. " * (1 + i % 2)
        if i % 2 == 1:
            line.update(temperature=[0.7, 1.0, 0.9][i % 3], top_p=[1.0, 0.9, 0.95][i % 3], seed=100 + i)
        else:
            line["temperature"] = 0.0
        if i % 5 == 2:
            line["stop"] = [" the", "."]
        if i % 3 == 0:
            line["logprobs"] = 3
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def served(detent, tmp_path_factory) -> dict:
    """The 16 requests served by the detent engine, which then stops (the battery tests run before)."""
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline

    root = tmp_path_factory.mktemp("served-sglang")
    key = generate_key(root / "node.key")
    (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in _requests()))
    detent.reset()
    node = ServingNode(detent, load_private_key(key.private_path), root / "out", rotate=8)
    serve_offline(detent, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    detent.shutdown()  # verify starts its own SGLang: one at a time on a small machine's memory
    outs = [json.loads(line) for line in (root / "out.jsonl").read_text().splitlines()]
    return {"root": root, "key": key, "out": root / "out", "outputs": outs}


def test_stop_strings_end_the_output_at_their_token(served) -> None:
    stopped = [o for o, r in zip(served["outputs"], _requests(), strict=True) if "stop" in r]
    assert stopped and any(o["finish_reason"] == "stop" for o in stopped)
    for o in stopped:
        assert " the" not in o["text"] and "." not in o["text"]


def _forged(served: dict, folder: Path, what: str) -> Path:
    src = served["out"] / "receipts" / "r6.receipt"
    r = verify_envelope(src.read_bytes(), load_trusted_keys(served["key"].public_path)).receipt
    tokens, lps = list(r.output.token_ids), list(r.output.logprobs)
    if what == "logprob":
        bits = struct.unpack("<I", struct.pack("<f", lps[3]))[0] ^ 1
        lps[3] = struct.unpack("<f", struct.pack("<I", bits))[0]
    else:
        tokens[3] = (tokens[3] + 1) % 1000
    from detent_audit.integrations.sglang.engine import SglangConfig
    from detent_audit.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(SglangConfig(model=MODEL).resolved_model.path)
    # the text and the alternatives kept consistent
    r = dataclasses.replace(r, output=OutputRecord.from_floats(
        tokens, lps, r.output.finish_reason, tokenizer.decode(tokens), top_logprobs=r.output.top_logprobs))
    (folder / what).mkdir(parents=True)
    path = folder / what / "r6.receipt"
    path.write_bytes(sign_receipt(r, load_private_key(served["key"].private_path)))
    return path


def _verify(served: dict, *paths: Path, mode: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(served["key"].public_path),
                              "--model", MODEL, "--mode", mode, "--workers", "1", "--json"])
    return res.exit_code, json.loads(res.stdout)


def test_served_receipts_verify_by_rescore_and_forgeries_fail_at_their_position(served, tmp_path) -> None:
    forged = [_forged(served, tmp_path, what) for what in ("logprob", "token")]
    # the receipts without their run's manifests (a forged receipt is not in them: replay checks the run
    # whole)
    receipts = sorted((served["out"] / "receipts").glob("*.receipt"))
    code, report = _verify(served, *receipts, *forged, mode="rescore")
    assert code == 1, report
    assert report["counts"] == {"OK": 16, "FAIL": 4, "BAD": 0, "NOT_COMPARABLE": 0}, report
    failed = [o for o in report["outcomes"] if o["status"] == "FAIL"]
    bits = [o for o in failed if o["kind"] == "receipt"]
    assert sorted(Path(o["path"]).parent.name for o in bits) == ["logprob", "token"]
    for o in bits:  # at position 3: where the bits diverge, or the step before re-execution that names it
        assert (o["divergence"] or {}).get("position") == 3 or "output token 3 " in o["message"], o
    # a forgery keeps its run's sequence number and request id: the run then holds each twice, refused too
    twice = sorted(o["message"].split(" appear")[0].split(" ", 1)[1]
                   for o in failed if o["kind"] == "coverage")
    assert twice == ["request id(s)", "sequence number(s)"], failed


def test_served_receipts_verify_by_replay(served) -> None:
    code, report = _verify(served, served["out"], mode="replay")
    assert code == 0, report
    assert report["counts"] == {"OK": 18, "FAIL": 0, "BAD": 0, "NOT_COMPARABLE": 0}


def test_battery_stock_fails_cells() -> None:
    """Last, after `served` stopped the detent engine and verify its own: one SGLang at a time on a small
    machine's memory."""
    stock = _engine("stock")
    try:
        cells = run_battery(stock, progress=lambda name: print("stock", name, flush=True))
    finally:
        stock.shutdown()
    failing = [c.name for c in cells if not c.passed]
    print("stock SGLang's failing cells:", failing)
    assert len(cells) == 35 and failing  # stock SGLang's bits follow the batch
