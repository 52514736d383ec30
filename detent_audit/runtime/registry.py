"""The engines this installation can serve and verify on, found by name: `serve`, `verify`, `battery` and
`info` look an engine up here and never name its class.

Each engine registers one `EngineEntry`: its `--engine` name, the name its facts record
(`facts["engine"]["name"]`), what builds it from a command's options (`build`), what rebuilds it from a
receipt's facts and tuple or refuses with a typed verdict (`rebuild`: `rebuild.NotComparable`, `BadInput`),
and why it cannot run here, if it cannot (`missing`: an `EngineUnavailable`, e.g. the extra is not
installed).

`PACKAGES` names, for each shipped engine, the module that registers it: imported (and so registered) the
first time the registry is asked, never before, so the runtime imports no engine and an engine's own imports
(vLLM, SGLang, torch) load only when that engine is used. Adding an engine is one new package with a
`registration` module and one line in `PACKAGES` (docs/design.md section 2); a test registers its own with
`register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.runtime.contract import EMBEDDED, Engine
from detent_audit.runtime.rebuild import EngineUnavailable, RebuildRequest, check_format

# --engine name -> the module whose import registers it
PACKAGES: dict[str, str] = {
    "embedded": "detent_audit.engine.registration",
    "vllm": "detent_audit.integrations.vllm.registration",
    "sglang": "detent_audit.integrations.sglang.registration",
}


DEFAULT_KV_POOL_BLOCKS = 1024  # what the verifier's memory plan counts for an engine that states none


@dataclass(frozen=True)
class EngineOptions:
    """What a command's options say of the engine to build (serve, battery, info, generate, tune)."""

    model: str | None
    mode: Mode = Mode.DETENT
    dtype: str = "float32"
    threads: int = 1
    tuple: Mapping[str, Mapping[str, object]] | None = None   # the committed tuple (`--tuple`)
    cache_dir: str | None = None
    device: str = "cpu"
    attention_streaming: bool = False
    max_model_len: int | None = None
    tensor_parallel_size: int = 1                               # ranks (engines that split the model)
    extra: Mapping[str, object] = field(default_factory=dict)  # an engine's own settings (tests, benchmarks)


@dataclass(frozen=True)
class EngineEntry:
    name: str                                      # --engine
    facts_name: str                                # facts["engine"]["name"] of its receipts
    build: Callable[[EngineOptions], Engine]
    rebuild: Callable[[RebuildRequest], Engine]
    missing: Callable[[], EngineUnavailable | None] = lambda: None
    kv_pool_blocks: int = DEFAULT_KV_POOL_BLOCKS   # KV pages the verifier's memory plan counts for it


_ENTRIES: dict[str, EngineEntry] = {}


def register(entry: EngineEntry) -> EngineEntry:
    """Make `entry` findable by its `--engine` name and its facts' name (one taken by another is refused)."""
    for other in _ENTRIES.values():
        if other.name != entry.name and other.facts_name == entry.facts_name:
            raise ValueError(f"engines {other.name!r} and {entry.name!r} both record {entry.facts_name!r}")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    _ENTRIES.pop(name, None)


def _load_all() -> None:
    for name, module in PACKAGES.items():
        if name not in _ENTRIES:
            importlib.import_module(module)


def names() -> list[str]:
    """Every `--engine` name, the shipped ones first."""
    return [*PACKAGES, *sorted(set(_ENTRIES) - set(PACKAGES))]


def entry(name: str) -> EngineEntry:
    """The engine `--engine name` picks; `BadInput` for a name no engine registers."""
    if name not in _ENTRIES and name in PACKAGES:
        importlib.import_module(PACKAGES[name])
    if name not in _ENTRIES:
        raise BadInput(f"--engine must be one of {', '.join(names())}, got {name!r}")
    return _ENTRIES[name]


def build(name: str, options: EngineOptions) -> Engine:
    """The engine `name` built from a command's options; `BadInput` where it is not installed here."""
    found = entry(name)
    why = found.missing()
    if why is not None:
        raise BadInput(why.message, remedy=why.remedy)
    return found.build(options)


def facts_name(facts: Mapping[str, object]) -> str:
    """The engine a receipt's facts name (receipts from before engines were named name the embedded one)."""
    engine = facts.get("engine") if isinstance(facts, Mapping) else None
    name = engine.get("name", EMBEDDED) if isinstance(engine, Mapping) else EMBEDDED
    return name if isinstance(name, str) else repr(name)


def entry_for_facts(facts: Mapping[str, object]) -> EngineEntry:
    """The engine that rebuilds a receipt with these facts; `EngineUnavailable` (exit 3) where it is not
    installed here or no engine records that name."""
    name = facts_name(facts)
    found = next((e for e in _ENTRIES.values() if e.facts_name == name), None)
    if found is None:
        _load_all()
        found = next((e for e in _ENTRIES.values() if e.facts_name == name), None)
    if found is None:
        raise EngineUnavailable(f"the receipt was served by engine {name!r}, which this verifier cannot "
                                "rebuild",
                                remedy="verify with a detent-audit that has that engine's integration")
    why = found.missing()
    if why is not None:
        raise why
    return found


def rebuild(request: RebuildRequest) -> Engine:
    """Step (7): the local engine a receipt's facts and tuple describe, of the engine they name; raises
    `NotComparable` (also for an engine not installed here, `EngineUnavailable`, and for facts of another
    format, `OtherFormat`) or `BadInput`."""
    found = entry_for_facts(request.facts)
    check_format(request.facts)
    return found.rebuild(request)
