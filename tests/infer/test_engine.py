"""The engine's plain decoding is HF greedy decoding; bad requests fail with one clear error."""

import pytest
import torch

from headway.heads.target import load_target
from headway.infer.engine import CacheFullError, EngineError, Engine, GenerationStats


@pytest.fixture(scope="module")
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_plain_greedy_equals_hf_generate_for_a_ragged_batch(target):
    prompts = prompts_of([9, 3, 21, 1])
    out = Engine(target, block_size=4).generate(prompts, max_new_tokens=12, stop_on_eos=False)
    for prompt, tokens in zip(prompts, out.tokens):
        assert tokens == hf_greedy(target.model, prompt, 12)
    stats = out.stats
    assert stats.tau == 1.0 and stats.target_forwards == 11 and stats.new_tokens == 48
    ms = stats.step_ms()  # every decode step timed as a plain one; no speculative phases
    assert stats.plain_steps == 11 and 0 < stats.plain_s <= stats.decode_s
    assert ms["plain"] > 0 and ms["speculative"] is None and ms["drafting"] is None


def test_rows_stop_at_their_own_eos(target):
    prompts = prompts_of([5, 8])
    free = Engine(target).generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens
    eos = free[0][3]  # pretend row 0's 4th token is the end of turn
    out = Engine(target, eos_token_id=eos).generate(prompts, max_new_tokens=10)
    assert out.tokens[0] == free[0][:4]
    cut = free[1].index(eos) + 1 if eos in free[1] else 10
    assert out.tokens[1] == free[1][:cut]


def test_sampling_is_reproducible_with_a_seed(target):
    engine = Engine(target)
    prompts = prompts_of([6, 2])
    a = engine.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3, stop_on_eos=False)
    b = engine.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3, stop_on_eos=False)
    assert a.tokens == b.tokens


def test_bad_requests_fail_clearly(target):
    engine = Engine(target)
    with pytest.raises(EngineError, match="at least one token"):
        engine.generate([[1, 2], []])
    with pytest.raises(EngineError, match="temperature"):
        engine.generate([[1, 2]], temperature=-1)
    with pytest.raises(EngineError, match="top_p"):
        engine.generate([[1, 2]], temperature=1, top_p=0)
    with pytest.raises(CacheFullError, match="pool exhausted"):
        Engine(target, max_cache_tokens=64, block_size=8).generate([[1] * 30, [2] * 30], max_new_tokens=20)
    limit = target.config.max_position_embeddings
    with pytest.raises(CacheFullError, match="max_position_embeddings"):
        engine.generate([[1] * limit], max_new_tokens=1)


def test_stats_of_several_calls_add_up_to_micro_averages():
    a = GenerationStats(row_steps=3, emitted=5, accepted_at_depth=[2], drafted_at_depth=[3], speculative_steps=3,
                        draft_s=0.5, drafting_stopped_at=2)
    b = GenerationStats(row_steps=2, emitted=4, accepted_at_depth=[1, 1], drafted_at_depth=[2, 1], speculative_steps=2,
                        draft_s=0.25)
    a.add(b)
    assert (a.row_steps, a.emitted, a.speculative_steps, a.draft_s) == (5, 9, 5, 0.75)
    assert a.accepted_at_depth == [3, 1] and a.drafted_at_depth == [5, 1]  # the longer list sets the depths
    assert a.tau == pytest.approx(9 / 5) and a.acceptance_by_depth == pytest.approx([3 / 5, 1.0])
    assert a.step_ms()["drafting"] == pytest.approx(150.0)
    assert a.drafting_stopped_at == 2  # one call's, not summed
