"""A clean accelerate state between in-process `train()` runs."""

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process `train()` builds its own Accelerator (accelerate keeps process-wide state)."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
