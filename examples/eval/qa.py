"""The shipped evaluation task's data: qa.jsonl beside this file, as a datasets split (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("qa.jsonl")


def load(**_: Any) -> Any:
    """lm-eval's `custom_dataset` hook: {"test": the 50 items}, read from the repository."""
    import datasets

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
