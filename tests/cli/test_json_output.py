"""`--json` commands print exactly one JSON document on stdout: what the work prints, logs to a stdout handler
(as vLLM's logger does) or writes to descriptor 1 (C code, engine processes) goes to stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NOISY = """
import logging, os, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="INFO %(message)s")  # vLLM's habit
import detent_audit.verifier.verify as verify_module
original = verify_module.verify
def noisy(*args, **kwargs):
    print("a print")
    logging.getLogger("engine").info("a log line")
    os.write(1, b"a write to descriptor 1\\n")
    return original(*args, **kwargs)
verify_module.verify = noisy
from detent_audit.cli import main
sys.argv = ["detent-audit", *sys.argv[1:]]
main()
"""


def test_verify_json_prints_one_document_and_the_work_s_output_on_stderr(tmp_path: Path) -> None:
    from detent_audit.manifests.keys import generate_key

    key = generate_key(tmp_path / "node.key")
    (tmp_path / "junk.receipt").write_bytes(b"not a receipt")
    res = subprocess.run([sys.executable, "-c", NOISY, "verify", str(tmp_path / "junk.receipt"), "--key",
                          str(key.public_path), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    doc = json.loads(res.stdout)  # the whole of stdout is the one document
    assert doc["counts"]["BAD"] == 1 and doc["exit_code"] == 2
    for line in ("a print", "INFO a log line", "a write to descriptor 1"):
        assert line in res.stderr and line not in res.stdout
