"""The one thread-count rule: `set_threads` holds where `torch.set_num_threads` has been made a no-op (as
vLLM's CPU worker makes it), and refuses a count torch does not run."""

from __future__ import annotations

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.runtime import threads
from detent_audit.runtime.threads import ThreadCountNotSet, set_threads, thread_count


@pytest.fixture
def no_op_set_num_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`torch.set_num_threads` replaced by a function that only records its argument (vLLM's CPU worker's)."""
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    return asked


def test_the_count_holds_after_set_num_threads_is_a_no_op(no_op_set_num_threads: list[int]) -> None:
    before = torch.get_num_threads()
    target = 2 if before != 2 else 1
    torch.set_num_threads(target)
    assert torch.get_num_threads() == before and no_op_set_num_threads == [target]  # the no-op took nothing
    with thread_count(target):
        assert torch.get_num_threads() == target
        set_threads(before)
        assert torch.get_num_threads() == before
        set_threads(target)
    assert torch.get_num_threads() == before
    assert no_op_set_num_threads == [target]  # set_threads never went through the replaced function


def test_the_count_is_restored_when_the_body_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(KeyError), thread_count(2 if before != 2 else 1):
        raise KeyError("body")
    assert torch.get_num_threads() == before


def test_a_count_torch_does_not_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch reports another count than the one set (a pinned pool), the engine must not start."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads.torch._C, "set_num_threads", lambda n: None)
    target = before + 1
    with pytest.raises(ThreadCountNotSet,
                       match=f"torch runs {before} threads after {target} were asked") as err:
        set_threads(target)
    assert "OMP_NUM_THREADS" in err.value.remedy


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_count_that_is_not_a_whole_number_above_zero_is_bad_input(bad: object) -> None:
    with pytest.raises(BadInput, match="thread count"):
        set_threads(bad)  # type: ignore[arg-type]


def test_the_project_sets_thread_counts_through_set_threads_only() -> None:
    """A call of `torch.set_num_threads` or `torch._C.set_num_threads` anywhere but runtime/threads.py (in the
    package, the kernels, the verifier, the benchmarks or the tests) is the no-op the rule exists to avoid."""
    import ast
    from pathlib import Path

    root = Path(__file__).parents[2]
    calls = []
    for folder in ("detent_audit", "kernels", "verifier", "manifests", "selection", "benchmarks", "tests",
                   "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            if path in (root / "detent_audit" / "runtime" / "threads.py", Path(__file__)):  # rule, its test
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "set_num_threads":
                    calls.append(f"{path.relative_to(root)}:{node.lineno}")
    assert calls == [], f"set the count with detent_audit.runtime.threads.set_threads instead: {calls}"
