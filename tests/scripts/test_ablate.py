"""scripts/ablate.py's data-size curve: tau plotted against the value each variant sets."""

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ablate(load_script):
    return load_script("ablate")


def row(name, text, chat, val):
    return {"variant": name, "overrides": text, "val sim tau": val, "chat tau": chat}


def test_the_curve_is_drawn_in_order_of_the_value(ablate, tmp_path, monkeypatch):
    drawn = []
    import matplotlib.axes
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, xs, ys, **kw: drawn.append((kw["label"], xs, ys)))
    table = [row("all", "data.max_conversations=1000,optim.lr=1e-3", 1.9, 1.7),
             row("n250", "data.max_conversations=250", 1.5, 1.4)]
    path = ablate.plot_curve(table, "data.max_conversations", ["chat"], tmp_path)
    assert path == tmp_path / "data.max_conversations.png" and path.stat().st_size > 0
    assert drawn == [("chat tau", [250.0, 1000.0], [1.5, 1.9]), ("val sim tau", [250.0, 1000.0], [1.4, 1.7])]


def test_a_variant_without_the_value_is_one_clear_error(ablate, tmp_path):
    table = [row("base", "-", 1.5, 1.4)]
    with pytest.raises(SystemExit, match="variant base does not set data.max_conversations"):
        ablate.plot_curve(table, "data.max_conversations", ["chat"], tmp_path)


def test_a_list_value_stays_one_override(ablate):
    assert ablate.overrides("optim.lr=1e-3,optim.betas=[0.9,0.999],,optim=muon") == [
        "optim.lr=1e-3", "optim.betas=[0.9,0.999]", "optim=muon"]


def test_evaluation_runs_on_the_threads_training_was_given(ablate, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", "/somewhere")
    env = ablate.eval_env("train.max_steps=200,cpu_threads=1")
    assert env["OMP_NUM_THREADS"] == "1" and env["HEADWAY_CACHE"] == "/somewhere"
    assert ablate.eval_env("train.max_steps=200") is None  # no setting: the evaluator's own default
    assert ablate.eval_env("cpu_threads=auto") is None


def test_each_variant_is_set_against_the_first_on_the_same_prompts(ablate):
    def res(tau_per_prompt):
        rows = [{"prompt": f"p{i}", "category": "c", "emitted": round(t * 100), "steps": 100}
                for i, t in enumerate(tau_per_prompt)]
        return {"tau": sum(tau_per_prompt) / len(tau_per_prompt), "temperature": 0.0, "per_prompt": rows}

    base = res([1.5, 2.0, 2.5, 3.0] * 6)
    assert ablate.paired(base, res([1.6, 2.1, 2.6, 3.1] * 6)) == "+0.100 [+0.100, +0.100]"
    low, high = ablate.paired(base, res([1.6, 1.9, 2.6, 2.9] * 6))[8:-1].split(", ")
    assert float(low) < 0 < float(high)  # gains and losses that cancel: the interval holds zero
    assert ablate.paired(base, {"tau": 2.0}) == "-"  # an evaluation from before per-prompt counts


def test_several_seeds_train_on_one_split(ablate):
    """--seeds 2: runs NAME-seed0/1 whose composed jobs differ in the training seed only, not in the data split."""
    importlib.import_module("headway.train.config")  # registers the schema the train config extends
    from hydra import compose, initialize_config_dir

    assert ablate.seed_runs("lr", "optim.lr=1e-3", 1) == [("lr", ["optim.lr=1e-3"])]  # the job's own seed
    runs = ablate.seed_runs("lr", "optim.lr=1e-3", 2)
    assert [name for name, _ in runs] == ["lr-seed0", "lr-seed1"]
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        jobs = [compose("train", overrides=["head=eagle", "experiment=smoke", *extra]) for _, extra in runs]
    assert [j.train.seed for j in jobs] == [0, 1] and [j.data.split_seed for j in jobs] == [0, 0]
    assert all(j.optim.lr == 1e-3 for j in jobs)


def test_seeds_are_pooled_prompt_by_prompt(ablate):
    def res(tau, counts, acc):
        return {"tau": tau, "temperature": 0.0, "acceptance_by_depth": acc,
                "per_prompt": [{"prompt": k, "emitted": e, "steps": s} for k, (e, s) in counts.items()]}

    seed0 = res(2.0, {"a": (20, 10), "b": (30, 15)}, [0.6, 0.5])
    seed1 = res(1.9, {"b": (28, 15), "a": (19, 10)}, [0.5, 0.4, 0.3])
    merged = ablate.over_seeds([seed0, seed1])
    assert merged["tau"] == pytest.approx(1.95) and merged["seeds_tau"] == [2.0, 1.9]
    assert merged["acceptance_by_depth"] == pytest.approx([0.55, 0.45])  # the depths both reached
    assert {r["prompt"]: (r["emitted"], r["steps"]) for r in merged["per_prompt"]} == {"a": (39, 20), "b": (58, 30)}
    assert ablate.over_seeds([seed0]) is seed0
    assert "per_prompt" not in ablate.over_seeds([seed0, {"tau": 1.8, "acceptance_by_depth": []}])
