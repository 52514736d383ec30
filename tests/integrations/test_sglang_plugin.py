"""The SGLang plugin's parts that need no running SGLang: its configuration, the entry point, the stand-in,
the torchvision fix, what verify refuses before SGLang starts (the real server: test_sglang_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.integrations.sglang.config import ENV, PluginConfig
from detent_audit.runtime.threads import set_threads

pytest.importorskip("sglang")


def test_config_round_trips_through_the_environment():
    config = PluginConfig(mode="detent", model_path="/m", num_threads=2,
                          tuple={"embedded.gemm": {"chunk_rows": 16}}, report_dir="/r")
    assert PluginConfig.from_env({ENV: config.to_env()}) == config
    assert PluginConfig.from_env({}) is None  # unset: stock SGLang


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"), ("[1]", "must be a JSON object"),
    (json.dumps({"mode": "det", "model_path": "/m"}), "is not one of"),
    (json.dumps({"mode": "detent", "model_path": "/m", "num_threads": 0}), "positive integer"),
    (json.dumps({"mode": "detent", "model_path": "/m", "extra": 1}), "unknown or missing fields"),
])
def test_bad_configuration_is_refused(text, message):
    with pytest.raises(BadInput, match=message):
        PluginConfig.from_env({ENV: text})


def test_entry_point_names_the_plugin():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("detent") == "detent_audit.integrations.sglang.plugin:register"


@pytest.mark.parametrize("shadow_real", [False, True])
def test_stand_in_where_vllm_is_missing_or_shadowed_and_raises_if_called(shadow_real):
    """Without `shadow_real` (the launcher) an installed vLLM is left alone; with it (SGLang's children) the
    stand-in is what `vllm._custom_ops` is, and its kernel raises."""
    code = ("import importlib.util, sys\n"
            "from detent_audit.integrations.sglang.stand_ins import install_stand_ins\n"
            "real = importlib.util.find_spec('vllm') is not None\n"
            f"installed = install_stand_ins(shadow_real={shadow_real})\n"
            f"expect_stand_in = {shadow_real} or not real\n"
            "assert (installed != []) == expect_stand_in, installed\n"
            "from vllm._custom_ops import rotary_embedding\n"
            "assert install_stand_ins(shadow_real=True) == []"
            "  # idempotent, and never over an imported vLLM\n"
            "if expect_stand_in:\n"
            "    try:\n"
            "        rotary_embedding()\n"
            "    except RuntimeError as e:\n"
            "        assert 'stand-in' in str(e)\n"
            "    else:\n"
            "        raise SystemExit('the stand-in ran')\n"
            "else:\n"
            "    assert not getattr(sys.modules['vllm'], '__detent_stand_in__', False)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torchvision_imports_beside_cpu_torch():
    """PyPI's torchvision (a CUDA build) fails to import beside the CPU torch without the hook, and imports
    with it, its C++ ops reported absent."""
    code = "import torchvision, torchvision.transforms; print(torchvision.extension._has_ops())"
    unhook = ("import sys\nfrom detent_audit.integrations.sglang import torchvision_cpu as t\n"
              "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, t._Finder)]\n")
    bare = subprocess.run([sys.executable, "-c", unhook + code], capture_output=True, text=True)
    hooked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert hooked.returncode == 0, hooked.stderr[-800:]
    assert hooked.stdout.strip() == "False"
    assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr


def _served_facts(**over) -> dict:
    """An SGLang receipt's facts as far as verify reads them before SGLang starts."""
    from detent_audit.integrations.sglang import sglang_version
    from detent_audit.runtime.facts import format_facts

    facts = {"engine": {"name": "sglang", "version": sglang_version()}, "runtime": {"num_threads": 1},
             "format": format_facts(),
             "scheduler": {"max_model_len": 2048, "max_num_seqs": 64, "chunked_prefill_size": 8192,
                           "prefix_caching": True},
             "checkpoint": {"name": "random-20m", "source": "generated:default-20m", "config": "0" * 64,
                            "tokenizer": {"tokenizer.json": "0" * 64},
                            "weights": "tensors-sha256:" + "0" * 64}}
    for path, value in over.items():
        node = facts
        *parents, leaf = path.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return facts


@pytest.mark.parametrize("over, tuple_mode, kwargs, error, fields_or_message", [
    ({"engine__version": "0.0.1"}, "detent", {}, "NotComparable", ["engine.version"]),
    ({}, "stock", {}, "NotComparable", ["tuple.mode.name"]),
    ({}, "detent", {"threads": 2}, "NotComparable", ["runtime.num_threads"]),
    ({"runtime__num_threads": True}, "detent", {}, "BadInput", "not a thread count"),
    ({"scheduler__max_num_seqs": 1 << 30}, "detent", {}, "BadInput", "scheduler.max_num_seqs is 1073741824"),
    ({"scheduler__chunked_prefill_size": 0}, "detent", {}, "BadInput", "chunked_prefill_size is 0"),
    ({"scheduler__prefix_caching": "yes"}, "detent", {}, "BadInput", "not a boolean"),
    # other weights: refused from the file hashes, before SGLang starts, with the --model to pass
    ({}, "detent", {}, "NotComparable", ["checkpoint.config", "checkpoint.tokenizer.generation_config.json",
                                         "checkpoint.tokenizer.tokenizer.json",
                                         "checkpoint.tokenizer.tokenizer_config.json", "checkpoint.weights"]),
])
def test_verify_refuses_before_sglang_starts(over, tuple_mode, kwargs, error, fields_or_message, monkeypatch):
    from detent_audit.integrations.sglang import engine
    from detent_audit.verifier.reconstruct import NotComparable, reconstruct

    def never(*args, **kwargs):
        raise AssertionError("SGLang was started for a receipt refused from its facts")

    monkeypatch.setattr(engine.SglangEngine, "__init__", never)
    with pytest.raises(NotComparable if error == "NotComparable" else BadInput) as exc:
        reconstruct(_served_facts(**over), {"mode": {"name": tuple_mode}}, None, **kwargs)
    if isinstance(fields_or_message, list):
        assert exc.value.fields == fields_or_message
        if fields_or_message[0].startswith("checkpoint."):
            assert "pass --model random-20m" in exc.value.message
    else:
        assert fields_or_message in exc.value.message


def test_launcher_gets_no_hook_and_the_scheduler_control_sets_the_chunk_size(tmp_path):
    """register() in the launcher applies nothing; in SGLang's own process (stock mode) only the scheduler
    control, whose `set_internal_state` sets the chunked-prefill size, refuses it while a chunked prefill is
    in flight or for a non-positive size, and leaves every other request to SGLang."""
    code = f"""
import json, os, types
from detent_audit.integrations.sglang import control, plugin
from detent_audit.integrations.sglang.config import ENV, PluginConfig

os.environ[ENV] = PluginConfig(mode="stock", model_path="/m", report_dir={str(tmp_path)!r},
                               launcher_pid=os.getpid()).to_env()
plugin.register()
report = json.load(open(os.path.join({str(tmp_path)!r}, f"{{os.getpid()}}.json")))
assert report["hooks"] == [] and report["error"] is None, report

os.environ[ENV] = PluginConfig(mode="stock", model_path="/m", launcher_pid=os.getpid() + 1).to_env()
plugin.register()
assert plugin.REPORT["hooks"] == [control.TARGET] and plugin.REPORT["error"] is None, plugin.REPORT
from sglang.srt.managers.io_struct import SetInternalStateReq
from sglang.srt.managers.scheduler import Scheduler

sched = types.SimpleNamespace(chunked_prefill_size=8192, chunked_req=None)
def ask(value):
    req = SetInternalStateReq(server_args={{control.CHUNK_KEY: value}})
    return Scheduler.set_internal_state(sched, req).updated
assert ask(7) and sched.chunked_prefill_size == 7
assert not ask(0) and not ask(True) and sched.chunked_prefill_size == 7
sched.chunked_req = object()
assert not ask(64) and sched.chunked_prefill_size == 7
called = []
res = control.set_internal_state(lambda s, r: called.append(r) or "sglang's", sched,
                                 SetInternalStateReq(server_args={{"pp_max_micro_batch_size": 2}}))
assert res == "sglang's" and called, res
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-1500:]


def test_the_gemm_shapes_are_the_products_sglang_fuses(tmp_path):
    """The shapes the GEMM form is proven on at start: the checkpoint's weights as SGLang's Llama multiplies
    them (q, k, v stacked into one QKV projection, gate and up into one), the output and down projections and
    the LM head (the embedding where it is tied)."""
    from safetensors import safe_open

    from detent_audit.engine.checkpoint import write_random_checkpoint
    from detent_audit.integrations.sglang.selection import sglang_gemm_shapes
    from detent_audit.runtime.model_config import ModelConfig

    write_random_checkpoint(tmp_path, "default-20m", 0)
    weights = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            weights.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})

    def rows(*names):
        shapes = [weights[f"model.layers.0.{n}.weight"] for n in names]
        assert len({k for _, k in shapes}) == 1
        return sum(n for n, _ in shapes), shapes[0][1]
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    expected = {rows("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), rows("self_attn.o_proj"),
                rows("mlp.gate_proj", "mlp.up_proj"), rows("mlp.down_proj"), head}
    assert sglang_gemm_shapes(ModelConfig.from_pretrained(tmp_path)) == sorted(expected)


def test_the_hook_proves_a_gemm_shape_on_first_use_and_anew_at_another_thread_count(monkeypatch):
    """A pad-form product of a shape the start did not prove is proven on its first call: it then has the
    pad form's bits; a BLAS whose rows change bits at some M is refused; at two threads the pad form is
    refused."""
    from detent_audit.integrations.sglang.cpu_kernels import CpuHooks
    from detent_audit.kernels import gemm, gemm_probe
    from detent_audit.kernels.params import GemmParams

    pad = GemmParams(4, "pad")

    class Kernels:
        def select_gemm(self, num_tokens: int) -> GemmParams:
            return pad

    threads = torch.get_num_threads()
    set_threads(1)
    try:
        if not gemm_probe.check(pad, [(40, 24)]).ok:
            pytest.skip("pad:4 does not hold on this CPU")
        hooks = CpuHooks(Kernels(), attention="torch")
        x, w, b = torch.randn(3, 24), torch.randn(40, 24), torch.randn(40)
        assert torch.equal(hooks._linear(x, w, b), gemm.linear(x, w, b, params=pad))
        assert (pad, 40, 24, torch.float32, 1) in hooks._proven
        real = gemm.linear

        def linear(x, w, bias=None, *, params=None):  # a BLAS whose rows change bits at 33 rows
            out = real(x, w, bias, params=params)
            return out + 1 if x.shape[0] == 33 else out
        monkeypatch.setattr(gemm, "linear", linear)
        monkeypatch.setattr(gemm_probe, "_MEMO", {})
        with pytest.raises(gemm_probe.GemmFormNotInvariant, match="M=33"):
            hooks._linear(torch.randn(3, 32), torch.randn(48, 32), None)
        monkeypatch.undo()
        set_threads(2)
        with pytest.raises(gemm_probe.GemmFormNotInvariant, match="2 threads"):
            hooks._linear(x, w, b)
    finally:
        set_threads(threads)


def test_the_hook_proves_nothing_during_a_request_on_the_shapes_proven_at_start(monkeypatch):
    """The model's shapes are proven at start (`selection.cpu_selection`): the hooks built with them run the
    first product of each without a probe; only a shape outside them is proven, before its first product."""
    from detent_audit.integrations.sglang.cpu_kernels import CpuHooks
    from detent_audit.kernels import gemm, gemm_probe
    from detent_audit.kernels.params import GemmParams

    pad = GemmParams(4, "pad")

    class Kernels:
        def select_gemm(self, num_tokens: int) -> GemmParams:
            return pad

    proofs: list[tuple] = []
    monkeypatch.setattr(gemm_probe, "require",
                        lambda params, shapes, dtype, what="": proofs.append(shapes[0]))
    hooks = CpuHooks(Kernels(), attention="torch", proven_shapes=[(40, 24), (24, 40)])
    x, w = torch.randn(3, 24), torch.randn(40, 24)
    assert torch.equal(hooks._linear(x, w, None), gemm.linear(x, w, params=pad))
    hooks._linear(torch.randn(5, 40), torch.randn(24, 40), None)
    assert proofs == []
    hooks._linear(torch.randn(2, 16), torch.randn(8, 16), None)
    assert proofs == [(8, 16)]


def test_the_attention_form_a_receipt_names():
    from detent_audit.integrations.sglang.engine import SglangConfig, attention_names, attention_of_facts
    from detent_audit.kernels import attention_c

    assert attention_of_facts(attention_c.IMPLEMENTATION) == "c"
    assert attention_of_facts("torch-tiled") == "torch"
    assert attention_of_facts(None) == "torch"  # receipts from before the C form ran the torch one
    assert set(attention_names()) == {"c", "torch"}
    with pytest.raises(BadInput, match="is not one this detent-audit runs"):
        attention_of_facts("c-fixed-order-v0")
    with pytest.raises(BadInput, match="attention must be one of"):
        SglangConfig(model="m", attention="fast")
    with pytest.raises(BadInput, match="attention"):
        PluginConfig(mode="detent", model_path="/m", attention="fast")


def test_the_limits_travel_to_the_plugin_and_bad_ones_are_refused():
    config = PluginConfig(mode="detent", model_path="/m", max_model_len=4096, max_num_seqs=8,
                          max_num_batched_tokens=9000)
    assert PluginConfig.from_env({ENV: config.to_env()}) == config
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(BadInput, match=f"{name} must be a positive integer"):
            PluginConfig(mode="detent", model_path="/m", **{name: 0})


def test_the_selection_is_solved_for_the_served_context():
    """The deployment the CPU kernels are solved for has SGLang's context (within the model's own), its
    running requests, and at least the default tokens of one step (a smaller chunk set while SGLang runs
    changes no fact)."""
    from detent_audit.integrations.hosted import checkpoint_folder
    from detent_audit.integrations.sglang.selection import Limits, cpu_deployment

    path = checkpoint_folder("smollm2-135m-instruct", None, "SGLang").path
    for asked, solved in ((4096, 4096), (1 << 20, 8192)):  # SmolLM2's own context: 8192
        engine = cpu_deployment(path, 1, Limits.served(asked, 16, 512)).engine
        limits = (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens)
        assert limits == (solved, 16, 8192)
    assert Limits.served(4096, 64, 16384).max_num_batched_tokens == 16384
    assert cpu_deployment(path, 1).to_canonical() == cpu_deployment(path, 1, Limits.served(2048, 64, 8192)
                                                                    ).to_canonical()


class _Req:
    """The part of SGLang's `Req` the context guard reads and calls."""

    def __init__(self, prompt: int, max_new: int) -> None:
        self.origin_input_ids = list(range(prompt))
        self.sampling_params = type("Params", (), {"max_new_tokens": max_new})()
        self.to_finish = None

    # SGLang's: status 400, the prompt cut to a token
    def set_finish_with_abort(self, error_msg: str) -> None:
        self.to_finish, self.origin_input_ids = error_msg, [0]


def test_the_scheduler_refuses_a_request_beyond_the_solved_context_and_no_other():
    """The last step of a request attends to prompt + output - 1 tokens: a request is refused exactly when
    that exceeds the context, through SGLang's abort; one SGLang refused already is left alone."""
    import random

    from detent_audit.integrations.sglang.guard import TARGET, ContextGuard

    limit = random.randint(64, 4096)
    guard = ContextGuard(limit)
    assert guard.hooks() == {TARGET: ("AFTER", guard.after_max_new_tokens)}
    for prompt, max_new, refused in ((limit - 9, 10, False), (limit - 9, 11, True), (limit + 1, 1, True),
                                     (1, limit, False), (1, limit + 1, True)):
        req = _Req(prompt, max_new)
        assert guard.after_max_new_tokens("kept", None, req) == "kept"
        assert (req.to_finish is not None) == refused, (prompt, max_new)
        if refused:
            assert f"context of {limit} tokens" in req.to_finish and "--context-length" in req.to_finish
    earlier = _Req(limit * 2, 5)
    earlier.to_finish = "SGLang's own reason"
    guard.after_max_new_tokens(None, None, earlier)
    assert earlier.to_finish == "SGLang's own reason"


def test_sglang_config_prints_the_server_and_the_plugin_configuration():
    """`detent-audit sglang-config`: the environment (the plugin's configuration with the limits, the threads;
    stock mode leaves SGLang's settings alone) and `sglang.launch_server` with the same limits."""
    from typer.testing import CliRunner

    from detent_audit.cli import app

    res = CliRunner().invoke(app, ["sglang-config", "--model", "smollm2-135m-instruct", "--mode", "stock",
                                   "--max-model-len", "3000", "--max-running-requests", "8", "--threads", "2",
                                   "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    config = PluginConfig.from_env(doc["env"])
    assert config is not None and config.mode == "stock" and config.launcher_pid is None
    assert (config.max_model_len, config.max_num_seqs, config.num_threads) == (3000, 8, 2)
    assert doc["env"]["OMP_NUM_THREADS"] == "2" and "SGLANG_ENABLE_FAST_INPUT_LOGPROBS" not in doc["env"]
    argv = doc["argv"]
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    flags = {flag: (value if not value.startswith("--") else True)
             for flag, value in zip(argv[3:], [*argv[4:], "--"], strict=True) if flag.startswith("--")}
    assert flags["--disable-cuda-graph"] is True and flags["--device"] == "cpu"
    assert float(flags["--watchdog-timeout"]) >= 3600  # a long prefill on a busy CPU outlasts SGLang's 300 s
    assert flags["--context-length"] == "3000" and flags["--max-running-requests"] == "8"
    assert flags["--model-path"] == config.model_path and flags["--page-size"] == "1"
    text = CliRunner().invoke(app, ["sglang-config", "--model", "smollm2-135m-instruct", "--mode", "stock"])
    assert text.exit_code == 0 and "export DETENT_SGLANG=" in text.stdout and "no receipts" in text.stdout
    refused = CliRunner().invoke(app, ["sglang-config", "--mode", "det"])
    assert refused.exit_code == 2 and "detent or stock" in refused.output
