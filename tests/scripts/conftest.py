"""What the tests of scripts/ share: a script imported fresh, finding its neighbours as `python scripts/NAME.py`
does (scripts/ on sys.path)."""

import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def load_script(monkeypatch):
    """load_script(name) -> the module scripts/<name>.py, imported anew for this test."""
    monkeypatch.syspath_prepend(str(SCRIPTS))

    def load(name):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load
