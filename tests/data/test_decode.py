"""Batched decoding for data generation: the same tokens as HF generate, and captured hidden states equal
to a teacher-forced forward over the training ids."""

import itertools

import pytest
import torch

from headway.heads.base import compute_features
from headway.heads.target import load_target
from headway.train.data import decode as decode_module
from headway.train.data.decode import Tap, decode

MAX_NEW = 10


@pytest.fixture(scope="module")
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


@pytest.fixture(scope="module")
def prompts(target):
    tok = target.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": "ab" * k + "?"}], tokenize=False,
                                     add_generation_prompt=True) for k in range(1, 7)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def frequent_stop(target, prompts):
    """A token the tiny model emits mid-reply in some rows but not all: rows then stop at different steps."""
    tok = target.tokenizer
    first = decode(target.model, prompts, MAX_NEW, [], tok.pad_token_id).tokens
    counts = torch.bincount(torch.tensor([t for row in first for t in row[2:]]))
    return [int(counts.argmax()), tok.convert_tokens_to_ids("<|im_end|>")]


def hf_generate(target, prompt, stop):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=stop, pad_token_id=target.tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def left_padded(prompts, pad):
    """[B, width] ids with the prompts left-padded, and their attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= width - torch.tensor([len(p) for p in prompts])[:, None]).long()
    return ids, mask


# complete rows leave the batch at once (0), once half of it (0.5), or only when all are complete (1)
COMPACTIONS = [0.0, 0.5, 1.0]
# the prefill: the shared prefix once and every length its own group (0), or one left-padded forward (huge)
FORWARD_COSTS = [0, 10 ** 9]


@pytest.mark.parametrize("forward_cost", FORWARD_COSTS)
@pytest.mark.parametrize("compact_at", COMPACTIONS)
def test_greedy_decoding_equals_hf_generate_row_by_row(target, prompts, compact_at, forward_cost, monkeypatch):
    monkeypatch.setattr(decode_module, "COMPACT_AT", compact_at)
    monkeypatch.setattr(decode_module, "FORWARD_COST", forward_cost)
    stop = frequent_stop(target, prompts)
    got = decode(target.model, prompts, MAX_NEW, stop, target.tokenizer.pad_token_id)
    assert len(set(map(len, got.tokens))) > 1  # rows left the batch at different steps
    for p, tokens, finished in zip(prompts, got.tokens, got.finished):
        ref = hf_generate(target, p, stop)
        ref = ref[:next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))]  # generate pads after
        assert tokens == ref
        assert finished == (tokens[-1] in stop)


@pytest.mark.parametrize("forward_cost", FORWARD_COSTS)
@pytest.mark.parametrize("compact_at", COMPACTIONS)
def test_captured_hidden_states_equal_a_teacher_forced_forward(target, prompts, compact_at, forward_cost, monkeypatch):
    monkeypatch.setattr(decode_module, "COMPACT_AT", compact_at)
    monkeypatch.setattr(decode_module, "FORWARD_COST", forward_cost)
    stop = frequent_stop(target, prompts)
    glue = target.tokenizer("\n", add_special_tokens=False)["input_ids"]
    captured = {}

    def training_ids(b, new, finished):  # reply + end of turn + template glue, as a chat template renders
        if b == 2:
            return None  # not captured
        if b == 3:
            return prompts[b][:-1] + [0]  # does not extend what was fed: not captured
        return prompts[b] + new + ([] if finished else [stop[-1]]) + glue

    tap = Tap([1, 4], training_ids, lambda b, ids, hidden: captured.setdefault(b, (ids, hidden)))
    got = decode(target.model, prompts, MAX_NEW, stop, target.tokenizer.pad_token_id, tap=tap)
    assert sorted(captured) == [0, 1, 4, 5] and got.captured == 4
    for b, (ids, hidden) in captured.items():
        assert ids.tolist() == training_ids(b, got.tokens[b], got.finished[b])
        ref = compute_features(target.model, ids[None], None, [1])
        for i in (1, 4):
            err = (hidden[i] - ref.hidden_states[i][0]).norm() / ref.hidden_states[i][0].norm()
            assert err < 1e-5, (b, i, float(err))  # float rounding only (the cache checks 1e-4)


def test_sampling_is_seeded(target, prompts):
    def run(seed):
        return decode(target.model, prompts, MAX_NEW, [], target.tokenizer.pad_token_id, temperature=1.0,
                      top_p=0.9, generator=torch.Generator().manual_seed(seed)).tokens

    assert run(1) == run(1) and run(1) != run(2)


def test_one_shared_prompt_is_prefilled_once_with_the_same_result(target, prompts):
    """Rows with the same prompt (self-written prompts of a category) share one prefill."""
    def run(rows, temperature):
        return decode(target.model, rows, MAX_NEW, [], target.tokenizer.pad_token_id, temperature=temperature,
                      generator=torch.Generator().manual_seed(3)).tokens

    assert run([prompts[2]] * 3, 0.0) == run([prompts[2]], 0.0) * 3  # one row: no sharing
    assert len({tuple(t) for t in run([prompts[2]] * 4, 1.0)}) > 1  # rows sample on their own


def test_prefill_feeds_the_shared_prefix_once_and_pads_each_group_to_its_own_longest(target, prompts, monkeypatch):
    fed = []  # input_ids shapes of the model's forwards
    forward = target.model.forward
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: fed.append(k["input_ids"].shape) or forward(*a, **k))
    rows = prompts[:1] + prompts  # lengths differ; all start with the chat template's system turn

    def prefill(forward_cost):
        monkeypatch.setattr(decode_module, "FORWARD_COST", forward_cost)
        fed.clear()
        return decode(target.model, rows, 1, [], target.tokenizer.pad_token_id).tokens

    one_forward = prefill(10 ** 9)
    assert fed == [(len(prompts), max(map(len, prompts)))]  # left-padded to the longest, each prompt once
    grouped = prefill(0)
    shared = decode_module.shared_prefix(rows)
    assert shared > 0 and fed[0] == (1, shared)
    assert sum(b * w for b, w in fed[1:]) == sum(len(p) - shared for p in prompts)  # no pads fed, no prompt twice
    assert len(fed) - 1 == len(set(map(len, rows)))  # a group per length at no cost per forward
    assert grouped == one_forward


@pytest.mark.parametrize("forward_cost", FORWARD_COSTS)
def test_rows_with_the_same_prompt_share_one_prefill_and_what_it_captures(target, prompts, forward_cost,
                                                                           monkeypatch):
    """Candidates shown the same examples: each distinct prompt fed once, every row decoded and captured as if
    it had been fed on its own."""
    monkeypatch.setattr(decode_module, "FORWARD_COST", forward_cost)
    fed = []
    forward = target.model.forward
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: fed.append(k["input_ids"].shape) or forward(*a, **k))
    rows = [prompts[1], prompts[4], prompts[1], prompts[2], prompts[4], prompts[1]]
    captured = {}
    tap = Tap([1, 3], lambda b, new, finished: rows[b] + new,
              lambda b, ids, hidden: captured.setdefault(b, (ids, hidden)))
    got = decode(target.model, rows, MAX_NEW, [], target.tokenizer.pad_token_id, tap=tap)
    distinct = [prompts[1], prompts[4], prompts[2]]
    prompt_tokens = sum(b * w for b, w in fed if w > 1)  # the prefill's forwards (decode steps feed 1 token)
    assert prompt_tokens <= len(distinct) * max(map(len, distinct)) < sum(map(len, rows))  # each prompt once
    alone = decode(target.model, distinct, MAX_NEW, [], target.tokenizer.pad_token_id)
    assert got.tokens == [alone.tokens[i] for i in (0, 1, 0, 2, 1, 0)]
    assert sorted(captured) == list(range(len(rows)))
    for b, (ids, hidden) in captured.items():
        ref = compute_features(target.model, ids[None], None, [1, 3])
        for i in (1, 3):
            err = (hidden[i] - ref.hidden_states[i][0]).norm() / ref.hidden_states[i][0].norm()
            assert err < 1e-5, (b, i, float(err))
    sampled = decode(target.model, rows, MAX_NEW, [], target.tokenizer.pad_token_id, temperature=1.0,
                     generator=torch.Generator().manual_seed(0)).tokens
    assert sampled[0] != sampled[2] or sampled[2] != sampled[5]  # rows of one prompt sample on their own


@pytest.mark.parametrize("forward_cost", [0, 5, 20, 1000])
def test_prefill_groups_pad_least(forward_cost, monkeypatch):
    """The grouping is optimal: it costs what the best split of the sorted lengths costs."""
    monkeypatch.setattr(decode_module, "FORWARD_COST", forward_cost)
    lengths = torch.tensor([9, 3, 40, 12, 41, 3, 30, 7])
    groups = decode_module.prefill_groups(lengths)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(lengths)))
    got = sum(len(g) * int(lengths[g].max()) + forward_cost for g in groups)
    ranked = sorted(lengths.tolist())
    splits = (cuts for k in range(len(ranked)) for cuts in itertools.combinations(range(1, len(ranked)), k))
    best = min(sum((end - start) * ranked[end - 1] + forward_cost
                   for start, end in zip((0,) + cuts, cuts + (len(ranked),))) for cuts in splits)
    assert got == best


def test_growing_cache_layer_holds_what_dynamic_cache_holds():
    """Appends past the buffer's room (it grows), rows dropped and rows repeated: the same keys and values
    as transformers' DynamicLayer, step by step."""
    from transformers.cache_utils import DynamicLayer

    from headway.train.data.decode import GROWTH, GrowingLayer

    torch.manual_seed(0)
    mine, reference = GrowingLayer(), DynamicLayer()

    def both(*op):
        for layer in (mine, reference):
            out = getattr(layer, op[0])(*op[1:])
        return out

    both("update", torch.randn(4, 2, 5, 3), torch.randn(4, 2, 5, 3))
    for step in range(GROWTH + 10):
        k, v = torch.randn(4 if step < 20 else 2, 2, 1, 3), torch.randn(4 if step < 20 else 2, 2, 1, 3)
        if step == 20:
            both("batch_select_indices", torch.tensor([3, 1]))
        got = mine.update(k, v)
        want = reference.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    both("batch_repeat_interleave", 3)
    assert torch.equal(mine.keys, reference.keys) and mine.get_seq_length() == 5 + GROWTH + 10


def test_bf16_copy_groups_query_heads_at_decode_and_masks_left_pads(target, prompts, monkeypatch):
    """On a CPU the bf16 copy runs its own SDPA attention (query heads grouped per key head at a decode step);
    it still masks left pads, and decode() on it gives HF generate's greedy tokens on the same copy and
    left-padded batch, rows with and without a mask alike."""
    from headway.train.data.decode import PACKED_SDPA, bf16_copy

    twin = bf16_copy(target.model)
    assert twin.config._attn_implementation == PACKED_SDPA and target.model.config._attn_implementation == "sdpa"
    stop, pad = frequent_stop(target, prompts), target.tokenizer.pad_token_id
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    with torch.no_grad():  # a left-padded row reads as the row alone (bf16's rounding apart), pads unattended
        padded = twin(ids, attention_mask=mask).logits[0, -1].float()
        alone = twin(torch.tensor([prompts[0]])).logits[0, -1].float()
        pads_attended = twin(ids, attention_mask=torch.ones_like(mask)).logits[0, -1].float()
    assert (padded - alone).abs().max() < 0.25 * (pads_attended - alone).abs().max()

    monkeypatch.setattr(decode_module, "COMPACT_AT", 1.0)  # rows stay in the batch, as in generate
    for batch, batch_mask in ((ids, mask), (ids[-1:].expand(3, -1), mask[-1:].expand(3, -1))):
        mine = decode(twin, [prompts[-1]] * 3 if len(batch) == 3 else prompts, MAX_NEW, stop, pad).tokens
        out = twin.generate(batch, attention_mask=batch_mask, max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=stop, pad_token_id=pad)[:, width:]
        for row, theirs in zip(mine, out.tolist()):
            assert row == theirs[:len(row)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoding_on_a_gpu_mixes_no_devices(target, prompts, temperature, monkeypatch):
    """Data generation with the target on a GPU (tests/virtual_cuda.py's without one); sampling draws from a
    generator on the target's device, as torch requires there."""
    from headway.train.data.decode import decode_with
    from tests.virtual_cuda import on_gpu

    expected = decode_with(target, prompts, MAX_NEW, [], temperature, 0.9, seed=0).tokens
    with on_gpu(monkeypatch, target.model) as gpu:
        out = decode_with(target, prompts, MAX_NEW, [], temperature, 0.9, seed=0)
    assert out.tokens == expected or not gpu.virtual  # a real GPU draws other random numbers


@pytest.fixture(scope="module")
def wide_heads():
    """A tiny target with 64-wide attention heads (3 query heads over 1 key/value head), what the kernel takes."""
    return load_target({"path": "tiny-random", "name": "tiny-random",
                        "tiny": {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1}})


def kernel_calls(monkeypatch) -> list[int]:
    """Spy on heads/kernels/decode_attention: the cached length of every call."""
    from headway.heads.kernels import decode_attention as kernel_module

    if not kernel_module.available():
        pytest.skip("the decode-attention kernel needs AVX-512 or AVX2 and a C++ compiler")
    calls, real = [], kernel_module.kernel().decode_attention
    spy = type("Spy", (), {"decode_attention": staticmethod(lambda *a: calls.append(a[1].shape[2]) or real(*a))})
    monkeypatch.setattr(kernel_module, "kernel", lambda: spy)
    return calls


def test_bf16_copy_decodes_through_the_attention_kernel(wide_heads, prompts, monkeypatch):
    """Every decode step's attention on the bf16 copy is the kernel's; greedy tokens are HF generate()'s on the
    same copy and left-padded batch."""
    calls = kernel_calls(monkeypatch)
    twin = decode_module.bf16_copy(wide_heads.model)
    monkeypatch.setattr(decode_module, "COMPACT_AT", 1.0)  # rows stay in the batch, as in generate
    pad, layers = wide_heads.tokenizer.pad_token_id, wide_heads.model.config.num_hidden_layers
    mine = decode(twin, prompts, MAX_NEW, [], pad).tokens
    assert len(calls) == (MAX_NEW - 1) * layers  # every step after the prefill, every layer
    ids, mask = left_padded(prompts, pad)
    out = twin.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=pad)
    assert mine == out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("layout", ["stock", "panel"])
def test_fp32_generation_decodes_through_the_attention_kernel(wide_heads, prompts, layout, monkeypatch):
    """While the fp32 target generates (in a weight layout), its decode steps run the kernel: the same greedy
    tokens as SDPA gives, and the model's own attention back afterwards."""
    from headway.heads.kernels.weight_layout import candidates
    from headway.train.data.decode import generating

    if layout not in candidates(wide_heads.model):
        pytest.skip(f"{layout} is not offered on this machine")
    pad = wide_heads.tokenizer.pad_token_id
    expected = decode(wide_heads.model, prompts, MAX_NEW, [], pad).tokens  # SDPA
    before = wide_heads.model.config._attn_implementation
    calls = kernel_calls(monkeypatch)
    with generating(wide_heads, layout, "fp32"):
        got = decode(wide_heads.model, prompts, MAX_NEW, [], pad).tokens
    assert calls and got == expected
    assert wide_heads.model.config._attn_implementation == before
