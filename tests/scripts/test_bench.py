"""Smoke tests: every benchmark script runs at tiny sizes (`--quick`), prints its table and ends with the
headline ratio `<number>x`. Times are never asserted."""

import re

import pytest
import torch

HEADLINE = re.compile(r": \d+(\.\d+)?x$")


@pytest.fixture
def script(load_script, monkeypatch, tmp_path):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))  # calibration curves land in tmp
    return load_script


def run(module, argv, capsys) -> list[str]:
    module.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    assert HEADLINE.search(lines[-1]), lines[-1]
    return lines


def test_bench_kv_cache(script, capsys):
    lines = run(script("bench_kv_cache"), ["--quick"], capsys)
    assert any("PagedKVCache" in line for line in lines) and any("preallocate" in line for line in lines)


def test_bench_decode(script, capsys, tmp_path):
    lines = run(script("bench_decode"), ["--quick", "--heads", str(tmp_path / "missing")], capsys)
    out = "\n".join(lines)
    assert "skipping head" in out
    for method in ("hf_generate", "hf_prompt_lookup", "headway_plain", "headway_prompt_lookup"):
        assert method in out
    # greedy outputs of the engine's speculative paths equal its plain decoding
    greedy = [line for line in lines if line.strip().startswith("0 ") and "headway" in line]
    assert greedy and all(line.split()[-2] == "2/2" for line in greedy)  # the column before "drafting stopped"


def test_bench_decode_compares_a_learned_plan_with_the_validation_one(script, capsys, tmp_path):
    from headway.heads.base import build_head, save_head
    from headway.heads.target import load_target

    save_head(build_head("eagle", load_target({"path": "tiny-random", "name": "tiny-random"})), tmp_path / "final")
    lines = run(script("bench_decode"), ["--quick", "--temperatures", "0", "--heads", str(tmp_path / "final"),
                                         "--validation-plan", "--tree", "draft_cost=0.001"], capsys)  # drafting pays
    plans = [line for line in lines if line.startswith("headway_eagle") and "(last call)" in line]
    assert len(plans) == 2  # the learned plan counted the warm-up's and the prompts' drafts; the other did not
    assert "'acceptance_from': 'prior + " in plans[0] and "'acceptance_from': 'prior'}" in plans[1]
    greedy = [line for line in lines if line.strip().startswith("0 ") and "headway_eagle" in line]
    assert len(greedy) == 2 and all(line.split()[-2] == "2/2" for line in greedy)  # both lossless
    assert lines[-1].startswith("headway_eagle, plan learned in this run vs from its validation acceptance")


def test_bench_decode_refuses_a_validation_plan_for_another_policy(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_decode").main(["--quick", "--validation-plan", "--tree", "policy=dynamic"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: --validation-plan")


def test_bench_decode_passes_the_drafting_guard(script, capsys, monkeypatch):
    module = script("bench_decode")
    guards = []

    class Recording(module.Engine):  # the real engine, noting the guard each speculative engine was given
        def __init__(self, target, drafter=None, **kwargs):
            super().__init__(target, drafter, **kwargs)
            if drafter is not None:
                guards.append(self.stop_unpaid_drafting)
    monkeypatch.setattr(module, "Engine", Recording)
    lines = run(module, ["--quick", "--temperatures", "0", "--stop-unpaid-drafting", "always"], capsys)
    assert guards == ["always"]  # prompt lookup's engine (no head folder given)
    greedy = [line for line in lines if line.strip().startswith("0 ") and "headway" in line]
    assert greedy and all(line.split()[-2] == "2/2" for line in greedy)  # still lossless
    with pytest.raises(SystemExit):
        module.parse_args(["--stop-unpaid-drafting", "sometimes"])


def test_bench_batch(script, capsys):
    lines = run(script("bench_batch"), ["--quick"], capsys)
    assert any(line.split()[:1] == ["4"] for line in lines)  # a row for batch 4


def test_bench_train_scaling(script, capsys):
    module = script("bench_train")
    lines = run(module, ["--quick", "--scaling", "--heads", "medusa", "eagle"], capsys)
    growth_line = re.compile(r"^(\w+): head cost per token at 64 vs 32 tokens: (\d+\.\d+)x \((.+?);")
    growth = {m[1]: (float(m[2]), m[3]) for m in map(growth_line.match, lines) if m}
    assert set(growth) == {"medusa", "eagle"}
    for g, verdict in growth.values():  # the verdict follows the measured growth, whichever it is
        assert verdict == ("no worse than linear" if g <= module.LINEAR_SLACK else "WORSE than linear")
    worst = re.search(r"worst head \((\w+)\)", lines[-1])[1]  # the headline names the fastest-growing head
    assert growth[worst][0] == max(g for g, _ in growth.values())
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == growth[worst][0]


def test_bench_train_vocabulary(script, capsys):
    """The tiny target's vocabulary is below 8,192: both recipes read every row, and the table says so."""
    lines = run(script("bench_train"), ["--quick", "--heads", "eagle", "mtp"], capsys)
    rows = [line.split() for line in lines[:-1] if line.split()[:1] in (["eagle"], ["mtp"])]
    rows = [r for r in rows if r[2:3] == ["vocabulary"]]
    assert len(rows) == 4 and len({r[-3] for r in rows}) == 1  # same row count for both read-outs
    assert lines[-1].startswith("eagle head step, training vocabulary vs whole vocabulary")


def test_bench_train_precision(script, capsys):
    """fp32 and bf16 autocast rows per head; the headline is EAGLE's fp32 / bf16 step time from that table."""
    lines = run(script("bench_train"), ["--quick", "--precision", "--heads", "eagle", "mtp"], capsys)
    rows = [r for r in map(str.split, lines[:-1]) if r[:1] in (["eagle"], ["mtp"])]
    table = {(r[0], r[-3]): float(r[-2]) for r in rows}
    assert set(table) == {(h, p) for h in ("eagle", "mtp") for p in ("fp32", "autocast")}
    assert lines[-1].startswith("eagle head step, bf16 autocast vs fp32")
    ratio = table["eagle", "fp32"] / table["eagle", "autocast"]
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == pytest.approx(ratio, abs=0.02)


def test_bench_train_allocator(script, capsys):
    """Freed memory returned and kept, each timed in its own processes; the headline is EAGLE's ratio of the
    table's step times."""
    lines = run(script("bench_train"), ["--quick", "--allocator", "--heads", "eagle"], capsys)
    rows = {r[1]: r for r in map(str.split, lines[:-1]) if r[:1] == ["eagle"] and len(r) == 5}
    assert set(rows) == {"returned", "kept"}
    assert lines[-1].startswith("eagle head step, freed memory kept vs returned")
    ratio = float(rows["returned"][2]) / float(rows["kept"][2])
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == pytest.approx(ratio, abs=0.02)


def test_bench_train_allocator_bad_target_is_one_error_line(script, capsys):
    """The child processes' error comes back as the benchmark's own: one line, exit 2, no table."""
    with pytest.raises(SystemExit) as exit_:
        script("bench_train").main(["--allocator", "--target", "/no/such/target"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: target.path '/no/such/target'")
    assert "head ms/step" not in out


def test_bench_train_attention(script, capsys):
    """Chain attention and the dense mask per unrolling head (Medusa is left out); the headline is EAGLE's ratio."""
    lines = run(script("bench_train"), ["--quick", "--attention", "--heads", "medusa", "eagle", "eagle3"], capsys)
    rows = {(r[0], r[1]): float(r[-2]) for r in map(str.split, lines[:-1]) if r[:1] in (["eagle"], ["eagle3"])
            and len(r) in (4, 5)}  # "eagle dense mask ms tok/s", "eagle chain ms tok/s"
    assert set(rows) == {(h, a) for h in ("eagle", "eagle3") for a in ("dense", "chain")}
    assert lines[-1].startswith("eagle head step, chain attention vs a dense mask")
    ratio = rows["eagle", "dense"] / rows["eagle", "chain"]
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == pytest.approx(ratio, abs=0.02)


def test_bench_train_muon(script, capsys):
    """optim=muon orthogonalising in bf16 and in fp32, and AdamW alone, per head; the headline is the first head's
    bf16 / fp32 step time from that table."""
    lines = run(script("bench_train"), ["--quick", "--muon", "--heads", "eagle3", "mtp"], capsys)
    rows = {(r[0], r[-3]): float(r[-2]) for r in map(str.split, lines[:-1]) if r[:1] in (["eagle3"], ["mtp"])}
    assert set(rows) == {(h, o) for h in ("eagle3", "mtp") for o in ("bf16", "fp32", "alone")}
    assert lines[-1].startswith("eagle3 head step with optim=muon, orthogonalised in fp32 vs bf16")
    ratio = rows["eagle3", "bf16"] / rows["eagle3", "fp32"]
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == pytest.approx(ratio, abs=0.02)


def test_bench_train_attention_without_an_unrolling_head_is_one_error_line(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_train").main(["--quick", "--attention", "--heads", "medusa", "mtp"])
    assert "error: --attention times the heads that unroll" in str(exit_.value.code)


def test_bench_layouts(script, capsys):
    lines = run(script("bench_layouts"), ["--target", "tiny-random", "--rows", "1", "4", "--repeats", "1"], capsys)
    table = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert {"stock", "wide-column"} <= set(table) and table["stock"][-2:] == ["1", "1"]  # stock vs itself


def test_bench_gemm(script, capsys):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    lines = run(script("bench_gemm"), ["--target", "tiny-random", "--rows", "4", "16", "--repeats", "1"], capsys)
    table = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert {"mkl", "onednn"} <= set(table) and "at 16 rows: MKL / oneDNN" in lines[-1]


def test_bench_attention(script, capsys):
    from headway.heads.kernels.decode_attention import available

    if not available():
        pytest.skip("the decode-attention kernel needs AVX-512 or AVX2 and a C++ compiler")
    lines = run(script("bench_attention"), ["--batch", "4", "--lengths", "16", "40", "--repeats", "1"], capsys)
    assert [line.split()[0] for line in lines[2:4]] == ["16", "40"] and "at 40 cached tokens" in lines[-1]


def test_bench_attention_refuses_heads_that_do_not_group(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_attention").main(["--heads", "8", "--kv-heads", "3"])
    assert exit_.value.code == 2 and "--heads 8 is not a multiple of --kv-heads 3" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--kv-heads", "0"], ["--lengths", "100", "0"], ["--repeats", "0"]])
def test_bench_attention_refuses_sizes_below_one(script, capsys, bad):
    with pytest.raises(SystemExit) as exit_:
        script("bench_attention").main(bad)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().splitlines() == [
        "error: --batch, --heads, --kv-heads, --lengths and --repeats must be >= 1"]


def test_bench_layouts_refuses_zero_rows(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_layouts").main(["--target", "tiny-random", "--rows", "0"])
    assert exit_.value.code == 2 and "--rows and --repeats must be >= 1" in capsys.readouterr().err


def test_bench_datagen(script, capsys):
    lines = run(script("bench_datagen"), ["--target", "tiny-random", "--batch-sizes", "16,32", "--context", "8",
                                          "--steps", "2"], capsys)
    table = [line for line in lines if "decode step" in line and not line.startswith("{")]
    assert len(table) == 4  # two batch sizes, with and without capture


def test_bench_datagen_refuses_a_batch_it_cannot_copy(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_datagen").main(["--target", "tiny-random", "--batch-sizes", "16,24"])
    assert exit_.value.code == 2 and "--batch-sizes must be multiples of 16" in capsys.readouterr().err


def test_bench_generate_compares_weight_layouts(script, capsys):
    lines = run(script("bench_generate"), ["--target", "tiny-random", "--prompts", "3", "--batch-size", "2",
                                           "--max-new-tokens", "3", "--weight-layouts", "stock", "wide-column", "bf16"],
                capsys)
    assert lines[0].startswith("stock: ") and lines[1].startswith("wide-column: ") and "of 3)" in lines[1]
    assert lines[2].startswith("bf16: ") and lines[-1].startswith("bf16 / stock tokens/s: ")


def test_bench_generate_times_the_prompt_writing_stage(script, capsys):
    """--stage prompts: the target writes candidates (sampled, so bf16 and fp32 write other text); the same
    entry twice writes the same prompts (seeded); HF's own attention is back in place after."""
    from headway.train.data import decode as decode_module

    lines = run(script("bench_generate"), ["--target", "tiny-random", "--prompts", "3", "--batch-size", "2",
                                           "--stage", "prompts", "--weight-layouts", "stock", "bf16:hf-attention",
                                           "bf16:sdpa", "bf16", "stock"], capsys)
    assert lines[1].startswith("bf16:hf-attention: ") and lines[2].startswith("bf16:sdpa: ")
    assert lines[3].startswith("bf16: ")
    assert lines[4].startswith("stock: ") and "prompts written identical to stock's: 3 of 3)" in lines[4]
    assert lines[-2].startswith("3 prompts written") and lines[-1].startswith("stock / stock tokens/s: ")
    assert decode_module.GROUPED_DECODE_ATTENTION and decode_module.DECODE_ATTENTION_KERNEL


def test_bench_generate_writes_prompts_with_and_without_examples(script, capsys):
    lines = run(script("bench_generate"), ["--target", "tiny-random", "--prompts", "3", "--batch-size", "2",
                                           "--stage", "prompts", "--weight-layouts", "stock", "--examples", "0", "2"],
                capsys)
    assert lines[0].startswith("stock with 0 examples: ") and "candidates/s of" in lines[0]
    assert lines[1].startswith("stock with 2 examples: ") and "identical to stock with 0 examples's" in lines[1]
    assert lines[-1].startswith("stock with 2 examples / stock with 0 examples tokens/s: ")


def test_bench_generate_times_the_padded_prefill_against_the_grouped_one(script, capsys):
    from headway.train.data import decode as decode_module

    cost = decode_module.FORWARD_COST
    lines = run(script("bench_generate"), ["--target", "tiny-random", "--prompts", "3", "--batch-size", "3",
                                           "--stage", "prompts", "--weight-layouts", "stock:padded", "stock",
                                           "--examples", "2"], capsys)
    assert lines[0].startswith("stock:padded: ") and lines[1].startswith("stock: ")
    assert lines[-1].startswith("stock / stock:padded tokens/s: ")
    assert decode_module.FORWARD_COST == cost  # the build's grouping again after


def test_bench_generate_refuses_examples_outside_the_prompt_stage(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_generate").main(["--target", "tiny-random", "--weight-layouts", "stock", "--examples", "3"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: --examples: counts of 0 or more")


@pytest.mark.parametrize("layout,why", [("tiles", "tiles: weight_layout=tiles needs a target"),
                                        ("nosuch", "nosuch: use one of auto, stock"),
                                        ("stock:blas", "stock:blas: after ':' name the GEMM (mkl, onednn), sdpa or padded")])
def test_bench_generate_refuses_a_layout_before_generating(script, capsys, layout, why):
    with pytest.raises(SystemExit) as exit_:
        script("bench_generate").main(["--target", "tiny-random", "--prompts", "2", "--weight-layouts", "stock", layout])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.err.startswith(f"error: --weight-layouts {why}") and not out.out


@pytest.mark.parametrize("name", ["bench_batch", "bench_decode", "bench_kv_cache", "bench_train"])
@pytest.mark.parametrize("device, why", [("gpu", "is not a device"), ("cuda", "sees no CUDA device")])
def test_a_device_that_is_not_there_is_one_error_line(script, capsys, name, device, why):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_:
        script(name).main(["--quick", "--device", device])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: --device {device} ") and why in err


def test_bench_train_row_blocks_with_a_head_option(script, capsys):
    """Row blocks and one block per head, the head option applied to the heads that have it; the headline is
    EAGLE-3's ratio of the table's step times (no EAGLE here)."""
    lines = run(script("bench_train"), ["--quick", "--row-blocks", "--heads", "eagle3", "mtp",
                                        "--head-option", "draft_vocab_size=64"], capsys)
    assert "draft_vocab_size=64" in lines[0] + lines[1]
    rows = {(r[0], r[1]): float(r[-2]) for r in map(str.split, lines[:-1]) if r[:1] in (["eagle3"], ["mtp"])
            and len(r) in (5, 6)}  # "eagle3 one block ms tok/s", "eagle3 row blocks ms tok/s"
    assert set(rows) == {(h, b) for h in ("eagle3", "mtp") for b in ("one", "row")}
    assert lines[-1].startswith("eagle3 head step, row blocks vs one block")
    ratio = rows["eagle3", "one"] / rows["eagle3", "row"]
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == pytest.approx(ratio, abs=0.02)


def test_bench_train_frozen_rows(script, capsys):
    """Cached and gathered frozen rows per head; the headline is EAGLE's ratio of the table's step times."""
    lines = run(script("bench_train"), ["--quick", "--frozen-rows", "--heads", "mtp", "eagle"], capsys)
    rows = {(r[0], r[1]): float(r[-1]) for r in map(str.split, lines[:-1]) if r[:1] in (["eagle"], ["mtp"])
            and len(r) == 4}  # "eagle cached ms tok/s", "eagle gathered ms tok/s": tokens/s
    assert set(rows) == {(h, side) for h in ("eagle", "mtp") for side in ("cached", "gathered")}
    assert lines[-1].startswith("eagle head step, cached rows vs rows gathered per call")
    ratio = rows["eagle", "cached"] / rows["eagle", "gathered"]
    assert float(HEADLINE.search(lines[-1])[0][2:-1]) == pytest.approx(ratio, abs=0.02)


def test_bench_train_head_option_without_a_value_is_one_error_line(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script("bench_train").main(["--quick", "--row-blocks", "--head-option", "draft_vocab_size"])
    assert "error: --head-option takes KEY=VALUE" in str(exit_.value.code)


def test_bench_cache_pass(script, capsys):
    """Both precisions build a cache; the bf16 states differ from the fp32 ones, by bf16's rounding only."""
    lines = run(script("bench_cache_pass"), ["--quick"], capsys)
    table = [line.split() for line in lines if len(line.split()) == 2 and line.split()[0] in ("fp32", "bf16")]
    assert [row[0] for row in table] == ["fp32", "bf16"] and all(float(row[1]) > 0 for row in table)
    (errors,) = [line for line in lines if line.startswith("bf16 against fp32")]
    worst = [float(part.split(": ")[1]) for part in errors.split("index: ")[1].split(", ")]
    assert len(worst) == 4 and all(1e-4 < e < 0.1 for e in worst)
    assert lines[-1].startswith("cache pass, bf16 vs fp32 (tokens/s)")
