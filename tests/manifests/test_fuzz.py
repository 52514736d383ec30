"""The fuzz of benchmarks/fuzz_verify.py, a small tier: mutated and bomb receipts and manifests under a 1 GiB
address-space cap, each refused with a named error (or decoded into a well-formed document), never a crash."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import random  # noqa: E402
import time  # noqa: E402

from fuzz_verify import bomb, read, run_capped  # noqa: E402

from detent_audit.errors import DetentError  # noqa: E402


def test_fuzzed_receipts_and_manifests_under_a_memory_cap_are_named_errors() -> None:
    result = run_capped(400, seed=7, memory_gib=1.0, timeout=600)
    assert result["crashes"] == 0, result["crash_examples"]
    assert sum(result["outcomes"].values()) == 400
    assert set(result["outcomes"]) <= {"decoded", "InvalidReceipt", "InvalidManifest", "BadSignature",
                                       "UntrustedKey"}
    assert result["time_s"]["max"] < 30


def test_3_4_every_bomb_kind_is_refused_in_bounded_time() -> None:
    """Nested, wide and declared-length bombs (up to 1 MiB here; the 64 MiB ones below and in the benchmark),
    before and after the signature: each a named error, fast."""
    import time

    rng = random.Random(3)
    seen = set()
    for _ in range(60):
        name, data = bomb(rng, max_size=1 << 20)
        seen.add(name)
        start = time.perf_counter()
        for kind in ("receipt", "manifest"):
            try:
                read(kind, data)
            except DetentError:
                continue
            raise AssertionError(f"the bomb {name} decoded as a {kind}")
        assert time.perf_counter() - start < 10, name
    assert len(seen) >= 10


def test_3_a_64_mib_envelope_of_nested_empty_arrays_is_refused_in_little_memory_and_time() -> None:
    import tracemalloc

    from detent_audit.manifests.errors import InvalidReceipt
    from detent_audit.manifests.receipt import verify_envelope

    for data in (b"\x9f" * (64 << 20), b"\x91" * (20 << 20) + b"\xc0",
                 b"\xdd" + (64 << 20).to_bytes(4, "big") + b"\x90" * ((64 << 20) - 5)):
        tracemalloc.start()
        start = time.perf_counter()
        try:
            verify_envelope(data, {})
        except InvalidReceipt as exc:
            reasons = ("nested deeper", "longer than the limit", "truncated")
            assert any(reason in exc.message for reason in reasons)
        else:
            raise AssertionError("a bomb decoded")
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 128 << 20 and elapsed < 2.0, (peak, elapsed)  # (one copy of the input at most)


def test_4_a_1001_byte_nest_is_a_named_error_in_inspect_and_verify(tmp_path) -> None:
    from typer.testing import CliRunner

    from detent_audit.cli import app
    from detent_audit.manifests.keys import generate_key

    path = tmp_path / "nest.receipt"
    path.write_bytes(b"\x91" * 1000 + b"\xc0")
    res = CliRunner().invoke(app, ["inspect", str(path)])
    assert res.exit_code == 2 and "nested deeper than 32" in res.output and "Traceback" not in res.output
    assert not isinstance(res.exception, RecursionError)
    key = generate_key(tmp_path / "k.key")
    res = CliRunner().invoke(app, ["verify", str(path), "--key", str(key.public_path), "--json"])
    assert res.exit_code == 2 and "RecursionError" not in res.output and "nested deeper" in res.output
