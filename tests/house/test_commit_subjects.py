"""The commit-msg hook (tools/hooks/commit-msg) holds the house's habit: a subject of at most 72 characters."""

from __future__ import annotations

import subprocess


def _hook(repo_root, tmp_path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["bash", str(repo_root / "tools" / "hooks" / "commit-msg"), str(path)],
                          capture_output=True, text=True, timeout=30)


def test_a_subject_over_72_characters_is_refused_and_72_pass(repo_root, tmp_path):
    refused = _hook(repo_root, tmp_path, "x" * 73 + "\n\nthe body may be as long as it needs\n")
    assert refused.returncode == 1 and "73 characters" in refused.stderr
    assert _hook(repo_root, tmp_path, "# a comment git strips\n" + "y" * 72 + "\n\n" + "z" * 300 + "\n").returncode == 0
