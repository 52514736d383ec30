"""The SelIR surface: what a selection program may name.

A SelIR program is a plain Python function over a frozen facts record and marked scalar inputs. It runs as
ordinary Python (that is the *unpinned* reference), and the compiler reads its source:

- the first parameter is the deployment-facts record (static: folded away by partial evaluation);
- `Runtime[T]` parameters are batch-dependent and may be pinned (token count, max query length, ...);
- `Unpinnable[T]` parameters are batch-dependent and may not be pinned (a value the kernel needs as is);
- `Request[T]` parameters depend on the request alone (its own length): free to vary, never a leak;
- `knob(name, choices, default)` is a deployment setting no input determines (a split stride, a padding);
- `require(cond, msg)` / `assume(cond, msg)` say when the selection is valid; an `assume` that runs
  unconditionally (in the program or in a helper it calls unconditionally) and compares a `Runtime`/`Request`
  input with constants also bounds that input's domain for the analysis;
- the fields of the returned `@record` are the selection points.

Builtins a program may call are listed in `BUILTINS`; helpers defined in the same module are inlined.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar

T = TypeVar("T")

if TYPE_CHECKING:
    # to a type checker an input is the value it holds (the compiler reads the annotations from the source)
    from typing_extensions import dataclass_transform

    Runtime = Annotated[T, "Runtime"]
    Unpinnable = Annotated[T, "Unpinnable"]
    Request = Annotated[T, "Request"]
else:
    def dataclass_transform(**_: Any) -> Any:
        return lambda fn: fn

    class Runtime(Generic[T]):
        """Annotation: a batch-dependent input that may be pinned."""

    class Unpinnable(Generic[T]):
        """Annotation: a batch-dependent input the kernel needs as is; never pinned."""

    class Request(Generic[T]):
        """Annotation: an input that depends on the request alone (its own length); never a leak."""


INPUT_KINDS = ("Runtime", "Unpinnable", "Request")


class SelectionFailure(Exception):
    """Raised when a program run as plain Python violates a require/assume."""


_knob_values: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("_knob_values",
                                                                                      default=None)


@contextmanager
def knob_settings(values: Mapping[str, Any]) -> Iterator[None]:
    """Run programs as plain Python with these knob values (others take their default)."""
    token = _knob_values.set(dict(values))
    try:
        yield
    finally:
        _knob_values.reset(token)


def knob(name: str, choices: Sequence[Any], default: Any) -> Any:
    """A deployment setting: returns the active setting, or `default` outside `knob_settings`."""
    value = (_knob_values.get() or {}).get(name, default)
    if value not in choices:
        raise SelectionFailure(f"knob {name!r}: {value!r} is not one of {list(choices)!r}")
    return value


def require(cond: Any, msg: str) -> None:
    """The selection is valid only if `cond` holds (a kernel limit, a launch constraint)."""
    if not cond:
        raise SelectionFailure(f"require failed: {msg}")


def assume(cond: Any, msg: str) -> None:
    """The caller guarantees `cond` (bounds the analysis); still checked at run time."""
    if not cond:
        raise SelectionFailure(f"assume failed: {msg}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers (`-(-a // b)`)."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """`a` rounded up to a multiple of `b`."""
    return -(-a // b) * b


def clamp(x: Any, lo: Any, hi: Any) -> Any:
    """`min(max(x, lo), hi)`."""
    return min(max(x, lo), hi)


def nearest(keys: Sequence[int], x: float) -> int:
    """The key nearest `x`; ties go to the first in `keys` order (as `min(keys, key=|k - x|)` does)."""
    return min(keys, key=lambda k: abs(k - x))


def ceil(x: float) -> int:
    return math.ceil(x)


def floor(x: float) -> int:
    return math.floor(x)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# name -> implementation; every call in a program must name one of these, a helper in the same module, or
# a @record constructor.
BUILTINS: dict[str, Any] = {
    "min": min,
    "max": max,
    "abs": abs,
    "int": int,
    "float": float,
    "bool": bool,
    "len": len,
    "range": range,
    "sum": sum,
    "any": any,
    "all": all,
    "cdiv": cdiv,
    "round_up": round_up,
    "clamp": clamp,
    "nearest": nearest,
    "ceil": ceil,
    "floor": floor,
    "next_pow2": next_pow2,
}

# the statements that carry meaning for the compiler rather than a value
MARKERS = ("require", "assume", "knob")


@dataclass_transform(frozen_default=True)
def record(cls: type[T]) -> type[T]:
    """A frozen, slotted dataclass: facts records and selection results."""
    return dataclasses.dataclass(frozen=True)(cls)


def program(family: str) -> Any:
    """Tag a function as the SelIR program of a kernel family (metadata only; the function is unchanged)."""

    def tag(fn: Any) -> Any:
        fn.__selir_family__ = family
        return fn

    return tag
