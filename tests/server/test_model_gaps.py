"""What a new user met serving a real checkpoint: the context length is settable and reported, an unseeded
sampled request gets a derived seed (returned and signed), receipts name their model and a verdict says which
`--model` to pass, chat templates are read where checkpoints keep them, GGUF input errors are clear."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.errors import BadInput
from detent_audit.manifests.receipt import verify_envelope
from detent_audit.runtime.gguf_import import import_gguf
from detent_audit.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from conftest import Env

runner = CliRunner()


def test_max_model_len_is_settable_reported_and_defaults_to_the_models_own(env: Env, start_server,
                                                                          tmp_path: Path) -> None:
    # its positions
    assert LLM(EngineConfig(model=str(env.checkpoint))).scheduler.config.max_model_len == 4096
    with start_server(tmp_path / "out", max_model_len=1000) as live:
        models = httpx.get(f"{live.url}/v1/models").json()
        assert models["data"][0]["max_model_len"] == 1000
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": [5] * 1000, "max_tokens": 1})
        assert r.status_code == 400 and "maximum context length is 1000" in r.json()["error"]["message"]


def test_serve_refuses_a_context_beyond_the_models_positions(env: Env, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    res = runner.invoke(app, ["serve", "--model", str(env.checkpoint),
                              "--signing-key", str(env.key.private_path),
                              "--manifest-out", str(tmp_path / "run"), "--input", str(tmp_path / "in.jsonl"),
                              "--output", str(tmp_path / "out.jsonl"), "--max-model-len", "5000"])
    assert res.exit_code == 2 and "exceeds the model's 4096 positions" in res.stderr, res.output


def test_unseeded_sampled_requests_get_derived_seeds_returned_and_signed(env: Env, start_server,
                                                                        tmp_path: Path) -> None:
    from detent_audit.manifests.receipt import ClientRequest
    from detent_audit.manifests.seeds import derived_seed

    unseeded = [{"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 1.0},
                {"prompt": [3, 4, 6], "max_tokens": 4, "temperature": 1.0}]
    with start_server(tmp_path / "out") as live:
        bodies = [httpx.post(f"{live.url}/v1/completions", json=b).json() for b in [*unseeded, unseeded[0]]]
        greedy = httpx.post(f"{live.url}/v1/completions",
                            json={"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0}).json()
        seeded = httpx.post(f"{live.url}/v1/completions",
                            json={"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 1.0,
                                  "seed": 77}).json()
        run_id = live.node.run_id
    # the run's and the body's: the same body in one run draws the same seed, another body another
    api = "openai/v1/completions"
    expected = [derived_seed(run_id, api, ClientRequest.of(api, b).body_sha256)
                for b in [*unseeded, unseeded[0]]]
    seeds = [b["seed"] for b in bodies]
    assert seeds == expected and seeds[0] != seeds[1] and greedy["seed"] == 0 and seeded["seed"] == 77
    for body in [*bodies, seeded]:
        raw = (tmp_path / "out" / "receipts" / f"{body['receipt_id']}.receipt").read_bytes()
        assert verify_envelope(raw, env.trusted).receipt.request.seed == body["seed"]


def test_receipt_names_its_model_and_the_verdict_says_which_to_pass(env: Env, make_checkpoint, tmp_path: Path
                                                                   ) -> None:
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt_token_ids": [3, 4, 5], "max_tokens": 3}\n')
    res = runner.invoke(app, ["serve", "--model", str(env.checkpoint),
                              "--signing-key", str(env.key.private_path),
                              "--manifest-out", str(tmp_path / "run"), "--input", str(tmp_path / "in.jsonl"),
                              "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 0, res.output
    receipt = verify_envelope((tmp_path / "run" / "receipts" / "a.receipt").read_bytes(), env.trusted).receipt
    checkpoint = receipt.deployment_facts["checkpoint"]
    assert checkpoint["name"] == env.checkpoint.name and checkpoint["source"] == str(env.checkpoint.resolve())
    other = make_checkpoint("tiny-llama", seed=9)
    res = runner.invoke(app, ["verify", str(tmp_path / "run" / "receipts" / "a.receipt"), "--key",
                              str(env.key.public_path), "--model", str(other), "--json"])
    outcome = json.loads(res.stdout)["outcomes"][0]
    assert res.exit_code == 3 and outcome["fields"] == ["checkpoint.weights"]
    assert f"served from the checkpoint '{env.checkpoint.name}'" in outcome["message"]
    assert "pass --model with a copy of that checkpoint folder" in outcome["message"]
    # the same weights in another folder (another name and source) are the same model
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in env.checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    res = runner.invoke(app, ["verify", str(tmp_path / "run"), "--key", str(env.key.public_path),
                              "--model", str(copy)])
    assert res.exit_code == 0 and "2 ok" in res.stdout, res.output


def test_chat_template_from_chat_template_jinja_or_a_named_list(make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint("tiny-qwen3")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match="no chat template"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]"
                                                "{% endfor %}")
    hi = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_pretrained(folder).apply_chat_template(hi) == "[user:hi]"
    (folder / "chat_template.jinja").unlink()
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "<{{ messages[0]['content'] }}>"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(folder).apply_chat_template(hi) == "<hi>"


def test_gguf_import_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(BadInput, match="is not a GGUF file: it starts with"):
        import_gguf(not_gguf, tmp_path / "out")
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(BadInput, match="truncated or corrupt"):
        import_gguf(short, tmp_path / "out")
    with pytest.raises(BadInput, match="cannot import as float16"):
        import_gguf(short, tmp_path / "out", "float16")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(BadInput, match="exists and is not an empty folder"):
        import_gguf(short, tmp_path / "taken")
    assert not (tmp_path / "out").exists()  # nothing half-written
    res = runner.invoke(app, ["import-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and res.stderr.startswith("FAIL: ") and "no such GGUF file" in res.stderr


def test_verify_without_model_uses_the_random_shape_the_receipt_names(env: Env, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt_token_ids": [3, 4, 5], "max_tokens": 3}\n')
    res = runner.invoke(app, ["serve", "--model", "random:tiny-llama",
                              "--signing-key", str(env.key.private_path),
                              "--manifest-out", str(tmp_path / "run"), "--input", str(tmp_path / "in.jsonl"),
                              "--output", str(tmp_path / "out.jsonl"), "--cache-dir", str(env.cache_dir)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["verify", str(tmp_path / "run"), "--key", str(env.key.public_path), "--json",
                              "--cache-dir", str(env.cache_dir)])
    report = json.loads(res.stdout)
    assert res.exit_code == 0 and report["counts"]["OK"] == 2, report["outcomes"]
