"""Fixtures for head tests: the tiny random target and a small fixed batch of chat-rendered text."""

import pytest
import torch

from head_helpers import chat_batch
from headway.heads.target import load_target

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


@pytest.fixture(scope="session")
def batch(target):
    return chat_batch(target.tokenizer)
