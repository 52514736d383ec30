"""Receipts served under the portable ISA setting on another class of CPU (tests/fixtures/portable/xeon/: an
Intel Xeon with AVX-512 and AMX, torch 2.11.0+cu130's CPU kernels, `--isa portable serve --model random-20m
--input tests/fixtures/portable/requests.jsonl` signed with the compat fixtures' test-only key;
benchmarks/isa_device.sh) are checked here by the verifier under the same setting, on whatever CPU runs the
tests.

Their ISA fact is the setting's, whatever CPU served them, so it never makes them not comparable: where this
torch build and kernel sources are theirs they verify bit for bit (they did on an AMD EPYC with AVX2 only:
docs/isa.md); elsewhere the verdict names the facts that differ (the torch build, the kernels' sources) and
never the ISA (not comparable, exit 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detent_audit import isa
from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.verifier.receipt_file import open_receipt

FIXTURES = Path(__file__).parent / "fixtures"
RECEIPTS = sorted((FIXTURES / "portable" / "xeon").glob("*.receipt"))
KEY = FIXTURES / "compat" / "test-only-node.key.pub"
X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def test_the_receipts_name_the_cap_and_the_fixed_order_kernels() -> None:
    trusted = load_trusted_keys(KEY)
    assert len(RECEIPTS) == 4
    for path in RECEIPTS:
        receipt = open_receipt(path, trusted)
        runtime = receipt.deployment_facts["runtime"]
        assert runtime["isa"] == isa.PORTABLE_ISA and "cpu_capability" not in runtime
        assert receipt.tuple_values["embedded.gemm"]["embedded.gemm.form"] == "fixed"
        assert len(runtime["fixed_order"]) == 3


@pytest.mark.skipif(not X86, reason="the cap is x86's AVX2")
def test_the_verifier_under_the_cap_finds_no_isa_difference() -> None:
    """Under the cap, the ISA is never why they are not comparable: they verify (bits equal) where every other
    fact is this machine's, else the verdict names the other facts (the torch build, the kernels' sources)."""
    env = {k: v for k, v in os.environ.items() if k not in isa.PORTABLE_ENV and k != isa.ENV}
    done = subprocess.run([sys.executable, "-m", "detent_audit.cli", "--isa", "portable", "verify",
                           *map(str, RECEIPTS), "--key", str(KEY), "--model", "random-20m", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    outcomes = json.loads(done.stdout)["outcomes"]
    assert len(outcomes) == 4, done.stderr[-2000:]
    if done.returncode == 0:
        assert all(o["status"] == "OK" for o in outcomes)
        return
    assert done.returncode == 3, done.stdout + done.stderr
    served_torch = open_receipt(RECEIPTS[0], load_trusted_keys(KEY)).deployment_facts["runtime"]["torch"]
    for outcome in outcomes:
        assert outcome["status"] == "NOT_COMPARABLE" and outcome["fields"], outcome
        assert not [f for f in outcome["fields"] if f in ("runtime.isa", "runtime.cpu_capability")], outcome
        # another torch build, or other kernel or selection sources than the ones they were served with
        assert ("runtime.torch" in outcome["fields"] or served_torch == str(torch.__version__)
                or any(f.startswith("engine.sources") for f in outcome["fields"])), outcome
