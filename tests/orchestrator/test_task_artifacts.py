"""Artifacts: matched in the task's final Snapshot, listed on the task, and
read back byte for byte from the save store through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.harness import Up

AGENT = (
    "mkdir -p out/deep && printf 'report\\n' > out/report.txt && "
    "head -c 3000000 /dev/urandom > out/deep/blob.bin && echo ignored > notes.md"
)


def test_artifacts_are_listed_and_read_back_from_the_save_store(tmp_path: Path):
    manifest = tmp_path / "task.yaml"
    manifest.write_text(
        "name: artifacts\n"
        f"agent: {{command: [sh, -c, {json.dumps(AGENT)}]}}\n"
        "artifacts: ['out/*.txt', 'out/**/*.bin']\n"
    )
    up = Up(tmp_path / "data").start()
    try:
        submitted = up.cli_json("task", "submit", str(manifest))
        done = up.cli("task", "watch", submitted["id"], timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        task = up.cli_json("task", "show", submitted["id"])
        listed = {a["path"]: a["size"] for a in task["artifacts"]}
        assert listed == {"out/report.txt": 7, "out/deep/blob.bin": 3_000_000}
        workspace = up.workspace(task["sandbox_id"])
        for path in listed:
            copy = tmp_path / Path(path).name
            got = up.cli("task", "artifact", submitted["id"], path, "-o", str(copy))
            assert got.returncode == 0, got.stderr
            assert copy.read_bytes() == (workspace / path).read_bytes()
        missing = up.cli("task", "artifact", submitted["id"], "notes.md")
        assert missing.returncode == 2 and "artifact_not_found" in missing.stderr
    finally:
        up.stop()
