"""The engine and the GEMM forms: the committed form is probed at start (refused where it fails, recorded in
the facts where it holds), the default commits the proven pad form, old tuples mean the chunk form, and each
form serves bit-identical rows alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from detent_audit.engine.deployment_facts import collect_facts
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.kernels import gemm, gemm_probe
from detent_audit.kernels.params import GemmParams
from detent_audit.manifests.encoding import tuple_hash
from detent_audit.runtime.sampling_params import SamplingParams

MODEL = "random-20m"


def _gemm(rows: int, form: str) -> dict:
    return {"chunk_rows": rows, "embedded.gemm.chunk_rows": rows, "embedded.gemm.form": form}


def _engine(tmp_path, gemm_assignment: dict | None = None, **kw) -> LLM:
    tup = None if gemm_assignment is None else {"embedded.gemm": gemm_assignment}
    return LLM(EngineConfig(model=MODEL, tuple=tup, cache_dir=str(tmp_path / "jit"), **kw))


def test_the_default_commits_the_proven_pad_form_and_records_it(tmp_path):
    llm = _engine(tmp_path)
    g = llm.selection.tuple["embedded.gemm"]
    rows = gemm_probe.least_pad_rows(llm.model.gemm_shapes(), torch.float32)
    if not rows:
        pytest.skip("no pad form proven on this CPU: the default is the 16-row chunk")
    assert g["embedded.gemm.form"] == "pad" and g["chunk_rows"] == rows
    assert collect_facts(llm)["deployment"]["engine"]["gemm_pad_rows"] == rows
    assert llm.selection.kernels.select_gemm(num_tokens=1) == GemmParams(rows, "pad")


def test_a_form_the_probe_fails_refuses_to_start(tmp_path, monkeypatch):
    real = gemm.linear

    def linear(x, w, bias=None, *, params=None):  # a BLAS whose rows change bits at 33 rows
        out = real(x, w, bias, params=params)
        return out + 1 if x.shape[0] == 33 else out
    monkeypatch.setattr(gemm, "linear", linear)
    monkeypatch.setattr(gemm_probe, "_MEMO", {})
    with pytest.raises(gemm_probe.GemmFormNotInvariant) as err:
        _engine(tmp_path, _gemm(1, "row"))
    assert "the tuple's (row)" in err.value.message and "M=33" in err.value.message
    assert err.value.exit_code == 3 and "tune" in err.value.remedy


def test_a_pad_form_below_the_proven_rows_is_refused(tmp_path):
    if gemm_probe.check(GemmParams(2, "pad"), [(512, 512)]).ok:
        pytest.skip("pad:2 holds on this CPU")
    with pytest.raises(gemm_probe.GemmFormNotInvariant, match="pad:2"):
        _engine(tmp_path, _gemm(2, "pad"))


def test_a_tuple_from_before_the_forms_is_the_chunk_form(tmp_path):
    llm = _engine(tmp_path, {"chunk_rows": 16, "embedded.gemm.chunk_rows": 16})
    assert llm.selection.tuple["embedded.gemm"]["embedded.gemm.form"] == "chunk"
    assert llm.selection.kernels.select_gemm(num_tokens=3) == GemmParams(16)
    engine = collect_facts(llm)["deployment"]["engine"]
    # nothing probed, nothing claimed
    assert engine["gemm_pad_rows"] == 0 and engine["gemm_row_form"] is False


def test_an_unknown_form_is_bad_input(tmp_path):
    from detent_audit.errors import BadInput

    with pytest.raises(BadInput):
        _engine(tmp_path, _gemm(4, "diagonal"))


@pytest.mark.parametrize("assignment", [_gemm(4, "pad"), _gemm(1, "row"), _gemm(16, "chunk")],
                         ids=["pad4", "row", "chunk16"])
def test_each_form_serves_a_row_alone_as_in_a_batch(tmp_path, assignment):
    params = GemmParams(assignment["chunk_rows"], assignment["embedded.gemm.form"])
    llm = LLM(EngineConfig(model=MODEL, cache_dir=str(tmp_path / "jit")))
    if not gemm_probe.check(params, llm.model.gemm_shapes()).ok:
        pytest.skip(f"{params.label} not proven here")
    llm = _engine(tmp_path, assignment)
    gen = torch.Generator().manual_seed(len(str(tmp_path)))
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 40, (7,), generator=gen)]
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    batched = llm.generate(prompts, sp)
    llm.reset()
    alone = llm.generate([prompts[3]], sp)[0]
    assert alone.token_ids == batched[3].token_ids
    assert torch.equal(torch.tensor(alone.logprobs), torch.tensor(batched[3].logprobs))
    # signed: the committed form and rows as the kernels read them (the chunk knob a pinned chunk overrides
    # is not)
    signed = collect_facts(llm)["tuple"]["embedded.gemm"]
    assert signed == llm.selection.used_tuple["embedded.gemm"]
    assert signed.items() <= assignment.items() and {"chunk_rows", "embedded.gemm.form"} <= set(signed), \
        (signed, assignment)


def test_the_form_is_in_the_tuple_hash():
    hashes = {tuple_hash({"embedded.gemm": _gemm(rows, form)}) for rows, form in ((4, "pad"), (4, "chunk"))}
    assert len(hashes) == 2
