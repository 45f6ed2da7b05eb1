"""The tree budget follows the latency curve: flat T(N) -> big trees, compute-bound -> small ones."""

import json
import os
import time
from contextlib import contextmanager

import pytest
import torch

from headway.heads.target import load_target
from headway.infer import calibrate as calibrate_module
from headway.heads.kernels import quiet, weight_layout
from headway.heads.kernels.weight_layout import candidates
from headway.infer.calibrate import TreeBudget, calibrate_latency, main


def roofline(ridge: int):
    """A synthetic T(N): flat (1 ms) up to `ridge` tokens, then linear."""
    return {n: 1e-3 * max(1.0, n / ridge) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)}


def test_budget_grows_with_the_ridge_and_shrinks_with_batch():
    gpu, cpu = TreeBudget(curve=roofline(256)), TreeBudget(curve=roofline(4))
    assert gpu.max_tokens(1) == 64  # flat all the way: the cap
    assert cpu.max_tokens(1) == 8  # T(8) = 2 T(1)
    assert gpu.max_tokens(16) == 32 and gpu.max_tokens(64) == 8 and gpu.max_tokens(512) == 1
    sizes = [gpu.max_tokens(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert sizes == sorted(sizes, reverse=True)


def test_static_throttle_without_a_curve():
    budget = TreeBudget(max_nodes=40)
    assert [budget.max_tokens(b) for b in (1, 8, 9, 32, 33)] == [40, 40, 10, 10, 1]


def test_noise_spikes_do_not_shrink_the_budget():
    curve = roofline(64)
    curve[2] = 0.5  # one disturbed measurement
    assert TreeBudget(curve=curve).max_tokens(1) == 64


def test_calibration_measures_every_size():
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    curve = calibrate_latency(target, sizes=(1, 4, 16), context=8, repeats=1, save=False)
    assert sorted(curve) == [1, 4, 16] and all(t > 0 for t in curve.values())


def test_each_timed_forward_follows_one_of_its_own_size(monkeypatch):
    """T(1) is a decode step after a decode step: measured right after the largest forward of the previous
    size (whose working set evicts the weights from cache) it would read high and flatter the curve."""
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    machine_seen_as(monkeypatch, other_cpu=0.0)  # measured once: a disturbed measurement would be taken again
    sizes, forward = [], calibrate_module._forward
    monkeypatch.setattr(calibrate_module, "_forward", lambda model, cache, tokens, *rest:
                        (sizes.append(tokens.shape[1]), forward(model, cache, tokens, *rest))[1])
    calibrate_latency(target, sizes=(1, 4, 16), context=8, repeats=2, save=False)
    per_round = [1, 1, 4, 4, 16, 16]  # an untimed forward, then the timed one
    assert sizes == [8] + per_round * 3  # the prompt, a warm-up round, two timed rounds


def machine_seen_as(monkeypatch, other_cpu: float):
    """What heads.kernels.quiet reports about other processes during the measurements (the real machine may be
    running other tests)."""
    class Seen(quiet.Watch):
        def __init__(self):
            self.other_cpu = other_cpu

    @contextmanager
    def fake_watch():
        yield Seen()
    monkeypatch.setattr(calibrate_module, "watch", fake_watch)
    monkeypatch.setattr(weight_layout, "watch", fake_watch)
    monkeypatch.setattr(quiet, "MAX_SPREAD", float("inf"))  # a tiny model's ~1 ms timings jitter a lot


def test_cli_measures_and_caches_the_curve_of_a_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    machine_seen_as(monkeypatch, 0.0)
    assert main(["target=tiny-random", "context=8", "weight_layout=stock", "compare=false"]) == 0
    out = capsys.readouterr().out
    assert "weight layout: stock" in out and "T(8)/T(1): stock" in out and "tree budget" in out
    path = tmp_path / "calibration" / f"tiny-random-cpu{torch.get_num_threads()}-float32-stock.json"
    record = json.loads(path.read_text())
    assert set(record["latency_s"]) == {"1", "2", "4", "8", "16", "32", "64", "128"}
    assert record["quality"]["noisy"] is False and record["quality"]["measured_at"]


def test_a_curve_timed_the_old_way_is_measured_again(tmp_path, monkeypatch):
    """Curves cached before each timed forward followed one of its own size read T(1) high: not reused."""
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    machine_seen_as(monkeypatch, 0.0)
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    calibrate_latency(target, sizes=(1, 2), context=8, repeats=1)
    assert calibrate_module.load_curve(target) is not None
    path = calibrate_module.curve_path(target)
    record = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in record.items() if k != "version"}))  # as an older version wrote it
    assert calibrate_module.load_curve(target) is None


def test_cli_compares_every_layout_side_by_side(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    machine_seen_as(monkeypatch, 0.0)
    assert main(["target=tiny-random", "context=8", "weight_layout=stock"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("N "))
    layouts = list(candidates(load_target({"path": "tiny-random", "name": "tiny-random"}).model))
    assert header.split()[1:] == layouts and layouts[:3] == ["stock", "wide-column", "packed"]
    assert "packing the weights" in out and "T(8)/T(1): stock" in out and ", packed " in out
    assert ("panel: kernel ready in" in out) == ("panel" in layouts)
    assert len(list((tmp_path / "calibration").glob("*.json"))) == len(layouts)  # one curve per layout


def test_a_curve_measured_on_a_busy_machine_is_not_cached_unless_forced(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    machine_seen_as(monkeypatch, 0.5)  # another process used half the CPU
    assert main(["target=tiny-random", "context=8", "weight_layout=stock", "compare=false"]) == 0
    out = capsys.readouterr().out
    assert "NOT cached" in out and "other processes used 50% of the CPU" in out
    assert not list((tmp_path / "calibration").glob("*stock.json"))
    assert main(["target=tiny-random", "context=8", "weight_layout=auto", "compare=false", "force=true"]) == 0
    cached = list((tmp_path / "calibration").glob("*.json"))
    assert any(p.name.endswith("-layout.json") for p in cached) and len(cached) == 2
    assert all(json.loads(p.read_text())["quality"]["noisy"] for p in cached)


def test_the_busy_machine_detector_sees_another_process():
    import subprocess
    import sys
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with quiet.watch() as seen:
            end = time.perf_counter() + 1.0
            while time.perf_counter() < end:
                time.sleep(0.05)  # this process idles; the other one burns a core
    finally:
        burner.kill()
    assert seen.other_cpu > 0.8 / (os.cpu_count() or 1)


@pytest.mark.parametrize("argv, named", [
    (["target=tiny-random", "contxt=8"], "contxt"),  # a misspelled key fails instead of being ignored
    (["target=nope"], "nope"),
    (["target=tiny-random", "weight_layout=rows"], "weight_layout"),
    (["target=tiny-random", "context=0"], "context"),
    (["target=tiny-random", "weight_layout=blocks"], "weight_layout=blocks"),  # not loaded from a GGUF file
])
def test_cli_bad_input_is_one_line_exit_2(argv, named, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert not (tmp_path / "calibration").exists()  # nothing measured, nothing written
