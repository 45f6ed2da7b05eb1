"""Each head trains briefly on the real default target, SmolLM2-135M-Instruct (slow: minutes on CPU).

Run with: pytest -m slow tests/train/test_real_target.py"""

import json
import math

import pytest

from headway.heads.base import read_head_config
from headway.train.loop import train
from train_helpers import HEADS, compose_train


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_each_head_trains_on_the_default_target(head, tmp_path):
    cfg = compose_train(f"head={head}", "target=smollm2-135m", "data=tiny", "train.max_steps=3",
                        "train.batch_size=2", "train.max_length=192", "train.eval_every=3",
                        "train.eval_batches=1", "train.save_every=3", "train.log_every=1", run_dir=tmp_path)
    run_dir = train(cfg)
    config = read_head_config(run_dir / "final")
    assert config["target"]["name"] == "smollm2-135m" and config["target_shape"]["vocab_size"] == 49152
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows)
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in val] == [3]
    acc = [val[0][f"acc_depth_{k + 1}"] for k in range(sum(key.startswith("acc_depth_") for key in val[0]))]
    assert acc and all(0.0 <= a <= 1.0 for a in acc)
    assert val[0]["sim_tau"] == pytest.approx(1 + sum(math.prod(acc[:k + 1]) for k in range(len(acc))))
    assert config["training"]["validation"]["sim_tau"] == pytest.approx(val[0]["sim_tau"])
