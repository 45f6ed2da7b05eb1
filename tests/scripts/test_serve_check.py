"""scripts/serve_check.py: how vLLM's recorded drafts are paired with their contexts, headway's side of the
comparison, and (marker `serve`, deselected by default) the live run itself when the peers' venvs exist."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from headway.heads.base import build_head
from test_export import draft, prompt_ids, target  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]


def serve_check():
    if "headway_serve_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("headway_serve_check", ROOT / "scripts" / "serve_check.py")
        module = sys.modules["headway_serve_check"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["headway_serve_check"]


def test_draft_contexts_follow_the_accepted_tokens():
    prompt, output = [100, 101], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    drafts = [[2, 3, 9],  # after prompt + [1]: 2 and 3 accepted, 4 is the bonus -> known 4
              [5, 0, 0],  # after [1..4]: 5 accepted, 6 bonus -> known 6
              [0, 0, 0],  # after [1..6]: nothing accepted, 7 -> known 7
              [8, 9, 10],  # after [1..7]: would reach past the output (7 + 3 + 1 > 10): the last known context
              [1, 1, 1]]
    pairs, accepted = serve_check().draft_contexts(prompt, output, drafts)
    assert [context for context, _ in pairs] == [prompt + output[:1], prompt + output[:4], prompt + output[:6],
                                                 prompt + output[:7]]
    assert [d for _, d in pairs] == drafts[:4] and accepted == 3


def test_headway_chain_is_the_engines_top1_chain(target):  # noqa: F811
    torch.manual_seed(0)
    head = build_head("eagle", target).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    ids = prompt_ids(target)
    chain = serve_check().headway_chain(head, target, ids[0].tolist(), 3)
    root_logits, children_logits = draft(head, target, ids)  # root, then the two best children
    assert len(chain) == 3 and chain[0] == int(root_logits.argmax())
    assert chain[1] == int(children_logits[0, 0].argmax())  # the best child's own best continuation


@pytest.mark.serve
def test_exports_served_live(tmp_path):
    """The whole check (tiny target; minutes): vLLM serves every servable format with drafts equal to headway's,
    speculators and SpecForge load the EAGLE-3 exports with forwards equal to headway's."""
    venvs = Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway")) / "venvs"
    if not (venvs / serve_check().VENVS["vllm"].name / serve_check().READY).is_file():
        pytest.skip(f"no vLLM venv under {venvs}: run scripts/serve_check.py once to create it")
    assert serve_check().main(["--work", str(tmp_path), "--venvs", str(venvs)]) == 0
