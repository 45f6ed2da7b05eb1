"""conf/: every config composes against the schema and builds; typos and bad values fail early and clearly."""

import math

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from headway.heads.base import build_head
from headway.heads.target import load_target
from headway.train.config import ConfigError, check_config
from headway.train.loop import lr_at
from train_helpers import CONF, EXPERIMENTS, HEADS, compose_train


@pytest.fixture(scope="module")
def tiny_target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


def test_the_four_heads_and_the_smoke_preset_exist():
    assert {"medusa", "eagle", "eagle3", "mtp"} <= set(HEADS)
    assert "smoke" in EXPERIMENTS


@pytest.mark.parametrize("head", HEADS)
def test_every_head_config_composes_and_builds_on_the_tiny_target(head, tiny_target):
    cfg = compose_train(f"head={head}", "target=tiny-random", run_dir="/tmp/unused")
    check_config(cfg)
    assert cfg.head.kind == head
    built = build_head(cfg.head.kind, tiny_target, **OmegaConf.to_container(cfg.head.options))
    assert sum(p.numel() for p in built.parameters() if p.requires_grad) > 0


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("head", HEADS)
def test_every_experiment_composes_with_every_head(experiment, head):
    cfg = compose_train(f"head={head}", f"experiment={experiment}", run_dir="/tmp/unused")
    check_config(cfg)
    assert cfg.head.kind == head


@pytest.mark.parametrize("head", HEADS)
def test_gpu_8b_trains_each_head_with_its_cpu_recipe_optimizer(head):
    """The per-head optimizer choices measured on CPU (conf/optim/head/<head>.yaml: EAGLE-3's Muon at twice
    the lr on its matrices) carry into experiment=gpu_8b unchanged."""
    keys = ("name", "lr", "weight_decay", "muon_lr_scale", "muon_weight_decay", "muon_ns_steps")
    cpu = compose_train(f"head={head}", run_dir="/tmp/unused").optim
    gpu = compose_train(f"head={head}", "experiment=gpu_8b", run_dir="/tmp/unused").optim
    assert {k: gpu[k] for k in keys} == {k: cpu[k] for k in keys}
    if head == "eagle3":
        assert (gpu.name, gpu.muon_lr_scale) == ("muon", 2.0)


def test_smoke_uses_the_tiny_target_and_data():
    cfg = compose_train("head=eagle", "experiment=smoke")
    assert cfg.target.path == "tiny-random" and cfg.data.name == "tiny"
    assert cfg.train.max_steps <= 10


@pytest.mark.parametrize("group", ["target", "optim", "logger", "data"])
def test_every_option_of_the_other_groups_composes(group):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        check_config(compose_train(f"{group}={option}", run_dir="/tmp/unused"))


def test_defaults_are_the_documented_main_job():
    cfg = compose_train()
    assert cfg.head.kind == "eagle" and cfg.target.name == "smollm2-135m" and cfg.logger.kind == "none"
    assert cfg.optim.grad_clip == 0.5 and list(cfg.optim.betas) == [0.9, 0.95]


def test_each_head_gets_its_own_learning_rate_unless_overridden():
    assert compose_train("head=medusa").optim.lr == 1e-3
    assert compose_train("head=mtp").optim.lr == 3e-4  # conf/optim/head/<head>.yaml, not the group default
    assert compose_train("head=eagle3").optim.lr == 1e-3
    assert compose_train("head=medusa").optim.lr > compose_train("head=mtp").optim.lr
    assert compose_train("head=medusa", "optim.lr=5e-5").optim.lr == 5e-5


@pytest.mark.parametrize("override, names", [
    ("optim.lrr=1e-3", "lrr"),
    ("train.max_step=10", "max_step"),
    ("target.pth=/x", "pth"),
    ("logger.projetc=x", "projetc"),
])
def test_a_misspelled_key_fails_at_compose_time(override, names):
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(override)
    assert names in str(err.value) + str(err.value.__cause__)


def test_a_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as err:
        compose_train("train.max_steps=many")
    assert "max_steps" in str(err.value.__cause__)


@pytest.mark.parametrize("override, key", [
    ("optim.lr=0", "optim.lr"),
    ("optim.lr=-1e-4", "optim.lr"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("optim.betas=[0.9,1.5]", "optim.betas"),
    ("optim.schedule=exponential", "optim.schedule"),
    ("precision=fp8", "precision"),
    ("cpu_threads=0", "cpu_threads"),
    ("cpu_threads=many", "cpu_threads"),
    ("train.loss_on=prompts", "train.loss_on"),
    ("optim.readout_lr_scale=0", "optim.readout_lr_scale"),
    ("optim.muon_lr_scale=0", "optim.muon_lr_scale"),
    ("optim.muon_weight_decay=-0.1", "optim.muon_weight_decay"),
    ("optim.muon_ns_steps=0", "optim.muon_ns_steps"),
])
def test_a_bad_value_fails_with_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(override))
    message = str(err.value)
    assert message.startswith(f"{key}=") and "must be" in message and "\n" not in message


def test_every_yaml_of_this_pipeline_opens_with_the_command_that_uses_it():
    files = [CONF / "train.yaml"] + [p for g in ("target", "optim", "logger", "experiment", "accelerate")
                                     for p in sorted((CONF / g).rglob("*.yaml"))]
    for path in files:
        header = [line for line in path.read_text().splitlines()[:3] if line.startswith("#")]
        assert any("train/main.py" in line for line in header), f"{path} does not open with its command"


def test_learning_rate_warms_up_then_decays_to_the_floor():
    optim = OmegaConf.create({"lr": 1e-3, "warmup_steps": 10, "warmup_ratio": 0.0, "schedule": "cosine",
                              "min_lr_ratio": 0.1})
    lrs = [lr_at(s, optim, 100) for s in range(100)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # linear warmup
    assert lrs[10] == pytest.approx(1e-3)  # peak right after warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then monotone decay
    assert lr_at(100, optim, 100) == pytest.approx(1e-4)  # cosine ends at lr * min_lr_ratio
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    constant = OmegaConf.merge(optim, {"schedule": "constant"})
    assert lr_at(99, constant, 100) == 1e-3
    linear = OmegaConf.merge(optim, {"schedule": "linear"})
    assert lr_at(55, linear, 100) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway down a straight line
    assert lr_at(100, linear, 100) == pytest.approx(1e-4)
