"""train.ema_decay: the averaged weights (their decay ramp, the swap in and out) and a training run that
validates and ships them and resumes them exactly (under DeepSpeed: a warning, the weights as trained)."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from headway.train.ema import WeightAverage
from headway.train.loop import train
from train_helpers import compose_train


def test_the_average_follows_the_ramped_decay_and_skips_frozen_weights():
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    model[1].weight.requires_grad_(False)
    ema = WeightAverage(model, decay=0.5)
    assert len(ema.shadow) == 3  # the frozen norm weight is not averaged
    first = [s.clone() for s in ema.shadow]
    history = []
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        history.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
        ema.update()
    expected = first
    for n, params in enumerate(history):  # decay min(0.5, n / (n + 1)): 0, 0.5, 0.5, 0.5
        d = min(0.5, n / (n + 1))
        expected = [d * e + (1 - d) * p for e, p in zip(expected, params)]
    for s, e in zip(ema.shadow, expected):
        torch.testing.assert_close(s, e)


def test_swapped_in_holds_the_average_then_gives_the_weights_back():
    model = nn.Linear(4, 4)
    ema = WeightAverage(model, decay=0.9)
    raw = [p.detach().clone() for p in model.parameters()]
    for s in ema.shadow:
        s.fill_(7.0)
    with ema.swapped_in():
        assert all(torch.all(p == 7.0) for p in model.parameters())
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), raw))


def test_a_run_ships_the_average_and_resumes_it_exactly(tmp_path):
    common = ["head=eagle", "experiment=smoke", "train.max_steps=8", "train.save_every=0", "train.eval_every=4"]
    plain = train(compose_train(*common, run_dir=tmp_path / "plain"))
    straight = train(compose_train(*common, "train.ema_decay=0.9", run_dir=tmp_path / "straight"))
    train(compose_train(*common, "train.ema_decay=0.9", "train.stop_after=5", run_dir=tmp_path / "split"))
    resumed = train(compose_train(*common, "train.ema_decay=0.9", "resume=latest", run_dir=tmp_path / "split"))

    raw, averaged, again = (load_file(str(run / "final" / "model.safetensors")) for run in (plain, straight, resumed))
    assert any(not torch.allclose(averaged[k], raw[k]) for k in raw)  # the shipped head is the average ...
    for k in averaged:  # ... and a resumed run continues it where it stopped
        torch.testing.assert_close(again[k], averaged[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_decay_outside_0_1_is_one_clear_error(tmp_path):
    from headway.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.ema_decay=1.5 is invalid: it must be in \(0, 1\) or null"):
        train(compose_train("head=eagle", "experiment=smoke", "train.ema_decay=1.5", run_dir=tmp_path / "bad"))


def test_under_deepspeed_the_run_warns_and_ships_the_weights_as_trained(caplog):
    """ZeRO partitions the weights the average needs whole on each rank."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils import DistributedType

    from headway.train.loop import weight_average

    PartialState(cpu=True)  # accelerate's logger needs its state
    cfg = compose_train("head=eagle", "experiment=smoke", "train.ema_decay=0.99")
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_main_process=True)
    assert weight_average(cfg, accelerator, nn.Linear(2, 2)) is None
    assert "DeepSpeed ZeRO partitions the weights the average needs whole" in caplog.text
