"""The SGLang plugin's parts that need no running SGLang: its configuration, the entry point, the stand-in,
the torchvision fix, verify's refusals; and (slow) the real CPU server with the plugin in both processes."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from detent_audit.errors import BadInput
from detent_audit.integrations.sglang.config import ENV, PluginConfig

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


def test_stand_in_only_where_vllm_is_missing_and_raises_if_called():
    code = ("import importlib.util, sys\n"
            "from detent_audit.integrations.sglang.stand_ins import install_stand_ins\n"
            "real = importlib.util.find_spec('vllm') is not None\n"
            "installed = install_stand_ins()\n"
            "assert (installed == []) == real, installed\n"
            "if not real:\n"
            "    from vllm._custom_ops import rotary_embedding\n"
            "    try:\n"
            "        rotary_embedding()\n"
            "    except RuntimeError as e:\n"
            "        assert 'stand-in' in str(e)\n"
            "    else:\n"
            "        raise SystemExit('the stand-in ran')\n")
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


def test_verify_refuses_another_sglang_version_and_stock_receipts():
    from detent_audit.integrations.sglang.reconstruct import reconstruct_sglang
    from detent_audit.verifier.reconstruct import NotComparable

    facts = {"engine": {"name": "sglang", "version": "0.0.1"}, "runtime": {"num_threads": 1}}
    with pytest.raises(NotComparable) as exc:
        reconstruct_sglang(facts, {"mode": {"name": "detent"}}, None)
    assert exc.value.fields == ["engine.version"]
    with pytest.raises(NotComparable) as exc:
        reconstruct_sglang(facts, {"mode": {"name": "stock"}}, None)
    assert exc.value.fields == ["tuple.mode.name"]


@pytest.mark.slow
def test_real_cpu_server_battery_detent_passes_every_cell_and_stock_fails_some():
    """The real CPU server, the plugin loaded through its entry point in the launcher and the scheduler."""
    from detent_audit.engine.battery import run_battery
    from detent_audit.engine.named_models import resolve_model
    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine

    model = str(resolve_model("smollm2-135m-instruct").path)
    detent = SglangEngine(SglangConfig(model=model, mode="detent"))
    try:
        assert all(c.passed for c in run_battery(detent))
    finally:
        detent.shutdown()
    stock = SglangEngine(SglangConfig(model=model, mode="stock"))
    try:
        assert [c.name for c in run_battery(stock) if not c.passed]
    finally:
        stock.shutdown()
