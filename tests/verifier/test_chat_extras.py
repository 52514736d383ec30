"""vLLM's chat extras (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`): the prompt
ids are transformers' `apply_chat_template`'s on the real model's template (and on it with a variable it
reads), each extra changes them, and a served request that uses them is bound in its receipt and verifies;
a receipt that ran the prompt without them FAILs."""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest
from threaded_server import threaded_server

from detent_audit.errors import BadInput
from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.manifests.receipt import ClientRequest, verify_envelope
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.tokenizer import Tokenizer
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.protocol import InvalidRequest, Limits, parse_request
from detent_audit.verifier.verify import verify

MODEL = "tiny-llama"
THINKING = ("{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
            "{% endif %}")
CHATS = [
    [{"role": "user", "content": "Name a city."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "It is "}],
]
OPTIONS = [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template_kwargs": {"enable_thinking": True, "unused": [1, 2]}},
]


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The real model's tokenizer folder, and a copy whose template reads a variable (`enable_thinking`)."""
    from detent_audit.runtime.named_models import REAL_MODEL, resolve_model

    real = resolve_model(REAL_MODEL).path
    other = tmp_path_factory.mktemp("thinking")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(real / name, other / name)
    (other / "chat_template.jinja").write_text((real / "chat_template.jinja").read_text() + THINKING)
    return [real, other]


def test_the_extras_shape_the_prompt_as_transformers_apply_chat_template(templates: list[Path]) -> None:
    from transformers import AutoTokenizer

    for folder in templates:
        ours, theirs = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))
        limits = Limits("m", 2048, ours.vocab_size)
        for messages in CHATS:
            seen = {}
            for i, options in enumerate(OPTIONS):
                parsed = parse_request({"messages": messages, **options}, True, limits, ours)
                want = theirs.apply_chat_template(
                    messages, tokenize=False,
                    add_generation_prompt=options.get("add_generation_prompt", True),
                    continue_final_message=options.get("continue_final_message", False),
                    **options.get("chat_template_kwargs", {}))
                ids = theirs(want, add_special_tokens=False)["input_ids"]
                assert parsed.prompt_ids == ids, (folder, options)
                seen[i] = tuple(parsed.prompt_ids)
            assert len({seen[0], seen[1], seen[2]}) == 3  # each of the first two extras changes the ids
            thinking = folder == templates[1]
            assert (seen[3] != seen[0]) is thinking and seen[4] == seen[0]
        for bad, param in (({"add_generation_prompt": True, "continue_final_message": True},
                            "continue_final_message"),
                           ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                           ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                           ({"add_generation_prompt": "yes"}, "add_generation_prompt")):
            with pytest.raises(InvalidRequest) as refused:
                parse_request({"messages": CHATS[0], **bad}, True, limits, ours)
            assert refused.value.param == param


def test_a_request_with_the_extras_is_bound_and_verifies(new_node) -> None:
    n = new_node("chat-extras")
    n.node.publish(n.root / "deployment.json")
    trusted = load_trusted_keys(n.key.public_path)
    tokenizer = n.llm.tokenizer
    messages = CHATS[1]
    extras = {"add_generation_prompt": False, "continue_final_message": True,
              "chat_template_kwargs": {"enable_thinking": False}}
    with threaded_server(create_app(AsyncEngine(n.llm), n.node, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,  # type: ignore
                                             temperature=0.9, extra_body=extras)
        # the node runs the prompt rendered without the extras under the body that has them
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0.9, "seed": 1,
                **extras}
        plain = tokenizer.encode_chat(messages)
        params = SamplingParams(temperature=0.9, max_tokens=4, seed=1)
        n.node.sign(n.llm.generate([plain], params)[0], params, "chatcmpl-plain",
                    ClientRequest.of("openai/v1/chat/completions", body))
    path = n.node.receipt_path(got.receipt_id)  # type: ignore[attr-defined]
    receipt = verify_envelope(path.read_bytes(), trusted).receipt
    continued = tokenizer.encode_chat(messages, False, True, {"enable_thinking": False})
    assert list(receipt.request.prompt_token_ids) == continued != plain
    assert receipt.request.client.body()["continue_final_message"] is True
    report = verify([n.root / "out"], trusted, model=str(n.ckpt), cache_dir=str(n.root / "jit"))
    status = {o.request_id: (o.status, o.message) for o in report.outcomes if o.kind == "receipt"}
    assert status[got.id][0] == "OK" and status["chatcmpl-plain"][0] == "FAIL", status
    assert "is not the client's request" in status["chatcmpl-plain"][1]
    with pytest.raises(BadInput):
        tokenizer.encode_chat(messages, False, False, {"bos_token": "x"})
