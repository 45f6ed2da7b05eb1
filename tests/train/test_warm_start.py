"""init_from: a run starts from a trained head's weights and draft vocabulary, not from a fresh head."""

import sys

import pytest
import torch
from safetensors.torch import load_file

from headway.heads.base import read_head_config
from headway.train.config import ConfigError
from headway.train.loop import train
from headway.train.warm_start import named_head_options
from train_helpers import compose_train, launch

SMOKE = ["experiment=smoke", "train.save_every=0", "train.eval_every=0"]


def weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_a_run_starts_from_the_heads_weights_and_keeps_its_draft_vocabulary(head, tmp_path):
    """The first head learns on 16 conversations; the second starts from it on all of them (other token
    counts, so a fresh head would pick another vocabulary) with a learning rate too small to move anything:
    it ends where the first ended, vocabulary included, and records where it started."""
    first = train(compose_train(f"head={head}", *SMOKE, "data.max_conversations=16", run_dir=tmp_path / "a"))
    args = [f"head={head}", *SMOKE, "train.max_steps=2"]
    fresh = train(compose_train(*args, run_dir=tmp_path / "fresh"))
    tuned = train(compose_train(*args, "optim.lr=1e-12", f"init_from={first / 'final'}", run_dir=tmp_path / "b"))

    start, end, other = weights(first), weights(tuned), weights(fresh)
    assert start.keys() == end.keys()
    for name in start:
        torch.testing.assert_close(end[name], start[name], rtol=0, atol=1e-6, msg=name)
    counts = lambda run: load_file(str(run / "final" / "token_counts.safetensors"))["token_counts"]  # noqa: E731
    assert torch.equal(counts(tuned), counts(first)) and not torch.equal(counts(fresh), counts(first))
    assert any(not torch.allclose(other[n], start[n]) for n in start)  # a fresh head would not be there
    assert read_head_config(tuned / "final")["training"]["init_from"] == str(first / "final")


def test_init_from_rejects_another_heads_folder_before_building_anything(tmp_path):
    first = train(compose_train("head=eagle", *SMOKE, "train.max_steps=1", run_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match="holds a eagle head, but this run trains head=medusa"):
        train(compose_train("head=medusa", *SMOKE, f"init_from={first / 'final'}", run_dir=tmp_path / "b"))
    with pytest.raises(ConfigError, match="init_from=.*is not a head folder"):
        train(compose_train("head=eagle", *SMOKE, f"init_from={tmp_path}", run_dir=tmp_path / "c"))
    assert not (tmp_path / "b" / "final").exists() and not (tmp_path / "c" / "final").exists()


def test_an_eagle3_run_grows_the_draft_vocabulary_of_the_head_it_starts_from(tmp_path):
    """init_from with a larger head.options.draft_vocab_size: the run's vocabulary comes from the head's
    counts (a superset of its vocabulary) and every token the head had keeps its trained read-out row."""
    grown = "head.options.draft_vocab_size=200"
    first = train(compose_train("head=eagle3", *SMOKE, "head.options.draft_vocab_size=100", run_dir=tmp_path / "a"))
    tuned = train(compose_train("head=eagle3", *SMOKE, grown, "train.max_steps=1", "optim.lr=1e-12",
                                f"init_from={first / 'final'}", run_dir=tmp_path / "b"))
    start, end = weights(first), weights(tuned)
    start_ids = torch.arange(100) + start["d2t"]
    end_ids = torch.arange(200) + end["d2t"]
    shared = torch.isin(end_ids, start_ids)
    assert end["lm_head.weight"].shape[0] == 200 and shared.sum() == 100
    torch.testing.assert_close(end["lm_head.weight"][shared], start["lm_head.weight"], rtol=0, atol=1e-6)
    assert read_head_config(tuned / "final")["options"]["draft_vocab_size"] == 200


def test_a_run_from_the_command_line_keeps_the_heads_options_unless_it_names_them(tmp_path):
    """`train/main.py init_from=<a 100-token EAGLE-3 head>` fine-tunes a 100-token head (not the YAML's
    default vocabulary) with its ttt_steps, while an option the command line names wins."""
    first = train(compose_train("head=eagle3", *SMOKE, "train.max_steps=1", "head.options.draft_vocab_size=100",
                                "head.options.ttt_steps=2", run_dir=tmp_path / "a"))
    run_dir = tmp_path / "b"
    done = launch([sys.executable, "train/main.py", "head=eagle3", *SMOKE, "train.max_steps=1",
                   f"init_from={first / 'final'}", "head.options.ttt_steps=1", f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-2000:]
    options = read_head_config(run_dir / "final")["options"]
    assert options["draft_vocab_size"] == 100 and options["ttt_steps"] == 1
    assert weights(run_dir)["lm_head.weight"].shape[0] == 100


@pytest.mark.parametrize("overrides, named", [
    (["head=eagle3", "head.options.draft_vocab_size=16384", "+head.options.noise=0.1", "optim.lr=5e-4"],
     {"draft_vocab_size", "noise"}),
    (["head.options={ttt_steps: 2}"], {"draft_vocab_size", "noise", "ttt_steps"}),
    (["head=eagle3", "train.max_steps=10"], set()),
])
def test_named_head_options_reads_the_options_an_override_list_sets(overrides, named):
    assert named_head_options(overrides, ["draft_vocab_size", "noise", "ttt_steps"]) == named
