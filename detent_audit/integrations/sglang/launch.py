"""How SGLang is started on this CPU, written once: the server arguments and the environment `SglangEngine`
starts `sglang.Engine` with, and what `detent-audit sglang-config` prints for SGLang's own server
(`python -m sglang.launch_server`, which signs nothing: no receipt comes from it).

The environment carries the plugin's configuration (`DETENT_SGLANG`, `config.PluginConfig`), the torch
threads of SGLang's processes, and in detent mode SGLang's own settings that change bits
(`config.DETENT_SGLANG_ENV`). The server arguments put SGLang on its CPU path (fp32, the torch_native
attention and the pytorch sampler the plugin hooks, one token per KV page, no CUDA graph) within the limits
the plugin's selection is solved for (`selection.Limits`: context length, running requests, chunked-prefill
size).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from detent_audit.enums import Mode
from detent_audit.integrations.sglang.config import DETENT_SGLANG_ENV, ENV, PluginConfig
from detent_audit.integrations.sglang.selection import PAGE_SIZE

MAX_TOTAL_TOKENS = 32768  # the KV pool's tokens (not a bit-relevant fact)
# SGLang stops its scheduler when one forward takes longer than its watchdog (300 s by default): on a busy
# CPU the prefill of a long prompt can (a 3,000-token prompt on a 2-core machine at load 18, measured)
WATCHDOG_S = 3600
# the share of the memory SGLang may take for weights and the KV pool (the pool is MAX_TOTAL_TOKENS at most):
# left to SGLang, it is derived from its GPU defaults and comes out below zero on a 24 GiB machine, where
# the scheduler then refuses to start
MEM_FRACTION_STATIC = 0.5


def server_args(model_path: str, config: PluginConfig, *, chunked_prefill_size: int,
                prefix_caching: bool = True, max_total_tokens: int = MAX_TOTAL_TOKENS) -> dict[str, Any]:
    """SGLang's `ServerArgs` fields (`sglang.Engine`'s keyword arguments) for `config`'s model and limits;
    `chunked_prefill_size` at most the tokens of one step the selection is solved for."""
    return {"model_path": model_path, "tokenizer_path": model_path, "device": "cpu", "dtype": "float32",
            "attention_backend": "torch_native", "sampling_backend": "pytorch", "grammar_backend": "none",
            "disable_cuda_graph": True, "page_size": PAGE_SIZE, "chunked_prefill_size": chunked_prefill_size,
            "disable_radix_cache": not prefix_caching, "max_running_requests": config.max_num_seqs,
            "max_total_tokens": max_total_tokens, "context_length": config.max_model_len, "random_seed": 0,
            "watchdog_timeout": WATCHDOG_S, "mem_fraction_static": MEM_FRACTION_STATIC}


def plugin_env(config: PluginConfig) -> dict[str, str]:
    """The environment SGLang's processes inherit: the plugin's configuration, the threads, and in detent
    mode SGLang's settings that change bits (in stock mode those are left as SGLang ships them)."""
    env = {ENV: config.to_env(), "OMP_NUM_THREADS": str(config.num_threads)}
    if config.mode == Mode.DETENT:
        env.update(DETENT_SGLANG_ENV)
    return env


@dataclass(frozen=True)
class ServerLaunch:
    """SGLang's own server with the plugin: the environment to export and `sglang.launch_server`'s
    arguments."""

    env: Mapping[str, str]
    args: Mapping[str, Any]

    def argv(self, python: str = sys.executable) -> list[str]:
        """The command line (a true flag bare, a false one left out)."""
        argv = [python, "-m", "sglang.launch_server"]
        for name, value in self.args.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not False and value is not None:
                argv += [flag, str(value)]
        return argv

    def shell(self, python: str = "python") -> str:
        """The environment as `export` lines, then the command, quoted for a POSIX shell."""
        exports = [f"export {name}={shlex.quote(value)}" for name, value in sorted(self.env.items())]
        return "\n".join([*exports, shlex.join(self.argv(python))])

    def to_json(self) -> dict[str, Any]:
        return {"env": dict(sorted(self.env.items())), "argv": self.argv("python")}


def for_server(model_path: str, config: PluginConfig, chunked_prefill_size: int) -> ServerLaunch:
    """SGLang's own server (`python -m sglang.launch_server`) with the plugin as `config` says."""
    return ServerLaunch(plugin_env(config), server_args(model_path, config,
                                                       chunked_prefill_size=chunked_prefill_size))
