"""bench_peer's input checks run before anything is built (no venvs needed)."""

import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_a_missing_data_file_is_one_clear_error_before_any_work(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sys.modules.pop("bench_peer", None)
    bench_peer = importlib.import_module("bench_peer")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^error: --data .*nope\.jsonl: no such file"):
        bench_peer.main(["--out", str(out), "--data", str(tmp_path / "nope.jsonl")])
    assert not out.exists()
