"""`Tokenizer`: a checkpoint's tokenizer.json (through `tokenizers`), its chat template and its EOS ids.

The chat template is read where checkpoints keep it: chat_template.jinja beside tokenizer_config.json (where
current transformers writes it; it wins, as in transformers), else tokenizer_config.json's `chat_template` (a
string, or a list of named templates of which "default" is used).

The two chat templates this project ships (`CHAT_FORMATS`) render through plain-Python twins that give the
same text (the tests compare them with jinja2), so the random-20m model needs no jinja2. Any other
template renders with jinja2 the way transformers does (sandboxed, `trim_blocks`, `lstrip_blocks`); without
jinja2 installed that is `BadInput` with the remedy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from detent_audit.errors import BadInput
from detent_audit.runtime.errors import BadCheckpoint

Message = dict[str, str]  # {"role": ..., "content": ...}
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _render_llama3(messages: Sequence[Message], bos_token: str | None, add_generation_prompt: bool) -> str:
    turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                    for m in messages)
    return (bos_token or "") + turns + ("<|start_header_id|>assistant<|end_header_id|>\n\n"
                                        if add_generation_prompt else "")


def _render_chatml(messages: Sequence[Message], bos_token: str | None, add_generation_prompt: bool) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@dataclass(frozen=True)
class ChatFormat:
    """A family's special tokens (ids 256, 257, ... after the byte tokens) and its chat template."""

    name: str
    special_tokens: tuple[str, ...]
    bos_token: str | None
    eos_tokens: tuple[str, ...]  # the first is tokenizer_config.json's eos_token
    template: str
    render: Callable[[Sequence[Message], str | None, bool], str]  # same text as `template`, no jinja2


CHAT_FORMATS: dict[str, ChatFormat] = {
    "llama3": ChatFormat("llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eot_id|>"),
                         "<|begin_of_text|>", ("<|eot_id|>", "<|end_of_text|>"), LLAMA3_TEMPLATE,
                         _render_llama3),
    "chatml": ChatFormat("chatml", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                         None, ("<|im_end|>", "<|endoftext|>"), CHATML_TEMPLATE, _render_chatml),
}
_NATIVE = {fmt.template: fmt.render for fmt in CHAT_FORMATS.values()}


# what a template reads that the caller's `template_kwargs` may not set (vLLM's chat_template_kwargs)
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "bos_token", "eos_token", "add_generation_prompt",
                                     "raise_exception", "tools", "documents", "continue_final_message"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where the final message ends


def render_jinja(template: str, messages: Sequence[Message], bos_token: str | None, eos_token: str | None,
                 add_generation_prompt: bool, template_kwargs: Mapping[str, object] | None = None) -> str:
    """Render as transformers does (`template_kwargs`: more variables the template reads); `BadInput` if
    jinja2 is not installed."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise BadInput("this checkpoint's chat template needs jinja2, which is not installed",
                       remedy="pip install jinja2") from exc

    def raise_exception(message: str) -> None:
        raise BadInput(f"chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**(template_kwargs or {}), messages=list(messages),
                                            bos_token=bos_token or "", eos_token=eos_token or "",
                                            add_generation_prompt=add_generation_prompt)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadCheckpoint(f"cannot read {file}: {exc}") from exc


def chat_template_of(path: Path, tok_config: Mapping[str, object]) -> str | None:
    """The checkpoint's chat template (see the module docstring); `BadCheckpoint` for one of another type."""
    jinja = path / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadCheckpoint(f"cannot read {jinja}: {exc}") from exc
    value = tok_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise BadCheckpoint("tokenizer_config.json's chat_template is neither a string nor a list of named "
                        f"templates with a 'default' one (got {type(value).__name__})")


def _token_text(value: object) -> str | None:
    text = value.get("content") if isinstance(value, dict) else value  # AddedToken dicts or plain strings
    return text if isinstance(text, str) else None


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint. `eos_token_ids` is sorted and non-empty."""

    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._max_token_chars: int | None = None
        if not self.eos_token_ids:
            raise BadCheckpoint("the checkpoint names no EOS token (tokenizer_config, generation_config or "
                                "config)")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json, plus tokenizer_config.json (bos/eos), the chat template (`chat_template_of`) and
        the EOS ids of generation_config.json and config.json (their union)."""
        path = Path(path)
        try:
            tokenizer = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for missing and malformed files
            raise BadCheckpoint(f"cannot read {path / 'tokenizer.json'}: {exc}") from exc
        tok_config = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_text(tok_config.get("bos_token")), _token_text(tok_config.get("eos_token"))
        eos_ids = [i for i in ([tokenizer.token_to_id(eos)] if eos is not None else []) if i is not None]
        for extra in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            value = extra.get("eos_token_id")
            eos_ids += value if isinstance(value, list) else [] if value is None else [value]
        return cls(tokenizer, chat_template_of(path, tok_config), bos, eos, eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no token covers more (read once)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def token_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (a byte-level BPE token's bytes as characters), or None."""
        return self.tokenizer.id_to_token(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (a model's padded vocabulary) decode to nothing."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: Mapping[str, object] | None = None) -> str:
        """The chat as transformers' `apply_chat_template` renders it: `continue_final_message` ends the text
        inside the final message (open, for the model to continue it: transformers' marker rule), and
        `template_kwargs` are more variables the template reads (a built-in template's twin renders only
        without them; with them the template itself renders, through jinja2)."""
        if self.chat_template is None:
            raise BadInput("this checkpoint has no chat template",
                           remedy=f"send a plain prompt, or add {CHAT_TEMPLATE_FILE} (or chat_template in "
                                  "tokenizer_config.json) to the checkpoint")
        reserved = sorted(RESERVED_TEMPLATE_NAMES & set(template_kwargs or {}))
        if reserved:
            raise BadInput(f"chat template variables {', '.join(reserved)} are set by the renderer, not the "
                           "caller")
        if continue_final_message:
            if not messages:
                raise BadInput("continue_final_message needs a final message to continue")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        native = _NATIVE.get(self.chat_template)
        if native is not None and not template_kwargs:
            text = native(messages, self.bos_token, add_generation_prompt)
        else:
            text = render_jinja(self.chat_template, messages, self.bos_token, self.eos_token,
                                add_generation_prompt, template_kwargs)
        if not continue_final_message:
            return text
        final, tag = messages[-1]["content"][:-len(_CONTINUE_TAG)], _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise BadInput("continue_final_message: the chat template drops part of the final message, so "
                           "there is no place to continue it from")
        at = text.rindex(tag)
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: Mapping[str, object] | None = None) -> list[int]:
        """Token ids of the rendered chat; the template writes any BOS itself (as transformers does)."""
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                        template_kwargs)
        return self.encode(text, add_special_tokens=False)
