"""`detent-audit tune`: profiles a workload, measures within the budget, commits a legal tuple the engine
and `serve` accept; bad input is exit 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.tuples import load_tuple

runner = CliRunner()


def _workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(5, 5 + n)), "max_tokens": 4,
                                          "ignore_eos": True}) for n in (3, 20, 45, 9)))
    return path


def test_tune_commits_a_legal_tuple(make_checkpoint, tmp_path) -> None:
    ckpt = str(make_checkpoint("tiny-qwen3-moe"))
    out = tmp_path / "t.tuple"
    res = runner.invoke(app, ["tune", "--model", ckpt, "--workload", str(_workload(tmp_path)),
                              "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    fams = {r["family"]: r for r in doc["families"]}
    assert set(fams) == {"embedded.attention", "embedded.gemm", "embedded.moe"}
    for r in fams.values():
        assert r["measured"] <= r["grid_size"] and r["tuned_cost"] <= r["default_cost"]
    committed = load_tuple(out)
    assert committed == doc["tuple"]
    llm = LLM(EngineConfig(model=ckpt, tuple=committed))  # the engine checks legality on load
    assert llm.selection.tuple == committed
    again = runner.invoke(app, ["tune", "--model", ckpt, "--workload", str(_workload(tmp_path)),
                                "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.stderr


def test_exhaustive_measures_the_whole_grid(make_checkpoint, tmp_path) -> None:
    res = runner.invoke(app, ["tune", "--model", str(make_checkpoint("tiny-llama")), "--workload",
                              str(_workload(tmp_path)), "--out", str(tmp_path / "x.tuple"), "--exhaustive",
                              "--json"])
    assert res.exit_code == 0, res.output
    for r in json.loads(res.stdout)["families"]:
        assert r["measured"] == r["grid_size"]


def test_bad_workload_line_is_exit_2(make_checkpoint, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2], "temperature": -1}\n')
    res = runner.invoke(app, ["tune", "--model", str(make_checkpoint("tiny-llama")), "--workload", str(bad),
                              "--out", str(tmp_path / "y.tuple")])
    assert res.exit_code == 2 and "bad.jsonl:1" in res.stderr


def test_streaming_attention_without_a_gpu_is_exit_2(make_checkpoint, tmp_path) -> None:
    """--attention-streaming names a mode of the GPU kernel: on the CPU, tune and serve refuse it, with the
    reason, before any work (the deployment would claim a backend the engine does not run)."""
    ckpt = str(make_checkpoint("tiny-llama"))
    res = runner.invoke(app, ["tune", "--model", ckpt, "--workload", str(_workload(tmp_path)), "--out",
                              str(tmp_path / "s.tuple"), "--attention-streaming"])
    assert res.exit_code == 2 and "GPU attention" in res.stderr
    assert not (tmp_path / "s.tuple").exists()
    key = tmp_path / "node.key"
    assert runner.invoke(app, ["keygen", "--out", str(key)]).exit_code == 0
    res = runner.invoke(app, ["serve", "--model", ckpt,
                              "--signing-key", str(key), "--manifest-out", str(tmp_path / "run"),
                              "--input", str(_workload(tmp_path)), "--output", str(tmp_path / "o.jsonl"),
                              "--attention-streaming"])
    assert res.exit_code == 2 and "GPU attention" in res.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_concurrency_profiles_each_level_and_bad_levels_are_exit_2(make_checkpoint, tmp_path) -> None:
    ckpt = str(make_checkpoint("tiny-llama"))
    out = tmp_path / "c.tuple"
    res = runner.invoke(app, ["tune", "--model", ckpt, "--workload", str(_workload(tmp_path)),
                              "--out", str(out), "--concurrency", "1, all", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["concurrency"] == [1, "all"]
    assert load_tuple(out) == json.loads(res.stdout)["tuple"]
    for bad in ("0", "2,x", "", "1.5"):
        res = runner.invoke(app, ["tune", "--model", ckpt, "--workload", str(_workload(tmp_path)), "--out",
                                  str(tmp_path / "bad.tuple"), "--concurrency", bad])
        assert res.exit_code == 2 and "--concurrency" in res.stderr, (bad, res.output)
        assert not (tmp_path / "bad.tuple").exists()
