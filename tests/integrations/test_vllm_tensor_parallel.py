"""vLLM at tensor-parallel size 2 on the CPU (two worker processes over gloo, one thread each) with the detent
plugin: the all-reduce is the ordered gather-and-sum, the facts say so, served receipts verify at TP=2 in
vLLM, a flipped bit fails at its position, and a verifier asked for another split is refused before it builds.

The checkpoint is a seeded random llama with 4 query heads and 2 KV heads (head size 32, vLLM CPU's least), so
each rank holds 2 query heads and 1 KV head. `battery --engine vllm --tensor-parallel-size 2` is the slow
tier.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.integrations.hosted import check_split, fused_gemm_shapes
from detent_audit.kernels.all_reduce import ORDERED, ordered_sum
from detent_audit.runtime.model_config import ModelConfig

SHAPE = dict(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


# ---- no vLLM process: the wrapped all-reduce's arithmetic, the split -------------------------------------

class _Transport:
    """vLLM's `dist_module` as the wrapper calls it: an all-gather of the N ranks' partials in rank order."""

    def __init__(self, partials: list[torch.Tensor]) -> None:
        self.partials = partials

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: object = None) -> None:
        output.copy_(torch.cat([p.reshape(-1) for p in self.partials]))


@dataclasses.dataclass
class _Communicator:
    world_size: int
    dist_module: _Transport
    device_group: object = None


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_plugins_all_reduce_is_the_ordered_sum_of_the_gathered_partials(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from detent_audit.integrations.vllm import plugin

    monkeypatch.setenv(plugin.ENV_MODE, "detent")
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    # partials of very different magnitudes: the order of the adds shows in the bits
    partials = [torch.randn(7, 96, generator=gen) * 10.0 ** (3 * (i % 2)) for i in range(size)]
    stock_calls: list[int] = []
    wrapped = plugin._ordered_all_reduce(lambda comm, x: stock_calls.append(1) or x)
    mine = partials[1].clone()
    out = wrapped(_Communicator(size, _Transport(partials)), mine)
    assert out is mine and not stock_calls  # in place, as vLLM's own; vLLM's sum never ran
    assert torch.equal(out, ordered_sum(partials))
    if size >= 3:  # another order (vLLM's shm: rank 1 adds 1, 2, ..., then 0) gives other bits somewhere
        swizzled = ordered_sum(partials[1:] + partials[:1])
        assert not torch.equal(out, swizzled)
    monkeypatch.setenv(plugin.ENV_MODE, "stock")  # stock: vLLM's own all-reduce, untouched
    wrapped(_Communicator(size, _Transport(partials)), partials[0].clone())
    assert stock_calls == [1]


def test_a_split_that_does_not_divide_is_refused_naming_both_numbers() -> None:
    smol = dataclasses.replace(ModelConfig.from_name("tiny-llama"), num_attention_heads=9,
                               num_key_value_heads=3, intermediate_size=1536)  # SmolLM2-135M's
    with pytest.raises(BadInput, match=r"tensor_parallel_size 2 does not divide the model's "
                                         r"num_attention_heads \(9\)"):
        check_split(smol, 2)
    check_split(smol, 3)


def test_the_gemm_probe_sees_one_ranks_shapes() -> None:
    config = dataclasses.replace(ModelConfig.from_name("tiny-llama"), **SHAPE)
    head, hidden, inter = 32, 128, config.intermediate_size
    vocab = -(-config.vocab_size // 64) * 64
    # 2 query heads and 1 KV head per rank; MLP and the padded vocabulary halved
    assert fused_gemm_shapes(config, 2) == sorted({(4 * head, hidden), (hidden, 2 * head), (inter, hidden),
                                                   (hidden, inter // 2), (vocab // 2, hidden)})
    assert fused_gemm_shapes(config) == sorted({(8 * head, hidden), (hidden, 4 * head), (2 * inter, hidden),
                                                (hidden, inter), (config.vocab_size, hidden)})


# ---- vLLM at TP=2: one engine serves, one verifier re-executes -------------------------------------------

def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("tiny-llama", seed=5, **SHAPE)


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("vllm")
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine
    from detent_audit.manifests.keys import generate_key, load_private_key
    from detent_audit.runtime.sampling_params import SamplingParams
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline

    root = tmp_path_factory.mktemp("served-vllm-tp2")
    engine = VllmEngine(VllmConfig(model=str(checkpoint), mode="detent", max_model_len=512,
                                   tensor_parallel_size=2, cache_dir=str(root / "jit")))
    try:
        facts = engine.facts()
        rng = random.Random(27)
        shared = _prompt(rng, 40)  # a whole 32-token page shared: prefix-cache hits
        lines = [{"id": f"r{i}",
                  "prompt_token_ids": (shared if i % 2 else []) + _prompt(rng, rng.choice((5, 50))),
                  "max_tokens": 6, "temperature": [0.0, 0.9, 0.6][i % 3], "seed": 500 + i, "ignore_eos": True}
                 for i in range(8)]
        (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
        key = generate_key(root / "node.key")
        node = ServingNode(engine, load_private_key(key.private_path), root / "out")
        assert serve_offline(engine, node, root / "in.jsonl", root / "out.jsonl") == 8
        node.close()
        # teacher-forced rescore (scored in rank 0's worker, taken through collective_rpc) equals generation
        params = SamplingParams(temperature=0.9, seed=77, max_tokens=6, logprobs=2, ignore_eos=True)
        generated = engine.generate([lines[1]["prompt_token_ids"]], params)[0]
        rescored = engine.rescore_batch([(lines[1]["prompt_token_ids"], generated.token_ids)], [params])[0]
    finally:
        engine.shutdown()
    return {"root": root, "out": root / "out", "key": key, "ckpt": checkpoint, "facts": facts,
            "generated": generated, "rescored": rescored}


@pytest.mark.slow  # vLLM's TP=2 processes: minutes on a 2-core machine
def test_the_facts_name_the_split_and_the_ordered_all_reduce(served: dict[str, Any]) -> None:
    facts = served["facts"]
    assert facts["parallel"] == {"tensor_parallel_size": 2, "all_reduce": ORDERED, "accumulate": "float32"}
    assert facts["deployment"]["parallel"]["tensor_parallel_size"] == 2
    assert facts["tuple"]["embedded.all_reduce"]["embedded.all_reduce.algorithm"] == ORDERED  # signed, pinned


@pytest.mark.slow  # vLLM's TP=2 processes: minutes on a 2-core machine
def test_rescore_at_tp2_equals_generation(served: dict[str, Any]) -> None:
    generated, rescored = served["generated"], served["rescored"]
    assert rescored.tokens == list(generated.token_ids)
    assert torch.equal(torch.tensor(rescored.logprobs), torch.tensor(generated.logprobs))
    assert rescored.tops == generated.top_logprobs


def _flipped(served: dict[str, Any], folder: Path, position: int) -> Path:
    from detent_audit.manifests.keys import load_private_key, load_trusted_keys
    from detent_audit.manifests.receipt import OutputRecord, sign_receipt, verify_envelope

    r = verify_envelope((served["out"] / "receipts" / "r4.receipt").read_bytes(),
                        load_trusted_keys(served["key"].public_path)).receipt
    lps = list(r.output.logprobs)
    bits = struct.unpack("<I", struct.pack("<f", lps[position]))[0] ^ 1
    lps[position] = struct.unpack("<f", struct.pack("<I", bits))[0]
    r = dataclasses.replace(r, output=OutputRecord.from_floats(list(r.output.token_ids), lps,
                                                               r.output.finish_reason, r.output.text))
    folder.mkdir()
    path = folder / "r4.receipt"
    path.write_bytes(sign_receipt(r, load_private_key(served["key"].private_path)))
    return path


def _verify(served: dict[str, Any], *paths: Path, extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    from typer.testing import CliRunner

    from detent_audit.cli import app

    res = CliRunner().invoke(app, ["verify", *map(str, paths), "--key", str(served["key"].public_path),
                                   "--model", str(served["ckpt"]), "--workers", "1", "--json", *extra])
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.slow  # vLLM's TP=2 processes: minutes on a 2-core machine
def test_tp2_receipts_verify_in_vllm_at_tp2_and_a_flipped_bit_fails_at_its_position(served: dict[str, Any],
                                                                                   tmp_path: Path) -> None:
    forged = _flipped(served, tmp_path / "flip", position=2)
    code, report = _verify(served, served["out"], forged)  # one vLLM rebuild at TP=2 for both
    assert code == 1
    receipts = [o for o in report["outcomes"] if o["kind"] == "receipt"]
    (failed,) = [o for o in receipts if o["status"] != "OK"]
    assert failed["path"] == str(forged) and failed["divergence"]["position"] == 2, failed
    assert len(receipts) == 9, receipts
    assert all("TP=2" in o["message"] for o in receipts if o["status"] == "OK"), receipts
    # the run's coverage names the second r4 (the forged one's folder); the bits of the others all held
    assert {o["status"] for o in report["outcomes"] if o["kind"] != "receipt"} <= {"OK", "FAIL"}


@pytest.mark.slow  # vLLM's TP=2 processes: minutes on a 2-core machine
def test_another_split_is_not_comparable_before_vllm_is_built(served: dict[str, Any]) -> None:
    code, report = _verify(served, served["out"] / "receipts" / "r0.receipt",
                           extra=("--tensor-parallel-size", "1"))
    assert code == 3, report
    assert report["outcomes"][0]["status"] == "NOT_COMPARABLE"
    assert "TP=2" in report["outcomes"][0]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detent", "stock"])
def test_the_battery_at_tp2_in_vllm(mode: str) -> None:
    """Detent passes every cell; stock's failing cells are vLLM's kernels', not its all-reduce's: at two ranks
    gloo adds p0 + p1 on both, which an IEEE add makes equal to the ordered p0 + p1 whatever the step."""
    pytest.importorskip("vllm")
    from typer.testing import CliRunner

    from detent_audit.cli import app

    res = CliRunner().invoke(app, ["battery", "--engine", "vllm", "--model", "random-20m", "--mode", mode,
                                   "--tensor-parallel-size", "2", "--threads", "1", "--json"])
    report = json.loads(res.stdout)
    assert report["tensor_parallel_size"] == 2 and report["total"] == 35
    if mode == "detent":
        failing = [c["name"] for c in report["cells"] if not c["passed"]]
        assert res.exit_code == 0 and report["passed"] == 35, failing
    else:
        assert report["passed"] < 35  # vLLM's own attention and GEMM read the batch
