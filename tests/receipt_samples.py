"""Seeded random receipts, valid by construction: fresh content on every seed (token ids, raw fp32 logprob
bits of any pattern, nested facts, floats), for the receipt and run-manifest tests and the verifier's fuzz
(benchmarks/fuzz_verify.py)."""

from __future__ import annotations

import dataclasses
import random

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from detent_audit.manifests.keys import keyid
from detent_audit.manifests.receipt import (
    CLIENT_APIS,
    ClientRequest,
    OutputRecord,
    Receipt,
    RequestRecord,
    RunRecord,
    SamplingRecord,
)


def _text(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(n))


def random_receipt(rng: random.Random, key: Ed25519PrivateKey, *, max_prompt: int = 40, max_output: int = 24,
                   run: RunRecord | None = None) -> Receipt:
    """A receipt `key` signs, of `rng`'s content; `run`: its run and sequence number (random if None)."""
    n_out = rng.randint(1, max_output)
    facts = {"model": {"name": f"m-{rng.getrandbits(32):x}", "num_layers": rng.randint(1, 128),
                       "shape": [rng.getrandbits(40) for _ in range(rng.randint(1, 4))]},
             "gpu": {"arch": rng.choice(["sm90", "sm100", "cpu"]), "uuid": rng.randbytes(16).hex()},
             "engine": {"cuda_graphs": rng.random() < 0.5, "offset": -rng.getrandbits(20), "note": None}}
    values = {"attention.num_splits": rng.randint(1, 64), "gemm.block_k": rng.choice([32, 64, 128]),
              "all_reduce.algo": rng.choice(["ring", "tree"])}
    sampling = SamplingRecord(temperature=rng.choice([0.0, -0.0, rng.uniform(1e-3, 2.0)]),
                              top_k=rng.randint(0, 100), top_p=rng.uniform(1e-3, 1.0),
                              max_tokens=n_out + rng.randint(0, 8),
                              stop_token_ids=tuple(rng.getrandbits(32) for _ in range(rng.randint(0, 3))),
                              ignore_eos=rng.random() < 0.5, logprobs=rng.choice([None, rng.randint(0, 20)]))
    body = {"model": "m", "prompt": _text(rng, rng.randint(1, 30)), "temperature": rng.uniform(0, 2),
            "seed": rng.getrandbits(64)}
    request = RequestRecord(f"req-{rng.getrandbits(48):x}", ClientRequest.of(rng.choice(CLIENT_APIS), body),
                            tuple(rng.getrandbits(32) for _ in range(rng.randint(1, max_prompt))),
                            sampling, rng.getrandbits(64))
    k = sampling.logprobs or 0
    output = OutputRecord(tuple(rng.getrandbits(17) for _ in range(n_out)), rng.randbytes(4 * n_out),
                          rng.choice(["stop", "length"]), _text(rng, n_out),
                          tuple(rng.getrandbits(17) for _ in range(k * n_out)), rng.randbytes(4 * k * n_out))
    run = run or RunRecord(rng.randbytes(16).hex(), rng.getrandbits(20))
    return Receipt(facts, rng.randbytes(32).hex(), values, rng.randbytes(32).hex(), request, output, run,
                   keyid(key.public_key()), rng.getrandbits(63))


def random_run(rng: random.Random, n: int, key: Ed25519PrivateKey, *, run_id: str, first: int = 0,
               deployment_hash: str | None = None, tuple_hash: str | None = None) -> list[Receipt]:
    """`n` receipts of one run (sequence numbers from `first`), all of one deployment and tuple (random if
    not given), small enough for many per test."""
    deployment_hash = deployment_hash or rng.randbytes(32).hex()
    tuple_hash = tuple_hash or rng.randbytes(32).hex()
    return [dataclasses.replace(random_receipt(rng, key, max_prompt=30, max_output=12,
                                               run=RunRecord(run_id, first + i)),
                                deployment_hash=deployment_hash, tuple_hash=tuple_hash) for i in range(n)]
