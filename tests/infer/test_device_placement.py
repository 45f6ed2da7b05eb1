"""With the target and the head on a GPU, the engine keeps every tensor where CUDA needs it: on a real GPU where
there is one, else on tests/virtual_cuda.py's, which marks the weights as CUDA tensors and fails any operation
that would mix devices on a real one (the host-side bookkeeping stays on the CPU, as designed)."""

from pathlib import Path

import pytest
import torch

from headway.heads.base import build_head
from headway.heads.target import load_target
from headway.infer.calibrate import TreeBudget
from headway.infer.drafters import build_drafter
from headway.infer.engine import Engine
from test_speculative import prompts, target  # noqa: F401  (fixtures: the tiny target, a ragged batch)
from tests.virtual_cuda import DeviceMixError, on_gpu

NEW = 12



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the virtual GPU")
def test_the_checker_catches_a_device_mix(monkeypatch):
    with on_gpu(monkeypatch):
        weight = torch.ones(4, 4, device="cuda")
        assert weight.device.type == "cuda" and weight.cpu().device.type == "cpu"
        assert (weight @ torch.ones(4, 4).cuda()).device.type == "cuda"
        weight[torch.tensor([0, 1])] = 2.0  # CPU indices into a CUDA tensor: allowed, as on a GPU
        with pytest.raises(DeviceMixError, match="mixes"):
            weight @ torch.ones(4, 4)
        with pytest.raises(DeviceMixError, match="generator"):
            torch.rand(3, device="cuda", generator=torch.Generator())


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_on_a_gpu_mixes_no_devices(target, prompts, kind, temperature, monkeypatch):
    torch.manual_seed(0)
    head = build_head(kind, target)
    with on_gpu(monkeypatch, target.model, head):
        plain = Engine(target).generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens
        for policy, opts in [("dynamic", dict(total_tokens=8, depth=3, top_k=3)), ("auto", {})]:
            drafter = build_drafter("head", target, head=head, policy=policy, **opts)
            out = Engine(target, drafter, block_size=4, budget=TreeBudget()).generate(
                prompts, max_new_tokens=NEW, temperature=temperature, seed=0, stop_on_eos=False)
            if temperature == 0:
                assert out.tokens == plain, (kind, policy)


def test_plain_decoding_on_a_gpu_mixes_no_devices(target, prompts, monkeypatch):
    plain = Engine(target).generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens
    with on_gpu(monkeypatch, target.model) as gpu:
        tokens = Engine(target).generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens
        Engine(target).generate(prompts, max_new_tokens=NEW, temperature=1.0, seed=0, stop_on_eos=False)
    assert tokens == plain or not gpu.virtual  # the same arithmetic on the virtual GPU


def test_evaluate_on_a_gpu_mixes_no_devices(tmp_path, monkeypatch):
    """The whole evaluation (target and head loaded onto the GPU in bf16, the latency curve, the engine's
    speculative and plain decoding, transformers' generate()) as `device=cuda` runs it."""
    from hydra import compose, initialize_config_dir

    from headway.heads.base import save_head
    from headway.infer import evaluate as ev

    repo = Path(__file__).resolve().parents[2]
    head = save_head(build_head("eagle", load_target({"path": "tiny-random", "name": "tiny-random"})),
                     tmp_path / "final")
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text('{"prompt": "Name three colours."}\n{"prompt": "abc abc abc abc"}\n')
    with initialize_config_dir(str(repo / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"checkpoint={head}", f"prompts={prompt_file}", "device=cuda", "max_new_tokens=8",
                                         f"output={tmp_path / 'out'}", "plot=false"])
    with on_gpu(monkeypatch) as gpu:
        if gpu.virtual:  # device=cuda is refused where torch sees no GPU: here it sees the virtual one
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        result = ev.evaluate(cfg, out=lambda *_: None)
    assert result["greedy_match"] == 1.0


def test_a_static_tree_reads_the_gpu_once_per_level(monkeypatch):
    """Each level's children come from one top-k over all its parents, so building a 40-node tree waits for the
    GPU once per level, not once per parent (each wait is a round trip that a GPU step cannot hide)."""
    from headway.infer.drafters import StaticTree

    tree = StaticTree.from_accuracies([0.8, 0.6, 0.5, 0.4], total_nodes=40, top_k=8)
    depth = max(len(p) for p in tree.choices)
    parents = len({p[:-1] for p in tree.choices})
    assert parents > depth  # a bushy tree: per-parent reads would show

    class Proposer:  # children's logits from the parent's hidden state, computed on the GPU
        max_depth = None

        def expand(self, depth, tokens, parent_hidden, parents, positions):
            return parent_hidden @ readout, parent_hidden + 1  # [B, G, V], [B, G, h]

    with on_gpu(monkeypatch) as gpu:
        readout = torch.randn(8, 300, device="cuda")
        hidden = torch.randn(2, 8, device="cuda")
        tokens, tree_parents, _ = tree.build(Proposer(), torch.tensor([5, 7], device="cuda"), hidden @ readout, hidden,
                                             40, torch.tensor([3, 4]), None)
    assert tokens.shape == (2, 40) and tree_parents.shape == (40,)
    assert gpu.host_reads == 1 + depth or not gpu.virtual  # the root's tokens, then one top-k per level
