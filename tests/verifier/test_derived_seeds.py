"""Seed grinding: a sampled request that names no seed gets one derived from the node's run and the bound
request (manifests/seeds.py), never one the node picks after seeing the request; verify recomputes it and
FAILs a receipt that carries any other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.manifests.receipt import ClientRequest
from detent_audit.manifests.seeds import derived_seed
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.offline import API, serve_offline
from detent_audit.verifier.verify import verify


def test_the_derived_seed_is_a_function_of_run_request_and_choice() -> None:
    run, body = os.urandom(16).hex(), ClientRequest.of(API, {"id": "a", "prompt": "x", "temperature": 1.0})
    seed = derived_seed(run, body.api, body.body_sha256)
    assert seed == derived_seed(run, body.api, body.body_sha256, 0) and 0 <= seed < 2**64
    others = {derived_seed(os.urandom(16).hex(), body.api, body.body_sha256),  # another run
              derived_seed(run, "openai/v1/completions", body.body_sha256),  # another endpoint
              derived_seed(run, body.api, ClientRequest.of(API, {"id": "b", "prompt": "x"}).body_sha256),
              derived_seed(run, body.api, body.body_sha256, 1)}  # another choice
    assert seed not in others and len(others) == 4
    with pytest.raises(ValueError):
        derived_seed(run, body.api, body.body_sha256, -1)


def test_a_receipt_of_an_unseeded_request_with_a_node_chosen_seed_fails(new_node, tmp_path: Path) -> None:
    n = new_node("grind")
    prompt = [3, 4, 5, 6]
    lines = [{"id": "honest", "prompt_token_ids": prompt, "max_tokens": 6, "temperature": 1.0},
             {"id": "seeded", "prompt_token_ids": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 5},
             {"id": "greedy", "prompt_token_ids": prompt, "max_tokens": 6}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert serve_offline(n.llm, n.node, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 3
    served = {r["id"]: r["seed"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    honest = ClientRequest.of(API, lines[0])
    expected = derived_seed(n.node.run_id, API, honest.body_sha256)
    assert served == {"honest": expected, "seeded": 5, "greedy": 0}

    # the node grinds: the same kind of unseeded request, answered with the seed of its choice (the answer
    # it wanted), computed and signed honestly otherwise
    body = {"id": "ground", "prompt_token_ids": prompt, "max_tokens": 6, "temperature": 1.0}
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=int.from_bytes(os.urandom(8), "little"))
    out = n.llm.generate([prompt], params)[0]
    n.node.sign(out, params, "ground", ClientRequest.of(API, body))
    n.node.close()
    report = verify([n.root / "out"], load_trusted_keys(n.key.public_path), model=str(n.ckpt),
                    cache_dir=str(n.root / "jit"))
    status = {o.request_id: (o.status, o.message) for o in report.outcomes if o.kind == "receipt"}
    assert {k: s for k, (s, _) in status.items()} == {"honest": "OK", "seeded": "OK", "greedy": "OK",
                                                      "ground": "FAIL"}, status
    assert f"seed {params.seed}" in status["ground"][1]
