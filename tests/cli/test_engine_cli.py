"""The engine-facing commands: info, battery, generate, keygen, inspect (exit codes and outputs)."""

from __future__ import annotations

import json
import os
import stat

from typer.testing import CliRunner

from detent_audit.cli import app

runner = CliRunner()


def test_info_prints_facts_and_a_stable_hash(make_checkpoint) -> None:
    path = str(make_checkpoint("tiny-qwen3"))
    first = runner.invoke(app, ["info", "--model", path, "--json"])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    facts = doc["facts"]
    assert facts["runtime"]["num_threads"] == 1 and facts["engine"]["mode"] == "detent"
    assert set(facts["checkpoint"]) == {"config", "tokenizer", "weights", "eos_token_ids", "name", "source"}
    assert facts["checkpoint"]["name"] == os.path.basename(path) and facts["checkpoint"]["source"] == path
    assert "embedded.gemm" in facts["tuple"]
    again = json.loads(runner.invoke(app, ["info", "--model", path, "--json"]).stdout)
    assert again["facts_hash"] == doc["facts_hash"]
    bf16 = json.loads(runner.invoke(app, ["info", "--model", path, "--json", "--dtype", "bfloat16"]).stdout)
    assert bf16["facts_hash"] != doc["facts_hash"]


def test_battery_exit_codes(make_checkpoint) -> None:
    path = str(make_checkpoint("tiny-llama"))
    ok = runner.invoke(app, ["battery", "--model", path, "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["passed"] == 35
    stock = runner.invoke(app, ["battery", "--model", path, "--mode", "stock", "--json"])
    assert stock.exit_code == 1 and json.loads(stock.stdout)["passed"] < 35


def test_bad_mode_is_one_line_exit_2(make_checkpoint) -> None:
    res = runner.invoke(app, ["info", "--model", str(make_checkpoint("tiny-llama")), "--mode", "fast"])
    assert res.exit_code == 2 and res.stderr.startswith("FAIL: mode must be detent, stock or det")


def test_missing_model_folder_is_exit_2(tmp_path) -> None:
    res = runner.invoke(app, ["info", "--model", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.stderr.startswith("FAIL: ")


def test_keygen_creates_0600_key_and_refuses_to_overwrite(tmp_path) -> None:
    out = tmp_path / "node.key"
    res = runner.invoke(app, ["keygen", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600 and (tmp_path / "node.key.pub").exists()
    before = out.read_bytes()
    again = runner.invoke(app, ["keygen", "--out", str(out)])
    assert again.exit_code == 2 and out.read_bytes() == before


def test_keygen_with_passphrase_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NODE_PASS", "correct horse")
    res = runner.invoke(app, ["keygen", "--out", str(tmp_path / "k"), "--passphrase-env", "NODE_PASS"])
    assert res.exit_code == 0
    assert b"ENCRYPTED" in (tmp_path / "k").read_bytes()
    res = runner.invoke(app, ["keygen", "--out", str(tmp_path / "k2"), "--passphrase-env", "UNSET_VAR_X"])
    assert res.exit_code == 2 and "UNSET_VAR_X is not set" in res.stderr


def test_inspect_garbage_is_exit_2(tmp_path) -> None:
    f = tmp_path / "x.receipt"
    f.write_bytes(b"garbage")
    res = runner.invoke(app, ["inspect", str(f)])
    assert res.exit_code == 2 and res.stderr.startswith("FAIL: ")
