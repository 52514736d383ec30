"""Honest installs agree on a model's identity: `import-gguf` writes the same bytes for the same file in any
process and cache folder, the weights hash is over the tensors (names, dtypes, shapes, data), never the
container's bytes, and two first uses of a model at once both end with the one folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_gguf import write_tiny_gguf

from detent_audit.runtime.errors import BadCheckpoint
from detent_audit.runtime.facts import checkpoint_hashes
from detent_audit.runtime.gguf_import import import_gguf

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    seed = int.from_bytes(os.urandom(2), "little")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=seed)


def folder_bytes(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def _popen(code: str, *args: str, **env: str) -> subprocess.Popen:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env, "PYTHONPATH": path})


def test_gguf_import_writes_the_same_bytes_every_time_in_one_process(gguf_file: Path, tmp_path: Path) -> None:
    first = folder_bytes(import_gguf(gguf_file, tmp_path / "0").path)
    assert set(first) == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "chat_template.jinja", "model.safetensors"}
    for i in range(1, 8):  # safetensors' writer put its metadata in another order about every other time
        assert folder_bytes(import_gguf(gguf_file, tmp_path / str(i)).path) == first, i
    # the written file is one safetensors reads, the tensors ours, the metadata kept
    from safetensors import safe_open

    with safe_open(str(tmp_path / "0" / "model.safetensors"), "pt") as f:
        sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
        assert f.metadata() == {"format": "pt", "gguf_sha256": sha}
        assert len(list(f.keys())) == 20


def test_gguf_import_writes_the_same_bytes_in_processes_with_other_hash_seeds(gguf_file: Path, tmp_path: Path
                                                                              ) -> None:
    here = folder_bytes(import_gguf(gguf_file, tmp_path / "here").path)
    code = f"""
        import sys
        from detent_audit.runtime.gguf_import import import_gguf
        for i in range(3):
            import_gguf({str(gguf_file)!r}, sys.argv[1] + f"-{{i}}")
        """
    procs = {seed: _popen(code, str(tmp_path / seed), PYTHONHASHSEED=seed) for seed in ("1", "2")}
    for seed, proc in procs.items():
        assert proc.wait(timeout=300) == 0, proc.communicate()[1]
        for i in range(3):
            assert folder_bytes(tmp_path / f"{seed}-{i}") == here, (seed, i)


def test_two_cache_folders_give_the_same_checkpoint_hashes(gguf_file: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from detent_audit.runtime import named_models

    monkeypatch.setattr(named_models, "wheel_gguf", lambda name: (gguf_file, "test"))
    hashes = []
    for cache in ("a", "b"):
        monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path / cache))
        model = named_models.ensure_wheel_model(named_models.REAL_MODEL, tmp_path / cache)
        hashes.append((folder_bytes(model.path), checkpoint_hashes(model.path)))
    assert hashes[0] == hashes[1]
    from detent_audit.runtime.tensor_files import WEIGHTS_FORM

    assert hashes[0][1]["weights"].startswith(f"{WEIGHTS_FORM}:")


def test_two_first_uses_at_once_both_end_with_the_one_folder(gguf_file: Path, tmp_path: Path) -> None:
    """Two processes on a fresh cache import the same model at once (each slowed so that both write): neither
    fails, both use the folder the first rename put in place, and no temporary folder is left."""
    code = f"""
        import sys, time
        from pathlib import Path
        from detent_audit.runtime import named_models
        named_models.wheel_gguf = lambda name: (Path({str(gguf_file)!r}), "test")
        barrier = Path({str(tmp_path)!r})
        (barrier / f"ready-{{sys.argv[1]}}").touch()
        while len(list(barrier.glob("ready-*"))) < 2:  # both begin together, after their imports of torch
            time.sleep(0.01)
        model = named_models.ensure_wheel_model(named_models.REAL_MODEL, {str(tmp_path / "cache")!r},
                                                progress=lambda i, n: time.sleep(0.05))
        print(model.path)
        """
    procs = [_popen(code, str(i)) for i in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], [err for _, _, err in results]
    paths = {out.strip() for _, out, _ in results}
    assert len(paths) == 1
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir()] == [Path(paths.pop()).name]  # no partial copy left behind
    assert folder_bytes(next(models.iterdir())) == folder_bytes(import_gguf(gguf_file, tmp_path / "ref").path)


def _checkpoint_of(tensors: dict[str, torch.Tensor], folder: Path, metadata: dict | None = None,
                   shards: int = 1) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / f"model-{i:05d}-of-{shards:05d}.safetensors"), metadata=metadata)
    return folder


def test_weights_hash_is_the_tensors_not_the_container_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from detent_audit.runtime.tensor_files import tensor_lines, weights_hash

    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tensors = {"b.weight": torch.randn(5, 3, generator=g),
               "a.weight": torch.randn(7, generator=g).to(torch.bfloat16),
               "c.bias": torch.randn(2, 2, 2, generator=g).half()}
    base = checkpoint_hashes(_checkpoint_of(tensors, tmp_path / "base"))["weights"]
    # other metadata, in either order, and the tensors split over three files: the same weights
    for name, meta, shards in (("meta", {"format": "pt", "x": "1", "y": "2"}, 1), ("shards", None, 3)):
        folder = _checkpoint_of(tensors, tmp_path / name, meta, shards)
        assert checkpoint_hashes(folder)["weights"] == base, name
    # a bit of data, a name, a shape or a dtype changed: other weights
    flipped = dict(tensors, **{"b.weight": tensors["b.weight"].clone()})
    flipped["b.weight"].view(torch.int32)[2, 1] ^= 1
    changed = {
        "data": flipped,
        "name": {("b.w" if k == "b.weight" else k): v for k, v in tensors.items()},
        "shape": dict(tensors, **{"b.weight": tensors["b.weight"].reshape(3, 5)}),
        "dtype": dict(tensors, **{"b.weight": tensors["b.weight"].view(torch.int32)}),
    }
    for what, other in changed.items():
        assert checkpoint_hashes(_checkpoint_of(other, tmp_path / what))["weights"] != base, what
    # a header that sends a tensor past the file's end is refused, not hashed
    bad = tmp_path / "bad.safetensors"
    save_file({"x": torch.zeros(4)}, str(bad))
    raw = bad.read_bytes().replace(b"[0,16]", b"[0,99]")
    bad.write_bytes(raw)
    with pytest.raises(BadCheckpoint, match="data_offsets"):
        tensor_lines(bad)
    with pytest.raises(BadCheckpoint, match="twice"):
        weights_hash(["x\tF32\t4\t00\n", "x\tF32\t4\t00\n"])
    assert load_file(str(tmp_path / "base" / "model-00000-of-00001.safetensors")).keys() == tensors.keys()


@pytest.mark.slow  # four imports of the 135M model (about 15 s each on one core)
def test_default_model_imports_to_the_same_bytes_and_facts_in_two_processes_and_caches(tmp_path: Path
                                                                                         ) -> None:
    code = """
        import json, sys
        from detent_audit.runtime.facts import checkpoint_hashes
        from detent_audit.runtime.named_models import REAL_MODEL, ensure_wheel_model
        model = ensure_wheel_model(REAL_MODEL, sys.argv[1])
        print(json.dumps({"path": str(model.path), "hashes": checkpoint_hashes(model.path)}))
        """
    import json

    outs = []
    for seed, cache in (("1", "a"), ("2", "b")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "DETENT_AUDIT_CACHE": str(tmp_path / cache)}
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(tmp_path / cache)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout))
    assert outs[0]["hashes"] == outs[1]["hashes"]
    assert folder_bytes(Path(outs[0]["path"])) == folder_bytes(Path(outs[1]["path"]))
