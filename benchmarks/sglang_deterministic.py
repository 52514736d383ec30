"""SGLang's own determinism test (`python -m sglang.test.test_deterministic`, its four modes) against SGLang's
own server (`python -m sglang.launch_server`), stock and with the detent plugin, on this CPU.

Each server is started as `detent-audit sglang-config` prints it (stock: the same flags, no plugin
configuration), one at a time. Each mode runs as SGLang ships it, with small settings; its verdict is read
from what the test prints (it exits 0 either way): `single` passes with one unique text over batch sizes
1..n, `prefix` with one unique text per prefix length and identical logprobs (`--return-logprob`),
`radix_cache` with "TEST PASSED", `p_vs_d` with every sequence's tokens and logprobs matching between
prefill and decode. Prints one JSON document.

The model: `radix_cache` sends 100 token ids drawn from 100..50000 (seed 42), beyond SmolLM2's 49,152:
SGLang's scheduler (stock too) then fails with an IndexError in the embedding and its server stops. So the
model is SmolLM2-135M-Instruct with its (tied) embedding padded by zero rows to `PADDED_VOCAB`
(`padded_checkpoint`): every real token's embedding and weights as they were, the padded ids' logits 0 (never
the greedy token).

    python benchmarks/sglang_deterministic.py --out benchmarks/results/sglang-deterministic/run.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

MODES = ("single", "prefix", "radix_cache", "p_vs_d")
CLI = [sys.executable, "-m", "detent_audit.cli"]
PADDED_VOCAB = 50304  # above the 50000 radix_cache draws from, a multiple of 64


def padded_checkpoint(model: str, folder: Path) -> Path:
    """A copy of `model`'s checkpoint in `folder` with its tied embedding padded by zero rows to
    `PADDED_VOCAB` (written once)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from detent_audit.integrations.hosted import checkpoint_folder

    if (folder / "config.json").is_file():
        return folder
    source = checkpoint_folder(model, None, "SGLang").path
    config = json.loads((source / "config.json").read_text())
    if not config.get("tie_word_embeddings") or config["vocab_size"] >= PADDED_VOCAB:
        raise SystemExit(f"{model}: padding is written for a tied embedding below {PADDED_VOCAB} tokens")
    tensors = load_file(str(source / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    pad = torch.zeros(PADDED_VOCAB - embed.shape[0], embed.shape[1], dtype=embed.dtype)
    tensors["model.embed_tokens.weight"] = torch.cat([embed, pad])
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, tmp / item.name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "vocab_size": PADDED_VOCAB}, indent=1))
    tmp.rename(folder)
    return folder


@dataclass(frozen=True)
class ModeResult:
    mode: str
    passed: bool
    detail: str        # the figures the verdict is read from
    seconds: float
    command: str


def server_launch(model: str, plugin: bool, max_model_len: int) -> tuple[dict[str, str], list[str]]:
    """The environment and command line `detent-audit sglang-config` prints; stock: the same flags without
    the plugin's configuration (SGLang as shipped)."""
    out = subprocess.run([*CLI, "sglang-config", "--model", model, "--max-model-len", str(max_model_len),
                          "--json", *([] if plugin else ["--mode", "stock"])],
                         check=True, capture_output=True, text=True).stdout
    config = json.loads(out)
    env = dict(config["env"])
    if not plugin:
        env.pop("DETENT_SGLANG")
    argv = [sys.executable, *config["argv"][1:]]
    return env, argv


class Server:
    """SGLang's own server in its own process group (stopped with the group)."""

    def __init__(self, model: str, plugin: bool, port: int, log: Path, max_model_len: int = 2048,
                 extra: tuple[str, ...] = (), report_dir: Path | None = None) -> None:
        """`extra`: flags after the printed ones (the last of a flag wins); `report_dir`: where each process
        of SGLang writes which of the plugin's hooks it applied."""
        env, argv = server_launch(model, plugin, max_model_len)
        if plugin and report_dir is not None:
            plugin = {**json.loads(env["DETENT_SGLANG"]), "report_dir": str(report_dir)}
            env["DETENT_SGLANG"] = json.dumps(plugin)
        argv = [*argv, *extra]
        self.port, self.log = port, log
        self.command = " ".join(f"{k}=<...>" if k == "DETENT_SGLANG" else f"{k}={v}" for k, v in env.items())
        self.command += " " + " ".join([*argv, "--port", str(port)])
        base = {k: v for k, v in os.environ.items() if k != "DETENT_SGLANG"}
        with open(log, "w") as sink:
            self.process = subprocess.Popen([*argv, "--port", str(port)], env={**base, **env}, stdout=sink,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answers; raises if the process ends first or `timeout` passes."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang's server exited ({self.process.returncode}): "
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                    if reply.status == 200:
                        return time.monotonic() - began
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"SGLang's server did not answer /health in {timeout:.0f} s")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def verdict(mode: str, output: str) -> tuple[bool, str]:
    """Whether the mode passed, and the figures it printed (see the module docstring)."""
    if mode == "single":
        found = re.findall(r"Total samples: (\d+), Unique samples: (\d+)", output)
        detail = f"unique texts {found[-1][1]} of {found[-1][0]}" if found else ""
        return bool(found) and found[-1][1] == "1", detail
    if mode == "prefix":
        found = re.findall(r"prefix length (\d+): total samples: (\d+), Unique samples: (\d+)", output)
        texts = bool(found) and all(int(u) <= 1 for _, _, u in found)
        logprobs = "Logprobs are identical across all batch sizes" in output
        detail = "; ".join(f"prefix {n} chars: {u} unique of {t}" for n, t, u in found)
        return texts and logprobs, f"{detail}; logprobs identical: {logprobs}"
    if mode == "radix_cache":
        return "TEST PASSED" in output, "cached = uncached prefill" if "TEST PASSED" in output else "differ"
    if mode == "p_vs_d":
        sequences = output.count("Compare sequence")
        matched = output.count("Logprobs match:")  # a mismatch prints "Logprobs mismatch"
        tokens_bad = output.count("Token mismatch")
        return (sequences > 0 and matched == sequences and not tokens_bad,
                f"{matched}/{sequences} sequences' logprobs equal, {tokens_bad} token mismatches")
    raise ValueError(mode)


def run_mode(port: int, mode: str, n_trials: int, max_new_tokens: int, timeout: float = 1800) -> ModeResult:
    """One mode of `python -m sglang.test.test_deterministic` against the server on `port`."""
    argv = [sys.executable, "-m", "sglang.test.test_deterministic", "--port", str(port), "--test-mode", mode,
            "--max-new-tokens", str(max_new_tokens)]
    if mode in ("single", "prefix", "p_vs_d"):
        argv += ["--n-trials", str(n_trials)]
    if mode == "prefix":
        argv += ["--n-start", "1", "--return-logprob"]
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    passed, detail = verdict(mode, output)
    if done.returncode != 0:
        passed, detail = False, f"exit {done.returncode}: {output[-800:]}"
    return ModeResult(mode, passed, detail, round(time.monotonic() - began, 1),
                      " ".join(["python", *argv[1:]]))


def run_server(model: str, plugin: bool, port: int, log: Path, n_trials: int, max_new_tokens: int,
               modes: tuple[str, ...] = MODES, start_timeout: float = 1800) -> dict:
    server = Server(model, plugin, port, log)
    try:
        start_s = server.wait_ready(start_timeout)
        results = [run_mode(port, m, n_trials, max_new_tokens) for m in modes]
        return {"server": "detent plugin" if plugin else "stock", "command": server.command,
                "start_s": round(start_s, 1), "modes": [asdict(r) for r in results],
                "alive_after": server.alive()}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="padded (see the docstring)")
    parser.add_argument("--checkpoints", type=Path, default=Path("/tmp/detent-sglang-deterministic"))
    parser.add_argument("--servers", default="detent,stock", help="detent, stock or both, in order")
    parser.add_argument("--n-trials", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=31020)
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    began = time.time()
    model = str(padded_checkpoint(args.model, args.checkpoints / f"{args.model}-vocab{PADDED_VOCAB}"))
    runs = [run_server(model, name == "detent", args.port, args.logs / f"sglang-server-{name}.log",
                       args.n_trials, args.max_new_tokens) for name in args.servers.split(",")]
    doc = {"model": f"{args.model}, embedding padded to {PADDED_VOCAB}", "n_trials": args.n_trials,
           "max_new_tokens": args.max_new_tokens,
           "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "servers": runs,
           "total_s": round(time.time() - began, 1)}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
