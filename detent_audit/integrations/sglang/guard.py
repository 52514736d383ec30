"""The scheduler's refusal of a request beyond the context the CPU selection was solved for (detent mode).

The selectors assume every sequence fits the deployment's `max_model_len` (`selection/programs/embedded.py`);
a step beyond it raises `SelectionViolation` inside SGLang's scheduler, which SGLang does not catch: the
scheduler stops and sends SIGQUIT to the process that started it, and every request fails. SGLang holds a
request within its own context length (the prompt refused at admission, the output clipped to fit), so with
SGLang started at the selection's limits (`selection.Limits`, as the engine and `detent-audit sglang-config`
start it) nothing reaches the assumption. Where SGLang was started with a longer context than the plugin's,
this AFTER hook of `Scheduler.init_req_max_new_tokens` (run for every request SGLang admits, once its output
is clipped) refuses a request whose prompt and output could exceed the selection's context, through SGLang's
own abort (`Req.set_finish_with_abort`): that request alone ends with the error (HTTP 400 from SGLang's
server, `BadInput` from the engine), and the scheduler serves on.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens"


def beyond_context(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> str | None:
    """Why a request of `prompt_tokens` and at most `max_new_tokens` output tokens does not fit a selection
    solved for `max_model_len` (its last step attends to prompt + output - 1 tokens); None where it
    fits."""
    if prompt_tokens + max_new_tokens - 1 <= max_model_len:
        return None
    return (f"the prompt ({prompt_tokens} tokens) and max_new_tokens ({max_new_tokens}) exceed the context "
            f"of {max_model_len} tokens detent's selection was solved for; start SGLang with "
            f"--context-length at most {max_model_len} (detent-audit sglang-config prints the matching "
            "flags) or send a shorter request")


class ContextGuard:
    """The hook, closed over the selection's context."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def after_max_new_tokens(self, result: Any, scheduler: Any, req: Any) -> Any:
        """AFTER hook: `req` refused (SGLang's abort, status 400) where it does not fit; nothing else
        changes."""
        if getattr(req, "to_finish", None) is not None:  # refused already (SGLang's own reasons)
            return result
        why = beyond_context(len(req.origin_input_ids), int(req.sampling_params.max_new_tokens or 0),
                             self.max_model_len)
        if why is not None:
            req.set_finish_with_abort(why)
        return result

    def hooks(self) -> dict[str, tuple[str, Any]]:
        """target -> (hook type name, hook)."""
        return {TARGET: ("AFTER", self.after_max_new_tokens)}
