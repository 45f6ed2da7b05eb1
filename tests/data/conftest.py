import pytest

from headway.heads.target import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The default target's real tokenizer and chat template (from its GGUF; ~7 s, once per test run)."""
    from transformers import AutoTokenizer

    from headway.heads.target import SMOLLM2_GGUF, fetch_smollm2

    return AutoTokenizer.from_pretrained(str(fetch_smollm2()), gguf_file=SMOLLM2_GGUF)
