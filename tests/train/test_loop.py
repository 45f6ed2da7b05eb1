"""train(cfg) in-process on the tiny target: outputs, learning, validation, resume, wandb."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.heads.base import load_head, read_head_config
from headway.heads.eagle import EagleHead
from headway.train.checkpoints import find_checkpoint, step_dirs
from headway.train.config import ConfigError
from headway.train.loop import train
from train_helpers import HEADS, compose_train


def rows(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.mark.parametrize("head", HEADS)
def test_smoke_run_leaves_a_loadable_head_and_validation_metrics(head, tmp_path):
    run_dir = train(compose_train(f"head={head}", "experiment=smoke", run_dir=tmp_path))

    config = read_head_config(run_dir / "final")
    assert config["head_kind"] == head and config["target"]["path"] == "tiny-random"
    recipe = config["training"]
    assert recipe["steps"] == 6 and recipe["data"]["name"] == "tiny" and recipe["tokens_seen"] > 0

    val = rows(run_dir, "val")
    assert [r["step"] for r in val] == [3, 6]
    assert recipe["validation"]["sim_tau"] == pytest.approx(val[-1]["sim_tau"])  # the last validation
    best = max(val, key=lambda r: r["sim_tau"])  # the earliest of equals: a tie does not replace the best
    assert recipe["best"] == {"step": best["step"], "sim_tau": pytest.approx(best["sim_tau"])}
    for r in val:  # tau = 1 + sum_k prod_{j<=k} acc_k
        acc = [r[k] for k in sorted(r) if k.startswith("acc_depth_")]
        tau, run = 1.0, 1.0
        for a in acc:
            run *= a
            tau += run
        assert r["sim_tau"] == pytest.approx(tau) and all(0 <= a <= 1 for a in acc)
    assert [r["step"] for r in rows(run_dir, "train")] == [1, 2, 3, 4, 5, 6]

    reloaded = load_head(run_dir / "final")  # rebuilds the tiny target from the recorded spec
    saved = load_file(str(run_dir / "final" / "model.safetensors"))
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, saved[name])
    assert (run_dir / "checkpoints" / "best" / "config.json").is_file()
    assert [p.name for p in step_dirs(run_dir)] == ["step_0000003", "step_0000006"]
    assert not list((run_dir / "checkpoints").glob(".tmp*"))


def test_cpu_training_keeps_freed_memory_from_the_data_build_on(tmp_path, monkeypatch):
    """A job on a CPU runs with glibc's malloc keeping freed blocks (heads.kernels.allocator): switched on once,
    before the data and hidden-state cache are built (generation reallocates its logits every step too)."""
    import headway.train.loop as loop

    calls, real_setup = [], loop.setup
    monkeypatch.setattr(loop, "setup", lambda *a: (real_setup(*a), calls.append("data built"))[0])
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append("kept") or True)
    train(compose_train("head=medusa", "experiment=smoke", run_dir=tmp_path))
    assert calls == ["kept", "data built"]


@pytest.mark.parametrize("optimizer, lr", [("muon", "1e-2"), ("adamw", "3e-3")])  # Muon learns a tiny target slower
def test_training_loss_falls(optimizer, lr, tmp_path):
    cfg = compose_train("head=eagle", "experiment=smoke", "train.max_steps=60", "train.eval_every=0",
                        "train.save_every=0", f"optim.name={optimizer}", f"optim.lr={lr}", run_dir=tmp_path)
    losses = [r["loss"] for r in rows(train(cfg), "train")]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.75 * first, losses


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_loss_on_all_learns_the_prompt_tokens_too_and_validation_scores_replies(loss_on, tmp_path, monkeypatch):
    real_forward, masks = EagleHead.forward, []

    def recording_forward(self, input_ids, loss_mask, feats):
        masks.append((self.training, loss_mask.clone()))
        return real_forward(self, input_ids, loss_mask, feats)

    monkeypatch.setattr(EagleHead, "forward", recording_forward)
    train(compose_train("head=eagle", "experiment=smoke", "train.max_steps=2", f"train.loss_on={loss_on}",
                        run_dir=tmp_path))
    trained = [m for training, m in masks if training]
    validated = [m for training, m in masks if not training]
    assert trained and validated
    # position 0 (the template's first token) is never a reply token, so it is learned only with loss_on=all
    assert all(bool(m[:, 0].all()) == (loss_on == "all") for m in trained)
    assert not any(bool(m[:, 0].any()) for m in validated)


def test_resume_after_a_stop_equals_an_uninterrupted_run(tmp_path):
    """8 steps, stop, restart with resume=latest, 2 more steps == 10 steps in one go: gradient
    accumulation, the learning-rate schedule, the data order (the restart lands mid-way through the second
    epoch: 14 micro-batches per epoch) and EAGLE's feature noise all continue where they stopped."""
    common = ["head=eagle", "experiment=smoke", "train.max_steps=10", "train.grad_accum=2",
              "train.save_every=0", "train.eval_every=5"]
    straight = train(compose_train(*common, run_dir=tmp_path / "straight"))
    train(compose_train(*common, "train.stop_after=8", run_dir=tmp_path / "split"))
    assert not (tmp_path / "split" / "final").exists()  # stopped early: no final head yet
    assert [p.name for p in step_dirs(tmp_path / "split")] == ["step_0000008"]
    resumed = train(compose_train(*common, "resume=latest", run_dir=tmp_path / "split"))

    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    # the resumed run's log reads like one run: no duplicated steps, same losses
    assert [r["step"] for r in rows(resumed, "train")] == list(range(1, 11))
    for x, y in zip(rows(straight, "train"), rows(resumed, "train")):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["tokens_seen"] == x["tokens_seen"]
    assert rows(resumed, "val")[-1]["sim_tau"] == pytest.approx(rows(straight, "val")[-1]["sim_tau"])


def test_muon_trains_hidden_matrices_and_resumes_like_an_uninterrupted_run(tmp_path):
    """optim=muon: Muon holds the head's hidden weight matrices, AdamW the read-out, norms and biases; both
    optimizers' states come back on resume."""
    from headway.heads.base import build_head
    from headway.heads.target import load_target
    from omegaconf import OmegaConf
    from headway.train.loop import make_optimizers
    from headway.train.muon import Muon

    cfg = compose_train("head=eagle3", "experiment=smoke", "optim=muon")
    head = build_head("eagle3", load_target({"path": "tiny-random", "name": "tiny-random"}))
    muon, adamw = make_optimizers(head, cfg.optim)
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)  # Muon: fp32 where bf16 is emulated
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in head.named_parameters() if id(p) in in_muon}
    assert "fc.weight" in names and "midlayer.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    assert not in_muon & {id(p) for g in adamw.param_groups for p in g["params"]}
    assert OmegaConf.select(cfg, "optim.weight_decay") == 0.01

    common = ["head=eagle3", "experiment=smoke", "optim=muon", "train.max_steps=6", "train.save_every=0"]
    straight = train(compose_train(*common, run_dir=tmp_path / "straight"))
    train(compose_train(*common, "train.stop_after=4", run_dir=tmp_path / "split"))
    resumed = train(compose_train(*common, "resume=latest", run_dir=tmp_path / "split"))
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_readout_lr_scale_moves_only_the_read_out_at_its_own_rate():
    """optim.readout_lr_scale: the lm_head rows (started from the target's) sit in their own AdamW group whose
    lr is the schedule's times the scale, so after one step of Adam (update ~ lr) the read-out moved `scale`
    times as far as with scale 1, and every other parameter moved exactly as far."""
    from headway.heads.base import build_head
    from headway.heads.target import load_target
    from headway.train.loop import make_optimizers, set_lr

    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    moved = {}
    for scale in (1.0, 0.1):
        torch.manual_seed(0)
        head = build_head("eagle3", target)
        cfg = compose_train("head=eagle3", "experiment=smoke", f"optim.readout_lr_scale={scale}")
        optimizers = make_optimizers(head, cfg.optim)  # eagle3's default: Muon for its matrices + AdamW
        set_lr(optimizers, cfg.optim.lr)  # what the loop does each step
        before = {n: p.detach().clone() for n, p in head.named_parameters()}
        for p in head.parameters():
            p.grad = torch.ones_like(p) if p.requires_grad else None
        for opt in optimizers:
            opt.step()
        moved[scale] = {n: (p.detach() - before[n]).abs().max().item() for n, p in head.named_parameters()}
    assert moved[0.1]["lm_head.weight"] == pytest.approx(0.1 * moved[1.0]["lm_head.weight"], rel=1e-3)
    others = [n for n in moved[1.0] if n != "lm_head.weight" and moved[1.0][n] > 0]
    assert others and all(moved[0.1][n] == pytest.approx(moved[1.0][n]) for n in others)


def test_muon_options_tune_the_muon_group_alone():
    """optim.muon_lr_scale / muon_weight_decay / muon_ns_steps reach torch.optim.Muon's group (its lr follows
    the schedule through set_lr), while the AdamW groups keep optim.lr and optim.weight_decay."""
    from headway.heads.base import build_head
    from headway.heads.target import load_target
    from headway.train.loop import make_optimizers, set_lr

    head = build_head("eagle3", load_target({"path": "tiny-random", "name": "tiny-random"}))
    cfg = compose_train("head=eagle3", "experiment=smoke", "optim.muon_lr_scale=2.0",
                        "optim.muon_weight_decay=0.1", "optim.muon_ns_steps=3")
    muon, adamw = make_optimizers(head, cfg.optim)
    set_lr([muon, adamw], 1e-3)
    (group,) = muon.param_groups
    assert (group["lr"], group["weight_decay"], group["ns_steps"]) == (pytest.approx(2e-3), 0.1, 3)
    assert all(g["lr"] == pytest.approx(1e-3 * g.get("lr_scale", 1.0)) for g in adamw.param_groups)
    assert {g["weight_decay"] for g in adamw.param_groups} == {cfg.optim.weight_decay, 0.0}


def test_resume_finds_checkpoints_and_rejects_bad_paths(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp_step_0000009").mkdir(parents=True)  # a save killed half-way
    assert find_checkpoint("latest", run) is None
    assert find_checkpoint(None, run) is None
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step:07d}").mkdir()
        (run / "checkpoints" / f"step_{step:07d}" / "trainer_state.json").write_text(f'{{"step": {step}}}')
    assert find_checkpoint("latest", run).name == "step_0000004"
    assert find_checkpoint(str(run), tmp_path / "elsewhere").name == "step_0000004"
    assert find_checkpoint(str(run / "checkpoints" / "step_0000002"), run).name == "step_0000002"
    with pytest.raises(ConfigError, match="resume="):
        find_checkpoint(str(tmp_path / "nothing-here"), run)


def test_resuming_another_heads_checkpoint_fails_clearly(tmp_path):
    train(compose_train("head=eagle", "experiment=smoke", "train.stop_after=1", run_dir=tmp_path))
    with pytest.raises(ConfigError, match="head: checkpoint 'eagle', this run 'medusa'"):
        train(compose_train("head=medusa", "experiment=smoke", "resume=latest", run_dir=tmp_path))
    assert not (tmp_path / "final").exists()


def test_wandb_offline_writes_run_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_train("head=medusa", "experiment=smoke", "logger=wandb", "train.max_steps=2",
                        "train.save_every=0", run_dir=tmp_path / "run")
    train(cfg)
    runs = list((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_offline_hidden_states_without_a_cache_dir_build_one_and_train_like_online(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    online = train(compose_train("head=eagle3", "experiment=smoke", run_dir=tmp_path / "online"))
    offline = train(compose_train("head=eagle3", "experiment=smoke", "data.hidden_states=offline",
                                  run_dir=tmp_path / "offline"))
    built = list((tmp_path / "cache" / "hidden").glob("tiny-random-*-float32-L1_2_3_4"))
    assert len(built) == 1 and (built[0] / "index.json").is_file()
    assert [r["loss"] for r in rows(offline, "train")] == pytest.approx([r["loss"] for r in rows(online, "train")],
                                                                       rel=1e-4)


@pytest.mark.parametrize("amx, avx512_bf16, deepspeed, expected",
                         [(True, False, False, "bf16"), (False, True, False, "bf16"), (False, False, False, "no"),
                          (True, True, True, "no")])
def test_auto_precision_on_a_cpu_is_bf16_only_where_the_hardware_multiplies_it(amx, avx512_bf16, deepspeed, expected,
                                                                              monkeypatch):
    from headway.train.loop import auto_precision, make_accelerator

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert auto_precision(on_gpu=False, deepspeed=deepspeed) == expected
    assert auto_precision(on_gpu=True, deepspeed=deepspeed) == "bf16"
    if not deepspeed:
        cfg = compose_train("head=eagle", "experiment=smoke", "device=cpu", run_dir=Path("unused"))
        assert make_accelerator(cfg).mixed_precision == expected


@pytest.mark.parametrize("head, hidden_states", [("eagle", "online"), ("eagle3", "offline"), ("mtp", "offline")])
def test_training_on_a_gpu_mixes_no_devices(head, hidden_states, tmp_path, monkeypatch):
    """The job with accelerate's device a GPU (tests/virtual_cuda.py's without one): the target, the head, the
    batches and the hidden-state cache all where CUDA needs them."""
    import accelerate

    from tests.virtual_cuda import on_gpu

    monkeypatch.setattr(accelerate.Accelerator, "device", property(lambda self: torch.device("cuda", 0)))
    cfg = compose_train(f"head={head}", "experiment=smoke", f"data.hidden_states={hidden_states}", run_dir=tmp_path)
    with on_gpu(monkeypatch) as gpu:
        run_dir = train(cfg)
    assert (gpu.ops or not gpu.virtual) and (run_dir / "final" / "model.safetensors").is_file()


def test_cache_precision_reaches_the_jobs_cache_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    train(compose_train("head=eagle", "experiment=smoke", "data.hidden_states=offline", "data.cache_precision=bf16",
                        "train.max_steps=2", run_dir=tmp_path / "run"))
    (index,) = (tmp_path / "cache" / "hidden").glob("*/index.json")
    assert {shard.get("computed_in") for shard in json.loads(index.read_text())["shards"]} == {"bfloat16"}
