"""Long runs' progress on stderr: a line every tenth of the run with its rate when stderr is no terminal, and
the end; through `verify` itself, piped."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from detent_audit.cli.output import PIPED_EVERY, Progress


def test_a_piped_run_prints_a_line_per_tenth_with_its_rate(capsys: pytest.CaptureFixture[str]) -> None:
    total = random.randint(30, 300)
    with Progress("re-executing", "receipts", terminal=False) as progress:
        for done in range(1, total + 1):
            progress.update(done, total)
    lines = capsys.readouterr().err.splitlines()
    assert 10 <= len(lines) <= 11 and lines[-1].startswith(f"re-executing: {total}/{total} receipts (")
    assert all(re.fullmatch(r"re-executing: \d+/\d+ receipts \(\d+\.\d receipts/s\)", line) for line in lines)
    with Progress("battery", "cells", terminal=False) as progress:  # a length not known: every PIPED_EVERY
        for _ in range(2 * PIPED_EVERY + 3):
            progress.advance()
    assert [line.split(" ")[1] for line in capsys.readouterr().err.splitlines()] == [
        str(PIPED_EVERY), str(2 * PIPED_EVERY), str(2 * PIPED_EVERY + 3)]


def test_verify_piped_shows_its_progress_on_stderr(make_checkpoint, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from detent_audit.cli import app
    from detent_audit.manifests.keys import generate_key

    key = generate_key(tmp_path / "node.key")
    lines = [f'{{"id": "r{i}", "prompt_token_ids": [3, 4, {5 + i}], "max_tokens": 2}}' for i in range(3)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    model = str(make_checkpoint("tiny-llama"))
    served = CliRunner().invoke(app, ["serve", "--model", model, "--signing-key", str(key.private_path),
                                      "--manifest-out", str(tmp_path / "run"),
                                      "--input", str(tmp_path / "in.jsonl"),
                                      "--output", str(tmp_path / "out.jsonl")])
    assert served.exit_code == 0, served.output
    res = subprocess.run([sys.executable, "-m", "detent_audit.cli", "verify", str(tmp_path / "run"),
                          "--key", str(key.public_path), "--model", model, "--workers", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^re-executing: 3/3 receipts \(\d+\.\d receipts/s\)$", res.stderr, re.M), res.stderr
    assert "re-executing" not in res.stdout


def test_verify_reports_each_batch_as_it_ends_with_the_rate(make_checkpoint, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A run of several batches, piped: a line as each batch of receipts ends (its count and the rate so far),
    not one at the end only."""
    from typer.testing import CliRunner

    from detent_audit.cli import app
    from detent_audit.manifests.keys import generate_key, load_trusted_keys
    from detent_audit.verifier import plan
    from detent_audit.verifier.verify import verify

    key = generate_key(tmp_path / "node.key")
    n = random.randint(5, 7)
    lines = [f'{{"id": "r{i}", "prompt_token_ids": [3, {4 + i}], "max_tokens": 2}}' for i in range(n)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    model = str(make_checkpoint("tiny-llama"))
    served = CliRunner().invoke(app, ["serve", "--model", model, "--signing-key", str(key.private_path),
                                      "--manifest-out", str(tmp_path / "run"),
                                      "--input", str(tmp_path / "in.jsonl"),
                                      "--output", str(tmp_path / "out.jsonl")])
    assert served.exit_code == 0, served.output
    monkeypatch.setattr(plan, "BATCH", 2)
    capsys.readouterr()
    with Progress("re-executing", "receipts", terminal=False) as progress:
        report = verify([tmp_path / "run"], load_trusted_keys(key.public_path), model=model, workers=1,
                        progress=progress.update)
    assert report.exit_code == 0, report.counts()
    err = capsys.readouterr().err.splitlines()
    done = [int(m.group(1)) for line in err if (m := re.fullmatch(rf"re-executing: (\d+)/{n} receipts "
                                                                  r"\(\d+\.\d receipts/s\)", line))]
    assert done == [*range(2, n, 2), n], err
