"""The engine's models against Hugging Face transformers, the loader's checks, and the checkpoint writer.

Tolerance (fp32, CPU): every logit row we compute is within 1e-4 x max(1, max |HF logit|) of HF's, for
prefill, chunked prefill and decode alike; the differences come only from summation order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from detent_audit.engine.checkpoint import DEFAULT_MODEL, ensure_default_model, write_random_checkpoint
from detent_audit.engine.loader import checkpoint_names, load_model
from detent_audit.engine.model import CausalLM
from detent_audit.kernels import AttentionParams, GemmParams, KernelSet
from detent_audit.runtime.errors import BadCheckpoint, UnsupportedModel
from detent_audit.runtime.model_config import NAMED_SHAPES, ModelConfig
from detent_audit.runtime.tokenizer import CHAT_FORMATS, Tokenizer, render_jinja

transformers = pytest.importorskip("transformers")

RTOL = 1e-4
KERNEL_SETS = {
    "stock": KernelSet.stock,
    "det": KernelSet.det,
    # pinned params small enough that GEMM chunks and attention splits fall inside these short sequences
    "fixed": lambda: KernelSet.fixed(GemmParams(chunk_rows=4), AttentionParams(kv_tile=16, split_stride=16)),
}
CASES = {  # id -> (shape, shards, config overrides)
    "llama-llama3-rope": ("tiny-llama", 1, {}),
    "qwen2": ("tiny-qwen2", 1, {}),
    "qwen3": ("tiny-qwen3", 1, {}),
    "qwen3-moe": ("tiny-qwen3-moe", 1, {}),
    "llama-tied": ("tiny-llama", 1, {"tie_word_embeddings": True}),
    "qwen3-sharded": ("tiny-qwen3", 3, {}),
}


@pytest.fixture(scope="module")
def hf_models(make_checkpoint):
    """id -> (checkpoint path, HF model in fp32), loaded once; HF must find no missing or unexpected keys."""
    loaded = {}

    def get(case: str):
        if case not in loaded:
            shape, shards, overrides = CASES[case]
            path = make_checkpoint(shape, shards=shards, **overrides)
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, output_loading_info=True)
            assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
            loaded[case] = path, model.eval()
        return loaded[case]

    return get


@pytest.mark.parametrize(("case", "ks_name"), [
    *((case, ks) for case in CASES for ks in ("stock", "det")),
    ("llama-llama3-rope", "fixed"), ("qwen3-moe", "fixed"),
])
@torch.no_grad()
def test_logits_match_hf_through_prefill_chunks_and_decode(case, ks_name, hf_models, paged_kv):
    path, hf = hf_models(case)
    model, ks = load_model(path, dtype=torch.float32), KERNEL_SETS[ks_name]()
    config = model.config
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 17)]
    kv = paged_kv(config, num_seqs=3, max_len=32, seed=3)
    ours: list[list[torch.Tensor]] = [[], [], []]  # per sequence, one logit row per position
    # step 1: two whole prompts and the first chunk of the third; step 2: two decodes and the rest of the
    # third (a chunk with context); steps 3-5: decode all three
    plan = [[seqs[0], seqs[1], seqs[2][:8]], [None, None, seqs[2][8:]], [None] * 3, [None] * 3, [None] * 3]
    for chunks in plan:
        chunks = [c if c is not None else [seqs[i][-1]] for i, c in enumerate(chunks)]
        ids, positions, meta = kv.step(chunks)
        logits = model.compute_logits(model(ids, positions, meta, kv.kv_caches, ks), ks)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), config.vocab_size)
        rows = iter(logits)
        for i, chunk in enumerate(chunks):
            ours[i] += [next(rows) for _ in chunk]
            if len(ours[i]) == len(seqs[i]):  # the sequence's prompt is in: append its greedy token
                seqs[i].append(int(ours[i][-1].argmax()))
    for i, seq in enumerate(seqs):
        reference = hf(torch.tensor([seq[:-1]])).logits[0].float()
        got = torch.stack(ours[i])
        assert got.shape == reference.shape
        scale = max(1.0, reference.abs().max().item())
        assert (got - reference).abs().max().item() <= RTOL * scale, f"sequence {i}"


def test_llama3_rope_scaling_changes_the_logits(hf_models, paged_kv):
    """The llama3 case exercises the scaling: dropping it moves the logits far beyond the tolerance."""
    path, _ = hf_models("llama-llama3-rope")
    config = json.loads((path / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    ks = KernelSet.stock()
    logits = []
    for scaling in (config["rope_scaling"], None):
        model = load_model(path)
        model.config = ModelConfig.from_hf_dict({**config, "rope_scaling": scaling})
        model.build_rope("cpu")
        kv = paged_kv(model.config, num_seqs=1, max_len=32)
        ids, positions, meta = kv.step([list(range(30))])
        with torch.no_grad():
            logits.append(model.compute_logits(model(ids, positions, meta, kv.kv_caches, ks), ks))
    assert (logits[0] - logits[1]).abs().max() > 100 * RTOL * logits[0].abs().max()


def test_sharded_and_single_file_checkpoints_load_the_same_weights(make_checkpoint):
    single = load_model(make_checkpoint("tiny-qwen3-moe", shards=1))
    sharded = load_model(make_checkpoint("tiny-qwen3-moe", shards=4))
    assert len(list((make_checkpoint("tiny-qwen3-moe", shards=4)).glob("model-*.safetensors"))) == 4
    a, b = dict(single.named_parameters()), dict(sharded.named_parameters())
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_weights_cast_to_the_requested_dtype(make_checkpoint):
    path = make_checkpoint("tiny-qwen2")
    fp32, bf16 = load_model(path, dtype=torch.float32), load_model(path, dtype=torch.bfloat16)
    for (name, p32), (_, p16) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert p16.dtype == torch.bfloat16 and torch.equal(p16, p32.to(torch.bfloat16)), name


def test_tied_model_has_no_head_of_its_own(make_checkpoint):
    model = load_model(make_checkpoint("tiny-llama", tie_word_embeddings=True))
    assert model.lm_head is None
    assert "lm_head.weight" not in load_file(make_checkpoint("tiny-llama", tie_word_embeddings=True)
                                             / "model.safetensors")


# ---- loader errors ----------------------------------------------------------------------------------

def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_missing_tensor_is_named(make_checkpoint, tmp_path):
    path = _copy_checkpoint(make_checkpoint("tiny-qwen3"), tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(BadCheckpoint, match=r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_extra_tensor_is_named(make_checkpoint, tmp_path):
    path = _copy_checkpoint(make_checkpoint("tiny-llama"), tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.ones(128, 64)  # a layer config.json does not have
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(BadCheckpoint, match=r"does not use: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(make_checkpoint, tmp_path):
    path = _copy_checkpoint(make_checkpoint("tiny-qwen2"), tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.v_proj.bias"] = torch.ones(31)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(BadCheckpoint, match=r"model\.layers\.0\.self_attn\.v_proj\.bias: shape \(31,\)"):
        load_model(path)


def test_unsupported_architecture_is_named(make_checkpoint, tmp_path):
    path = _copy_checkpoint(make_checkpoint("tiny-llama"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(UnsupportedModel, match="MistralForCausalLM") as err:
        load_model(path)
    assert "vLLM or SGLang" in err.value.diagnostics()


def test_missing_config_key_is_named(make_checkpoint, tmp_path):
    path = _copy_checkpoint(make_checkpoint("tiny-qwen3-moe"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    del config["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadCheckpoint, match="no 'moe_intermediate_size'"):
        load_model(path)


def test_no_weights_file(make_checkpoint, tmp_path):
    path = _copy_checkpoint(make_checkpoint("tiny-llama"), tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(BadCheckpoint, match=r"no \*\.safetensors file"):
        load_model(path)


# ---- configs and the checkpoint writer --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_named_shapes_round_trip_and_map_every_weight(name):
    config = NAMED_SHAPES[name]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    names = checkpoint_names(CausalLM(config, device="meta"))  # raises if a parameter has no source
    assert len(names) >= 3 * config.num_hidden_layers


def test_transformers_v5_rope_parameters_read_the_same():
    d = NAMED_SHAPES["tiny-llama"].to_hf_dict()
    v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**d["rope_scaling"], "rope_theta": d["rope_theta"]}
    assert ModelConfig.from_hf_dict(v5) == NAMED_SHAPES["tiny-llama"]


@pytest.mark.parametrize(("change", "error", "text"), [
    ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModel, "GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModel, "'yarn'"),
    ({"use_sliding_window": True}, UnsupportedModel, "use_sliding_window"),
    ({"num_key_value_heads": 3}, BadCheckpoint, "not a multiple of num_key_value_heads 3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, BadCheckpoint, "low_freq_factor"),
])
def test_config_errors_name_the_key(change, error, text):
    with pytest.raises(error, match=text):
        ModelConfig.from_hf_dict({**NAMED_SHAPES["tiny-llama"].to_hf_dict(), **change})


def test_parameter_counts_of_the_real_shapes():
    counts = {name: NAMED_SHAPES[name].num_parameters / 1e9 for name in NAMED_SHAPES}
    assert 1.23 < counts["llama-3.2-1b"] < 1.24 and 8.02 < counts["llama-3.1-8b"] < 8.04
    assert 30.4 < counts["qwen3-30b-a3b"] < 30.6 and 0.018 < counts["default-20m"] < 0.022


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_same_seed_writes_identical_bytes_even_in_another_process(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", "tiny-qwen3-moe", seed=11, shards=2)
    b = write_random_checkpoint(tmp_path / "b", "tiny-qwen3-moe", seed=11, shards=2)
    code = ("import sys; from detent_audit.engine.checkpoint import write_random_checkpoint as w; "
            "w(sys.argv[1], 'tiny-qwen3-moe', seed=11, shards=2)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True)
    assert _files(a) == _files(b) == _files(tmp_path / "c")
    assert "model.safetensors.index.json" in _files(a)
    other = write_random_checkpoint(tmp_path / "d", "tiny-qwen3-moe", seed=12, shards=2)
    assert _files(other)["config.json"] == _files(a)["config.json"]
    assert _files(other)["model-00001-of-00002.safetensors"] != _files(a)["model-00001-of-00002.safetensors"]


def test_random_weights_are_never_zero_and_norms_sit_near_one(make_checkpoint):
    for name, t in load_file(make_checkpoint("tiny-qwen2") / "model.safetensors").items():
        assert bool((t != 0).all()), name
        if name.endswith("norm.weight"):
            assert 0.5 < t.mean().item() < 1.5, name


def test_default_model_is_written_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path))
    path = ensure_default_model()
    assert path.parent == tmp_path / "models" and [p.name for p in path.parent.iterdir()] == [path.name]
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    model = load_model(path)
    assert model.config == NAMED_SHAPES[DEFAULT_MODEL]
    assert Tokenizer.from_pretrained(path).eos_token_ids == model.config.eos_token_ids


# ---- tokenizer --------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Grüß dich, 世界!\n"}]


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_tokenizer_matches_transformers(make_checkpoint, shape):
    path = make_checkpoint(shape)
    ours, theirs = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    text = "héllo <|im_end|> wörld 🙂"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == theirs.decode(theirs.encode(text))
    for add in (True, False):
        rendered = ours.apply_chat_template(MESSAGES, add_generation_prompt=add)
        assert rendered == theirs.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
        assert ours.encode_chat(MESSAGES, add) == list(
            theirs.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=True, return_dict=False))
    assert ours.eos_token_ids == ModelConfig.from_pretrained(path).eos_token_ids


@pytest.mark.parametrize("fmt", sorted(CHAT_FORMATS))
def test_native_chat_renderers_equal_jinja(fmt):
    f = CHAT_FORMATS[fmt]
    for add in (True, False):
        assert f.render(MESSAGES, f.bos_token, add) == render_jinja(f.template, MESSAGES, f.bos_token,
                                                                    f.eos_tokens[0], add)


def test_padded_vocabulary_ids_decode_to_nothing(make_checkpoint):
    tok = Tokenizer.from_pretrained(make_checkpoint("tiny-llama"))
    assert tok.vocab_size == 261 < NAMED_SHAPES["tiny-llama"].vocab_size
    assert tok.decode([104, 105, 300, 319]) == "hi"
