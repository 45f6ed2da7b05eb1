"""scripts/validation_prompts.py: a run's held-out conversations become a prompt set the evaluator reads."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import headway.train.config  # noqa: F401  (registers the schema)
from headway.heads.target import load_target
from headway.infer.prompt_sets import load_prompt_set
from headway.train.data.build import build_datasets

CONF = Path(__file__).resolve().parents[2] / "conf"


def smoke_run(folder):
    """A run folder as `train/main.py head=eagle experiment=smoke` leaves it: its composed config."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["head=eagle", "experiment=smoke", "data.val_size=6"])
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    return cfg


def test_the_validation_split_first_user_turns_become_a_prompt_set(load_script, tmp_path, capsys):
    cfg = smoke_run(tmp_path / "run")
    load_script("validation_prompts").main([str(tmp_path / "run"), str(tmp_path / "val.jsonl"), "--max", "4"])
    rows = load_prompt_set(str(tmp_path / "val.jsonl"))
    assert 1 <= len(rows) <= 4 and all(r["category"] == "validation" and r["prompt"] for r in rows)
    tokenizer = load_target(OmegaConf.to_container(cfg.target)).tokenizer
    _, val = build_datasets(cfg.data, tokenizer, cfg.train.max_length, seed=cfg.train.seed)
    held_out = [tokenizer.decode(item["input_ids"]) for item in val]
    assert all(any(row["prompt"] in text for text in held_out) for row in rows)  # each opens a held-out one
    assert "validation conversations ->" in capsys.readouterr().out and not (tmp_path / "val.jsonl.tmp").exists()


@pytest.mark.parametrize("argv, words", [(["nowhere", "o.jsonl"], "has no .hydra/config.yaml"),
                                         (["RUN", "o.jsonl", "--max", "0"], "--max 0 must be at least 1")])
def test_bad_input_is_one_error_line(load_script, tmp_path, capsys, argv, words):
    smoke_run(tmp_path / "RUN")
    argv = [str(tmp_path / a) if a in ("nowhere", "RUN", "o.jsonl") else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        load_script("validation_prompts").main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and words in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()
