"""Receipts served under the portable ISA setting on an Intel Xeon with AVX-512 and AMX, checked here by the
verifier under the same setting on whatever CPU runs the tests (an AVX2-only AMD EPYC among them):
- `tests/fixtures/portable/xeon/`: the embedded engine, torch 2.11.0+cu130's CPU kernels (the H200 host's
  Xeon, `benchmarks/isa_device.sh`);
- `tests/fixtures/portable/intel-avx512/<engine>/`: the embedded engine, vLLM and SGLang, torch 2.13.0+cpu (a
  2-core Xeon; `bash benchmarks/portable_receipts.sh`).
Each is `--isa portable serve --engine E --model random-20m --input tests/fixtures/portable/requests.jsonl`,
signed with the compat fixtures' test-only key.

Their ISA fact is the setting's, whatever CPU served them, so it never makes them not comparable: where this
torch build and the kernels' and plugin's sources are theirs they verify bit for bit; elsewhere the verdict
names the facts that differ (the torch build, the sources) and never the ISA or the CPU model (not
comparable, exit 3)."""

from __future__ import annotations

import importlib.util
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
PORTABLE = FIXTURES / "portable"
KEY = FIXTURES / "compat" / "test-only-node.key.pub"
X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
# folder -> the engine that served it (its facts' `engine.name`: the embedded engine's is detent-audit)
SERVED = {"xeon": "detent-audit", "intel-avx512/embedded": "detent-audit", "intel-avx512/vllm": "vllm",
          "intel-avx512/sglang": "sglang"}


def _sets() -> list:
    def missing(engine: str) -> bool:
        return engine != "detent-audit" and importlib.util.find_spec(engine) is None
    return [pytest.param(folder, engine, id=folder,
                         marks=pytest.mark.skipif(missing(engine), reason=f"{engine} is not installed"))
            for folder, engine in SERVED.items()]


def _receipts(folder: str) -> list[Path]:
    return sorted((PORTABLE / folder).glob("*.receipt"))


@pytest.mark.parametrize(("folder", "engine"), _sets())
def test_the_receipts_name_the_cap_and_the_fixed_order_kernels(folder: str, engine: str) -> None:
    trusted = load_trusted_keys(KEY)
    assert len(_receipts(folder)) == 4
    for path in _receipts(folder):
        receipt = open_receipt(path, trusted)
        facts = receipt.deployment_facts
        runtime = facts["runtime"]
        assert facts["engine"]["name"] == engine
        assert runtime["isa"] == isa.PORTABLE_ISA and "cpu_capability" not in runtime
        assert "cpu_model" not in runtime  # nothing of the BLAS: no CPU model to match
        assert receipt.tuple_values["embedded.gemm"]["embedded.gemm.form"] == "fixed"
        assert len(runtime["fixed_order"]) == 3


@pytest.mark.skipif(not X86, reason="the cap is x86's AVX2")
@pytest.mark.parametrize(("folder", "engine"), _sets())
def test_the_verifier_under_the_cap_finds_no_cpu_difference(folder: str, engine: str) -> None:
    """Under the cap, neither the ISA nor the CPU is why they are not comparable: they verify (bits equal)
    where every other fact is this machine's, else the verdict names the other facts (the torch build, the
    kernels' or plugin's sources)."""
    receipts = _receipts(folder)
    env = {k: v for k, v in os.environ.items() if k not in isa.PORTABLE_ENV and k != isa.ENV}
    done = subprocess.run([sys.executable, "-m", "detent_audit.cli", "--isa", "portable", "verify",
                           *map(str, receipts), "--key", str(KEY), "--model", "random-20m", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    outcomes = json.loads(done.stdout)["outcomes"]
    assert len(outcomes) == 4, done.stderr[-2000:]
    if done.returncode == 0:
        assert all(o["status"] == "OK" for o in outcomes)
        return
    assert done.returncode == 3, done.stdout + done.stderr
    for outcome in outcomes:
        assert outcome["status"] == "NOT_COMPARABLE" and outcome["fields"], outcome
        assert not [f for f in outcome["fields"]
                    if f in ("runtime.isa", "runtime.cpu_capability", "runtime.cpu_model")], outcome
        # another torch build, or other kernel, plugin or selection sources than those they were served with
        assert ("runtime.torch" in outcome["fields"]
                or any("sources" in f for f in outcome["fields"])), outcome
