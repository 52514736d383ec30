"""SGLang's own selection functions (sglang 0.5.21, imported on a CPU with stubs for its CUDA-only modules):
stock's values follow the batch, the plugin's hooks make them the pinned values for every batch of a random
sample; the hook targets exist in the installed SGLang."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from detent_audit.integrations.sglang import control, cpu_kernels, cuda_selection, rescore  # noqa: E402
from detent_audit.integrations.sglang.cuda_selection import CudaHooks  # noqa: E402
from detent_audit.manifests.deployment import load_deployment  # noqa: E402
from detent_audit.selection.compiler import solve  # noqa: E402
from detent_audit.selection.programs import families_for  # noqa: E402
from detent_audit.selection.programs.all_reduce import ORDERED_PATH  # noqa: E402

DEPLOYMENTS = Path(__file__).parents[2] / "manifests" / "deployments"
# CUDA-only packages SGLang imports at module level, stubbed where they are not installed (vLLM's CPU build
# brings a real tvm_ffi, which xgrammar then imports for real)
STUBBED = tuple(p for p in ("sgl_kernel", "tvm_ffi") if importlib.util.find_spec(p) is None)


class _Anything:
    """What a stubbed CUDA module hands out: callable, indexable, never used on the tested paths."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        return _Anything(self._name + "()")

    def __getattr__(self, name: str):
        return _Anything(f"{self._name}.{name}")

    def __getitem__(self, key):
        return _Anything(self._name + "[]")

    def __mro_entries__(self, bases):  # `class X(stub.Base)` at import time
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


@pytest.fixture(scope="module")
def sglang_modules():
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        import sglang.srt.distributed.device_communicators.custom_all_reduce_v2 as v2
        import sglang.srt.distributed.parallel_state as ps
        import sglang.srt.layers.attention.flashattention_backend as fa
        import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config as moe

        yield types.SimpleNamespace(fa=fa, moe=moe, ps=ps, v2=v2)
    finally:
        sys.meta_path.remove(finder)


@pytest.fixture(scope="module")
def qwen_hooks() -> CudaHooks:
    return CudaHooks.build(load_deployment(DEPLOYMENTS / "qwen3-30b-a3b-tp4-h100-sglang.toml"))


@pytest.fixture(scope="module")
def qwen_custom_hooks() -> CudaHooks:
    """The same deployment with a legal tuple that pins one of SGLang's custom all-reduce paths."""
    dep = load_deployment(DEPLOYMENTS / "qwen3-30b-a3b-tp4-h100-sglang.toml")
    spec = next(s for s in families_for(dep) if s.name == "all_reduce")
    result = solve(spec.program, spec.facts(dep), family=spec.name)
    custom = next(a for a in result.legal_assignments() if a["path"].startswith("custom/"))
    return CudaHooks.build(dep, {"all_reduce": custom})


def _resolve(target: str):
    module, _, attr = target.rpartition(".")
    obj = None
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:] + [attr]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def test_every_hook_target_exists_in_the_installed_sglang(sglang_modules):
    for target in (*cpu_kernels.TARGETS, *cuda_selection.TARGETS.values(), control.TARGET, rescore.TARGET):
        assert callable(_resolve(target)), target


def _moe_real(sglang_modules, monkeypatch, m: int) -> dict:
    """SGLang's try_get_optimal_moe_config for Qwen3-30B-A3B's experts at TP4 (E=128, N=192) on an H100."""
    moe = sglang_modules.moe
    monkeypatch.setattr(moe, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(moe, "get_exec", _exec_outside_deterministic_mode)
    moe.get_moe_configs.cache_clear()
    return moe.try_get_optimal_moe_config((128, 384, 2048), (128, 2048, 192), 8, None, m)


def test_moe_config_stock_varies_plugin_pins(sglang_modules, qwen_hooks, monkeypatch):
    rng = random.Random(1)
    sample = [rng.randint(1, 8192) for _ in range(64)] + [1, 8192]
    stock = {m: _moe_real(sglang_modules, monkeypatch, m) for m in sample}
    assert len({tuple(sorted(c.items())) for c in stock.values()}) >= 5  # SGLang's table follows M
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = cuda_selection.TARGETS["moe"]
    kind, hook = qwen_hooks.hooks()[target]
    original = sglang_modules.moe.try_get_optimal_moe_config
    HookRegistry.register(target, hook, HookType[kind])
    try:
        HookRegistry.apply_hooks()
        assert sglang_modules.moe.try_get_optimal_moe_config is not original
        pinned = {m: _moe_real(sglang_modules, monkeypatch, m) for m in sample}
        up, down = qwen_hooks.moe_config(1)
        assert all(c == up for c in pinned.values())
        config, (down_config, block_m) = sglang_modules.moe.try_get_optimal_moe_config(
            (128, 384, 2048), (128, 2048, 192), 8, None, 4096, return_down_config=True)
        assert config == up and down_config == down and block_m == up["BLOCK_SIZE_M"]
        # the pinned row is one of SGLang's own rows (the solver pins the key, not a made-up config)
        assert up in list(stock.values()) or up == _moe_real_unhooked(original, sglang_modules, monkeypatch)
    finally:
        sglang_modules.moe.try_get_optimal_moe_config = original
        HookRegistry._hooks.pop(target, None)
        HookRegistry._patched.discard(target)


def _exec_outside_deterministic_mode():
    """SGLang's runtime config as a server outside --enable-deterministic-inference publishes it."""
    return types.SimpleNamespace(deterministic=types.SimpleNamespace(enable_deterministic_inference=False))


def _moe_real_unhooked(original, sglang_modules, monkeypatch) -> dict:
    monkeypatch.setattr(sglang_modules.moe, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(sglang_modules.moe, "get_exec", _exec_outside_deterministic_mode)
    return original((128, 384, 2048), (128, 2048, 192), 8, None, 1)


def _v2_comm(sglang_modules):
    """A CustomAllReduceV2 with SGLang's own tuned config for 4 GPUs (no device: __init__ is skipped)."""
    from sglang.srt.distributed.device_communicators.configs import custom_all_reduce_v2 as tables

    v2 = sglang_modules.v2
    comm = object.__new__(v2.CustomAllReduceV2)
    base = tables._sm90_configs(132)[4]  # SGLang's H100 (sm90, 132 SMs) table at 4 GPUs
    comm.config = base.clip(max_push_bytes=16 << 20, max_pull_bytes=16 << 20)
    comm.disabled, comm.override_algo, comm.max_size = False, None, 16 << 20
    comm._can_use_graph = lambda: False
    return comm


def test_custom_all_reduce_v2_pick_config_stock_varies_plugin_pins(sglang_modules, qwen_custom_hooks):
    qwen_hooks = qwen_custom_hooks
    comm = _v2_comm(sglang_modules)
    rng = random.Random(2)
    sizes = [rng.randint(1, 8192) * 2048 * 2 for _ in range(64)] + [2048 * 2, 8192 * 2048 * 2]
    stock = {n: sglang_modules.v2.CustomAllReduceV2._pick_config(comm, n, False) for n in sizes}
    assert len(set(stock.values())) >= 2  # SGLang picks the algorithm by message size
    kind, pick = qwen_hooks.hooks()[cuda_selection.TARGETS["pick"]]
    pinned = {pick(comm, n, False) for n in sizes}
    assert len(pinned) == 1
    path = qwen_hooks.tuple["all_reduce"]["path"]
    expected = cuda_selection._V2_ALGOS.get(path)
    got = pinned.pop()
    assert (got is None) if expected is None else (got.algo.name == expected[0])


def test_resolve_all_reduce_method_stock_varies_plugin_pins(sglang_modules, qwen_custom_hooks):
    qwen_hooks = qwen_custom_hooks
    import torch

    comm = _v2_comm(sglang_modules)
    group = object.__new__(sglang_modules.ps.GroupCoordinator)
    group.ca_comm, group.pcie_ipc_comm, group.qr_comm = comm, None, None
    group.pymscclpp_comm, group.torch_symm_mem_comm, group.pynccl_comm = None, None, None
    rng = random.Random(3)
    tensors = [torch.empty(rng.randint(1, 8192), 2048, dtype=torch.bfloat16) for _ in range(48)]
    tensors.append(torch.empty(8192, 2048, dtype=torch.bfloat16))
    method = sglang_modules.ps.GroupCoordinator._resolve_outplace_all_reduce_method
    stock = [method(group, t) for t in tensors]
    assert set(stock) == {"ca", None}  # custom all-reduce for small steps, NCCL above its workspace
    kind, resolve = qwen_hooks.hooks()[cuda_selection.TARGETS["resolve"]]
    pinned = {resolve(group, t) for t in tensors}
    assert len(pinned) == 1
    assert pinned.pop() == ("ca" if qwen_hooks.tuple["all_reduce"]["path"].startswith("custom/") else None)


def test_resolve_refuses_the_ordered_all_reduce_it_does_not_install(sglang_modules, qwen_hooks):
    import torch

    # the default tuple names detent's ordered all-reduce; this process has none, and NCCL would sum in
    # another order than the receipt names
    assert qwen_hooks.tuple["all_reduce"]["path"] == ORDERED_PATH
    group = object.__new__(sglang_modules.ps.GroupCoordinator)
    group.ca_comm = _v2_comm(sglang_modules)
    kind, resolve = qwen_hooks.hooks()[cuda_selection.TARGETS["resolve"]]
    with pytest.raises(RuntimeError, match="does not install"):
        resolve(group, torch.empty(3, 2048, dtype=torch.bfloat16))


def test_fa3_num_splits_pinned_in_init_and_scheduler_metadata(sglang_modules, qwen_hooks):
    """FlashAttentionBackend.__init__ leaves num_splits 0 (FA3's heuristic, which the transcription shows
    following the batch); the hook sets the pinned value, and SGLang's own _compute_scheduler_metadata passes
    it to get_scheduler_metadata for every batch."""
    fa = sglang_modules.fa
    source = Path(fa.__file__).read_text()
    assert "self.num_splits = 1 if deterministic else 0" in source  # what the hook overrides
    from detent_audit.selection.programs import families_for

    dep = qwen_hooks.deployment
    spec = next(s for s in families_for(dep) if s.name == "attention")
    stock_facts = spec.facts(dep)
    rng = random.Random(4)
    points = [cuda_selection._sample_inputs(dep, rng) for _ in range(200)]
    # stock: num_splits 0 -> FA3's own heuristic (the program run as plain Python, nothing pinned) follows the
    # batch, in the static bound and in each sequence's dynamic split
    stock = {(spec.program(stock_facts, **p).num_splits, spec.program(stock_facts, **p).num_splits_dynamic)
             for p in points}
    assert len({a for a, _ in stock}) > 1 and len({b for _, b in stock}) > 1
    splits = qwen_hooks.fa3_num_splits()
    kind, init_hook = qwen_hooks.hooks()[cuda_selection.TARGETS["fa3"]]
    backend = object.__new__(fa.FlashAttentionBackend)
    backend.num_splits = backend.decode_num_splits = 0  # what __init__ leaves outside deterministic mode
    init_hook(None, backend)
    assert backend.num_splits == splits and backend.decode_num_splits == splits
    seen = []
    backend._get_scheduler_metadata = lambda **kw: seen.append(kw["num_splits"])
    backend.use_mla, backend._disable_scheduler_metadata_precompute = False, False
    backend.num_attention_heads, backend.num_kv_heads, backend.head_dim = 8, 1, 128
    backend.kv_cache_dtype, backend.page_size, backend.has_softcap = None, 1, False
    for p in points[:50]:
        fa.FlashAttentionBackend._compute_scheduler_metadata(backend, p["num_seqs"], p["max_seqlen_k"], None,
                                                             None)
    assert seen == [splits] * 50
    # the compiled selector itself gives the pinned value at every sampled batch
    assert {qwen_hooks.selectors["attention"](**p).num_splits for p in points} == {splits}
