"""verify-eval's score line: OK only where the scores are equal and the task's coverage is whole; a short
coverage FAILs and names the documents missing."""

from __future__ import annotations

import random

from detent_audit.verifier.eval_audit import DocVerdict, Score, score_line


def test_a_short_coverage_is_no_ok_and_names_the_missing_documents() -> None:
    total = random.randint(5, 40)
    missing = sorted(random.sample(range(total), random.randint(1, 3)))
    docs = [DocVerdict("qa", i, i not in missing, ["no receipt"] if i in missing else [])
            for i in range(total)]
    docs.append(DocVerdict("other", missing[0], False, ["no receipt"]))  # another task's: not this score's
    value = random.random()
    short = score_line(Score("qa", "acc,none", value, value, total - len(missing), total), docs)
    assert short.startswith("FAIL: qa acc,none") and f"coverage {total - len(missing)}/{total}" in short
    assert f"{len(missing)} document(s) not covered (doc {', '.join(map(str, missing))})" in short
    whole = score_line(Score("qa", "acc,none", value, value, total, total), docs)
    assert whole.startswith("OK: ") and "not covered" not in whole
    differ = score_line(Score("qa", "acc,none", value, value + 1, total, total), docs)
    assert differ.startswith("FAIL: ")
