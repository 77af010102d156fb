"""The plain nats-py example in docs/api.md runs against a real `sandhold up`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import Up

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "plain_nats.py"
API_DOC = ROOT / "docs" / "api.md"


def test_api_doc_embeds_the_example_verbatim() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```$", API_DOC.read_text(), re.S | re.M)
    assert EXAMPLE.read_text() in blocks, (
        "docs/api.md must contain docs/examples/plain_nats.py verbatim in a ```python block"
    )


def test_plain_nats_example_runs_a_command(tmp_path: Path) -> None:
    up = Up(tmp_path / "data").start()
    try:
        done = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                up.nats_url,
                str(up.data_dir / "credentials" / "operator.json"),
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,
        )
    finally:
        up.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hello from sandhold" in done.stdout
    assert "command ended: state=exited exit_code=3" in done.stdout, done.stdout
