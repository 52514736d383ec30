"""Malformed inputs to `verify --deployment` and `verify-eval` are bad input: `FAIL:` naming the file (and
line or field), exit 2, never a traceback; a FIFO named like an input is refused, never waited on."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from typer.testing import CliRunner, Result

from detent_audit.cli import app

STAMP = "2026-01-01T00-00-00.000001"
SAMPLE = {
    "doc_id": 0,
    "doc": {"question": "1+1?", "answer": "2"},
    "arguments": {"gen_args_0": {"arg_0": "Q: 1+1? A:", "arg_1": " 2"}},
    "resps": [[["-0.5", "True"]]],
    "filtered_resps": [["-0.5", "True"]],
    "acc": 1.0,
}
RESULTS = {
    "results": {"task": {"acc,none": 1.0}},
    "config": {"model": "local-completions", "model_args": "model=m,base_url=http://127.0.0.1:1"},
}


@pytest.fixture
def public_key(tmp_path: Path) -> Path:
    path = tmp_path / "node.pub"
    path.write_bytes(
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    return path


def _invoke(args: list[str]) -> Result:
    """The command in a thread that must end in 60 s (a FIFO opened for reading would block forever)."""
    out: dict[str, Result] = {}
    worker = threading.Thread(
        target=lambda: out.setdefault("res", CliRunner().invoke(app, args)), daemon=True
    )
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), f"{args[0]} blocked"
    return out["res"]


def _refused(res: Result, *fragments: str) -> None:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2 and "FAIL:" in res.output, res.output
    for fragment in fragments:
        assert fragment in res.output, res.output


def _deployment(path: Path) -> None:
    (path / "d").mkdir()
    (path / "not-json.json").write_text("{facts")
    (path / "list.json").write_text("[1, 2]")
    (path / "nan.json").write_text('{"facts": {"max_model_len": NaN}, "hash": "' + "0" * 64 + '"}')
    (path / "hash-int.json").write_text(json.dumps({"facts": {}, "hash": 5}))
    os.mkfifo(path / "fifo.json")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("nan.json", "its facts are not deployment facts"),
        ("not-json.json", "not JSON"),
        ("list.json", "expected a published deployment"),
        ("hash-int.json", "expected a published deployment"),
        ("d", "not a regular file"),
        ("fifo.json", "not a regular file"),
        ("missing.json", "No such file"),
        ("A" * 64, "cannot read published deployment"),
    ],
)
def test_a_malformed_published_deployment_is_bad_input(
    tmp_path: Path, public_key: Path, spec: str, says: str
) -> None:
    _deployment(tmp_path)
    (tmp_path / "r.receipt").write_bytes(b"")
    target = spec if len(spec) == 64 else str(tmp_path / spec)
    _refused(
        _invoke(["verify", str(tmp_path / "r.receipt"), "--key", str(public_key), "--deployment", target]),
        says,
    )


def _run(folder: Path, results: str | None = None, samples: str | bytes | None = None) -> Path:
    """An lm-eval output folder: its results file and one task's samples file (as given, else valid)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"results_{STAMP}.json").write_text(json.dumps(RESULTS) if results is None else results)
    samples = json.dumps(SAMPLE) + "\n" if samples is None else samples
    (folder / f"samples_task_{STAMP}.jsonl").write_bytes(
        samples if isinstance(samples, bytes) else samples.encode()
    )
    return folder


def _sample(**changed) -> str:
    return json.dumps({**SAMPLE, **changed}) + "\n"


def _without(key: str) -> str:
    return json.dumps({k: v for k, v in SAMPLE.items() if k != key}) + "\n"


EVAL_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "samples-not-utf8": (lambda p: _run(p, samples=b"\x00\xff{}"), "not UTF-8 text"),
    "samples-not-jsonl": (lambda p: _run(p, samples="doc 0: 1+1=2\n"), ":1: not JSON"),
    "sample-a-list": (lambda p: _run(p, samples="[1, 2]\n"), ":1: expected a JSON object"),
    "sample-without-resps": (lambda p: _run(p, samples=_without("resps")), "no resps"),
    "sample-without-doc": (lambda p: _run(p, samples=_without("doc")), "no doc"),
    "doc-id-text": (lambda p: _run(p, samples=_sample(doc_id="zero")), "doc_id: expected a whole number"),
    "arguments-a-number": (lambda p: _run(p, samples=_sample(arguments=7)), "arguments: expected an object"),
    "arguments-bad-keys": (
        lambda p: _run(p, samples=_sample(arguments={"gen_args_x": {"arg_0": "a"}})),
        "expected the keys gen_args_0",
    ),
    "prompt-a-number": (lambda p: _run(p, samples=_sample(arguments=[[5, " 2"]])), "the prompt (a string"),
    "resps-short": (lambda p: _run(p, samples=_sample(resps=[])), "resps: expected a list of 1 lists"),
    "samples-empty": (lambda p: _run(p, samples="\n"), "no logged sample"),
    "results-empty": (lambda p: _run(p, results=""), "not JSON"),
    "results-a-list": (lambda p: _run(p, results="[]"), "expected a JSON object"),
    "results-of-a-task-a-list": (
        lambda p: _run(p, results=json.dumps({**RESULTS, "results": {"task": []}})),
        "results.task: expected a JSON object",
    ),
    "model-args-a-number": (
        lambda p: _run(p, results=json.dumps({**RESULTS, "config": {"model_args": 3}})),
        "config.model_args",
    ),
}


@pytest.mark.parametrize("kind", sorted(EVAL_CASES))
def test_a_malformed_lm_eval_run_is_bad_input(tmp_path: Path, public_key: Path, kind: str) -> None:
    make, says = EVAL_CASES[kind]
    run = make(tmp_path / "run")
    (tmp_path / "receipts").mkdir()
    _refused(
        _invoke(
            ["verify-eval", str(run), "--receipts", str(tmp_path / "receipts"), "--key", str(public_key)]
        ),
        says,
    )


@pytest.mark.parametrize("which", ["samples", "results", "receipt"])
def test_a_fifo_named_like_an_lm_eval_file_or_a_receipt_is_refused_not_waited_on(
    tmp_path: Path, public_key: Path, which: str
) -> None:
    run = _run(tmp_path / "run")
    (tmp_path / "receipts").mkdir()
    if which == "samples":
        (run / f"samples_task_{STAMP}.jsonl").unlink()
        os.mkfifo(run / f"samples_task_{STAMP}.jsonl")
        says = "not a regular file"
    elif which == "results":
        (run / f"results_{STAMP}.json").unlink()
        os.mkfifo(run / f"results_{STAMP}.json")
        says = "not a regular file"
    else:
        os.mkfifo(tmp_path / "receipts" / "x.receipt")
        says = "no receipt under"
    _refused(
        _invoke(
            ["verify-eval", str(run), "--receipts", str(tmp_path / "receipts"), "--key", str(public_key)]
        ),
        says,
    )


def test_a_line_separator_inside_a_logged_string_ends_no_line(tmp_path: Path) -> None:
    """JSON lines end at a newline only: a U+2028 that lm-eval writes unescaped inside a document stays in
    it."""
    from detent_audit.verifier.eval_inputs import read_samples

    path = tmp_path / f"samples_task_{STAMP}.jsonl"
    path.write_text(json.dumps({**SAMPLE, "doc": {"question": "1+1?\u2028A:"}}, ensure_ascii=False) + "\n")
    (sample,) = read_samples(path)
    assert sample["doc"]["question"] == "1+1?\u2028A:"
