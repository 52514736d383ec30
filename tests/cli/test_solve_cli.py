"""`detent-audit solve`: the table, --json, the cache, and one-line errors with exit code 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.manifests.deployment import shipped_deployments

runner = CliRunner()
DEP = str(shipped_deployments()["llama-3.1-70b-instruct-tp4-h100-sglang"])


def test_json_report_and_cache_hit(tmp_path) -> None:
    args = ["solve", "--deployment", DEP, "--family", "all_reduce", "--json", "--cache-dir", str(tmp_path)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)["families"]
    assert [r["family"] for r in report] == ["all_reduce"]
    r = report[0]
    for key in ("num_values", "selection_points", "batch_dependent_points", "pins", "candidate_count",
                "legal_count", "solve_seconds", "cache"):
        assert key in r
    assert r["cache"] == "miss" and r["legal_count"] >= 1
    second = json.loads(runner.invoke(app, args).stdout)["families"][0]
    assert second["cache"] == "hit" and second["pins"] == r["pins"]


def test_table_output(tmp_path) -> None:
    out = runner.invoke(app, ["solve", "--deployment", DEP, "--family", "all_reduce", "--cache-dir",
                              str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "all_reduce" in out.stdout and "legal" in out.stdout


def test_missing_file_is_one_line_exit_2(tmp_path) -> None:
    out = runner.invoke(app, ["solve", "--deployment", str(tmp_path / "nope.toml")])
    assert out.exit_code == 2
    assert out.stderr.startswith("FAIL: ")
    assert "nope.toml" in out.stderr.splitlines()[0]


def test_unknown_family_and_ablation_exit_2(tmp_path) -> None:
    out = runner.invoke(app, ["solve", "--deployment", DEP, "--family", "nonsense"])
    assert out.exit_code == 2 and "no family ['nonsense']" in out.stderr
    args = ["solve", "--deployment", DEP, "--ablate", "bogus", "--cache-dir", str(tmp_path)]
    out = runner.invoke(app, args)
    assert out.exit_code == 2 and "unknown ablation 'bogus'" in out.stderr


def test_malformed_deployment_names_the_field(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    text = open(DEP).read().replace("num_kv_heads", "num_kv_headz", 1)
    bad.write_text(text)
    out = runner.invoke(app, ["solve", "--deployment", str(bad)])
    assert out.exit_code == 2
    assert "num_kv_heads" in out.stderr


def test_untranscribed_attention_is_exit_3_not_zero_pins(tmp_path) -> None:
    # vLLM with Triton attention: no program transcribes it, so there is no answer (never "0 pins")
    base = shipped_deployments()["llama-3.1-8b-instruct-tp1-h100-vllm"].read_text()
    bad = tmp_path / "triton.toml"
    bad.write_text(base.replace('attention_backend                = "fa3"',
                                'attention_backend                = "triton"')
                   .replace("uses_vllm_fa_fork                = true",
                            "uses_vllm_fa_fork                = false"))
    out = runner.invoke(app, ["solve", "--deployment", str(bad), "--cache-dir", str(tmp_path)])
    assert out.exit_code == 3, out.output
    assert "backend 'triton'" in out.stderr and "not transcribed" in out.stderr


def test_table_lists_candidate_counts_and_folded_constants(tmp_path) -> None:
    b200 = str(shipped_deployments()["llama-3.1-8b-instruct-tp1-b200-vllm"])
    out = runner.invoke(app, ["solve", "--deployment", b200, "--family", "attention", "--json",
                              "--cache-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    (r,) = json.loads(out.stdout)["families"]
    assert r["program"] == "flashinfer_prefill" and r["pins"], r
    assert all(len(p["candidates"]) > 1 for p in r["pins"]) and "constants" in r
