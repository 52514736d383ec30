"""The ISA a deployment runs on: pinned before torch loads (`detent_audit.isa`), recorded in the facts, and
the first request of an engine served on the form every later one is.

Each ISA setting runs in its own process (torch's libraries read their caps once, when they initialise). No
test assumes the CPU's class: the cap is AVX2, which every x86-64 CPU the project serves on has (AVX2 and
AVX-512 alike); what a cap lower than the CPU's changes is stated by the facts, not assumed of the bits.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detent_audit import isa
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams

X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
# a child: the entry point's pin (argv after the model), then the engine's facts and one greedy answer's bits
CHILD = """
import json, struct, sys
from detent_audit import isa
isa.pin(isa.requested(sys.argv[2:]))
from detent_audit.engine.deployment_facts import collect_facts
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams
llm = LLM(EngineConfig(model=sys.argv[1], mode="detent"))
out = llm.generate([[5, 9, 33, 2, 71, 18, 4, 250, 17, 3]], SamplingParams(temperature=0.0, max_tokens=8))[0]
facts = collect_facts(llm)
print(json.dumps({"runtime": facts["runtime"], "tuple": facts["tuple"], "tokens": out.token_ids,
                  "bits": list(struct.unpack(f"<{len(out.logprobs)}I", struct.pack(f"<{len(out.logprobs)}f",
                                                                              *out.logprobs)))}))
"""


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("tiny-llama", seed=5)


def _child(checkpoint: Path, *argv: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in isa.PORTABLE_ENV and k != isa.ENV}
    done = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), *argv], env={**clean, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_setting_is_read_from_the_option_before_the_command_else_the_environment() -> None:
    assert isa.requested([], {}) == isa.DEFAULT == "native"
    assert isa.requested(["--isa", "portable", "serve", "--isa", "native"], {}) == "portable"
    assert isa.requested(["--isa=native"], {isa.ENV: "portable"}) == "native"
    assert isa.requested(["-v", "info"], {isa.ENV: "portable"}) == "portable"
    with pytest.raises(BadInput, match="not an ISA setting"):
        isa.requested(["--isa", "avx512"], {})


def test_native_removes_an_inherited_cap_but_no_users_own_setting() -> None:
    assert isa.environment("portable")["ATEN_CPU_CAPABILITY"] == "avx2"
    inherited = isa.environment("native", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert inherited == {isa.ENV: "native", "ATEN_CPU_CAPABILITY": None, "ONEDNN_MAX_CPU_ISA": None}
    assert isa.environment("native", {"ATEN_CPU_CAPABILITY": "default"}) == {isa.ENV: "native"}


def test_a_verdict_says_why_an_isa_differs_and_how_to_serve_portably() -> None:
    capped, avx512, avx2 = {"isa": isa.PORTABLE_ISA}, {"cpu_capability": "AVX512"}, {"cpu_capability": "AVX2"}
    assert isa.hint(capped, capped) is None and isa.hint(avx2, avx2) is None
    assert "verify with --isa portable" in str(isa.hint(capped, avx2))
    assert "serve with --isa portable" in str(isa.hint(avx512, avx2))
    assert "serve with --isa portable" in str(isa.hint(avx2, capped))
    assert isa.hint("not a mapping", avx2) is None


@pytest.mark.skipif(not X86, reason="the cap is x86's AVX2")
def test_the_cap_from_the_option_equals_the_cap_from_the_environment(checkpoint) -> None:
    option = _child(checkpoint, "--isa", "portable")
    environment = _child(checkpoint, **{isa.ENV: "portable"})
    assert option["runtime"]["isa"] == environment["runtime"]["isa"] == isa.PORTABLE_ISA
    assert "cpu_capability" not in option["runtime"]
    # the project's fixed-order kernels, no CPU's probe in the tuple
    assert option["tuple"]["embedded.gemm"]["embedded.gemm.form"] == "fixed"
    assert option["runtime"]["fixed_order"] == environment["runtime"]["fixed_order"]
    assert len(option["runtime"]["fixed_order"]) == 3
    assert (option["tokens"], option["bits"]) == (environment["tokens"], environment["bits"])


@pytest.mark.skipif(not X86, reason="the cap is x86's AVX2")
def test_a_lower_cap_than_the_portable_one_is_another_fact(checkpoint) -> None:
    """ATen's `default` kernels (no AVX2) under a native setting: the facts name that capability, so no
    receipt of it is compared with a capped one (none of the libraries promises the bits of another
    capability)."""
    lower = _child(checkpoint, "--isa", "native", ATEN_CPU_CAPABILITY="default")
    assert lower["runtime"]["cpu_capability"] == "DEFAULT" and "isa" not in lower["runtime"]
    assert isa.hint(lower["runtime"], {"isa": isa.PORTABLE_ISA}) is not None


@pytest.mark.skipif(not X86, reason="the cap is x86's AVX2")
def test_the_entry_point_re_executes_when_torch_loaded_before_the_cap(checkpoint) -> None:
    code = ("import sys, torch; sys.argv = ['detent-audit', '--isa', 'portable', 'info', '--model', "
            "sys.argv[1], '--json']; from detent_audit.cli import main; main()")
    clean = {k: v for k, v in os.environ.items() if k not in isa.PORTABLE_ENV and k != isa.ENV}
    done = subprocess.run([sys.executable, "-c", code, str(checkpoint)], env=clean, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["facts"]["runtime"]["isa"] == isa.PORTABLE_ISA


def test_the_first_request_of_an_engine_equals_its_hundredth(checkpoint) -> None:
    """The GEMM form is proven on the model's shapes before the engine serves, so the first request runs on
    the form every later one does: request 1 of a fresh engine equals request 100 of another fresh engine,
    served after 99 others of every length."""
    rng = random.Random(7)
    target = [rng.randrange(1, 256) for _ in range(29)]
    others = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 70))] for _ in range(99)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = LLM(EngineConfig(model=str(checkpoint), mode="detent")).generate([target], params)[0]
    later = LLM(EngineConfig(model=str(checkpoint), mode="detent"))
    later.generate(others, SamplingParams(temperature=0.0, max_tokens=2))
    hundredth = later.generate([target], params)[0]
    assert first.token_ids == hundredth.token_ids
    assert torch.equal(torch.tensor(first.logprobs, dtype=torch.float32),
                       torch.tensor(hundredth.logprobs, dtype=torch.float32))
