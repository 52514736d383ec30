"""Bits that do not depend on the x86 CPU, in every engine (embedded, vLLM, SGLang): under the portable ISA
setting each runs the project's fixed-order kernels, so moving the libraries' own choices of code below this
CPU's, as another CPU's would be, leaves every token and logprob bit where it was.

Each engine serves `tests/fixtures/portable/requests.jsonl` (greedy, top logprobs, chat, seeded sampling) in
a child process (the libraries read their caps once, when they load):
- with `--isa portable` in a clean environment;
- with the cap set from the environment and the libraries moved as on another CPU: MKL on its AVX branch
  (`MKL_CBWR=AVX`, below the cap's AVX2: its products and its vector math take other code) and, for vLLM, the
  kernels it builds for AVX2 CPUs (`_C_AVX2`, which it loads on a CPU without AVX-512) in place of this CPU's.

The two must agree bit for bit, the first's receipts must verify where the libraries moved, and the facts
must name the cap and the fixed-order kernels (not the CPU model). The RoPE tables, whose angles reach past
1e4 only in long contexts, are checked directly: each hosted engine's hook rewrites them in the C order.
The control: natively, the same moves change the served bits wherever they take effect on this CPU (MKL's
reproducibility branches are Intel's; vLLM's library choice is only a move on an AVX-512 CPU), so the moves
reach the products the engine would otherwise make.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from detent_audit import isa
from detent_audit.kernels import fixed_order_implementations
from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.verifier.receipt_file import open_receipt

FIXTURES = Path(__file__).parents[1] / "fixtures"
REQUESTS = FIXTURES / "portable" / "requests.jsonl"
KEY = FIXTURES / "compat" / "test-only-node.key"
X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

# the CLI in a child; argv[1] == "avx2": vLLM loads its kernels for AVX2 CPUs, as it does on a CPU without
# AVX-512 (vllm/platforms/cpu.py chooses the library by `torch.cpu._is_avx512_supported()`)
CHILD = """
import sys
if sys.argv[1] == "avx2":
    import torch
    torch.cpu._is_avx512_supported = lambda: False
sys.argv = ["detent-audit", *sys.argv[2:]]
from detent_audit.cli import main
main()
"""
# an MKL product's bits: whether MKL_CBWR=AVX moves MKL's code on this CPU
PROBE = """
import hashlib, torch
torch.manual_seed(0); torch.set_num_threads(1)
print(hashlib.sha256((torch.randn(7, 1536) @ torch.randn(1536, 576)).numpy().tobytes()).hexdigest())
"""
CAP = {**isa.PORTABLE_ENV, isa.ENV: "portable"}
MOVED = {"MKL_CBWR": "AVX"}


def _engine_installed(engine: str) -> bool:
    return engine == "embedded" or importlib.util.find_spec(engine) is not None


ENGINES = [pytest.param(e, marks=pytest.mark.skipif(not _engine_installed(e), reason=f"{e} is not installed"))
           for e in ("embedded", "vllm", "sglang")]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in isa.PORTABLE_ENV and k != isa.ENV and not k.startswith("MKL_CBWR")}


def _serve(engine: str, out: Path, *isa_option: str, avx2_kernels: bool = False, **env: str
           ) -> tuple[list[dict], list[Path]]:
    """The responses (in request order) and receipts of one child serving the portable requests."""
    key = out.parent / "node.key"
    if not key.exists():
        shutil.copyfile(KEY, key)
        key.chmod(0o600)
    responses = out.with_suffix(".jsonl")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "avx2" if avx2_kernels else "-", *isa_option, "serve",
         "--engine", engine, "--model", "random-20m", "--signing-key", str(key), "--manifest-out", str(out),
         "--input", str(REQUESTS), "--output", str(responses)],
        env={**_clean_env(), **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in responses.read_text().splitlines()]
    return rows, sorted((out / "receipts").glob("*.receipt"))


def _bits(rows: list[dict]) -> list[tuple]:
    """Each response's id, tokens, and the float32 bits of its logprobs and top logprobs."""
    def f32(values: list[float]) -> list[int]:
        return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()
    return [(r["id"], r["token_ids"], f32(r["logprobs"]),
             [[(t, f32([lp])[0]) for t, lp in top] for top in r.get("top_logprobs") or []]) for r in rows]


def _mkl_moves() -> bool:
    def probe(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", PROBE], env={**_clean_env(), **env}, capture_output=True,
                              text=True, timeout=120, check=True)
        return done.stdout.strip()
    return probe({}) != probe(MOVED)


@pytest.mark.skipif(not X86, reason="the cap is x86's AVX2")
@pytest.mark.parametrize("engine", ENGINES)
def test_under_the_cap_the_bits_do_not_follow_the_libraries_code(engine: str, tmp_path: Path) -> None:
    portable, receipts = _serve(engine, tmp_path / "option", "--isa", "portable")
    moved, _ = _serve(engine, tmp_path / "moved", avx2_kernels=engine == "vllm", **CAP, **MOVED)
    assert len(portable) == 4 and all(r["token_ids"] for r in portable)
    assert _bits(portable) == _bits(moved)
    # the receipts served with the option verify where the libraries moved (bits equal on re-execution)
    done = subprocess.run([sys.executable, "-c", CHILD, "avx2" if engine == "vllm" else "-", "verify",
                           *map(str, receipts), "--key", str(KEY.with_suffix(".key.pub")),
                           "--model", "random-20m", "--json"],
                          env={**_clean_env(), **CAP, **MOVED}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [o["status"] for o in json.loads(done.stdout)["outcomes"]] == ["OK"] * len(receipts)
    trusted = load_trusted_keys(KEY.with_suffix(".key.pub"))
    for path in receipts:
        runtime = open_receipt(path, trusted).deployment_facts["runtime"]
        assert runtime["isa"] == isa.PORTABLE_ISA and "cpu_capability" not in runtime
        assert list(runtime["fixed_order"]) == fixed_order_implementations() and "cpu_model" not in runtime

    # the control: natively, the moves change the bits where they move a library on this CPU
    vllm_moves = engine == "vllm" and torch.backends.cpu.get_cpu_capability() == "AVX512"
    if not (_mkl_moves() or vllm_moves):
        pytest.skip("neither move takes effect on this CPU (MKL's CBWR branches are Intel's), so the native "
                    "control has nothing to show")
    native, _ = _serve(engine, tmp_path / "native", "--isa", "native")
    native_moved, _ = _serve(engine, tmp_path / "native-moved", "--isa", "native",
                             avx2_kernels=engine == "vllm", **MOVED)
    assert _bits(native) != _bits(native_moved), "the moves did not reach the native engine's products"



def _table_check(rope: torch.nn.Module, replace: Any) -> None:
    """`replace` (the engine's hook) rewrites the RoPE table in the C order (cos then sin of each position
    times each frequency) and leaves it within 1 ULP of torch's."""
    from detent_audit.kernels.rowlocal import fixed_order_cos_sin

    before = rope.cos_sin_cache.clone()
    replace(rope)
    positions = torch.arange(before.shape[0], dtype=torch.float32)
    assert torch.equal(rope.cos_sin_cache, fixed_order_cos_sin(positions, rope._compute_inv_freq(rope.base)))
    slip = (rope.cos_sin_cache.view(torch.int32).long() - before.view(torch.int32).long()).abs()
    assert int(slip.max()) <= 1


@pytest.mark.skipif(not _engine_installed("vllm"), reason="vllm is not installed")
def test_vllms_rope_tables_are_rewritten_in_the_c_order() -> None:
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from detent_audit.integrations.vllm import plugin

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=16384, is_neox_style=True, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})

    def replace(module: torch.nn.Module) -> None:
        model = torch.nn.ModuleList([module, module])  # one table, shared by the layers, rewritten once
        assert plugin.fixed_order_rope(SimpleNamespace(model_runner=SimpleNamespace(model=model))) == 1
    _table_check(rope, replace)


@pytest.mark.skipif(not _engine_installed("sglang"), reason="sglang is not installed")
def test_sglangs_rope_tables_are_rewritten_in_the_c_order() -> None:
    from types import SimpleNamespace

    from sglang.srt.layers.rotary_embedding import get_rope

    from detent_audit.integrations.sglang.cpu_kernels import fixed_order_rope_tables

    rope = get_rope(64, rotary_dim=64, max_position=16384, base=500000, is_neox_style=True,
                    dtype=torch.float32)
    _table_check(rope, lambda module: fixed_order_rope_tables(None, SimpleNamespace(model=module)))
    with pytest.raises(RuntimeError, match="no RoPE table"):
        fixed_order_rope_tables(None, SimpleNamespace(model=torch.nn.Linear(2, 2)))
