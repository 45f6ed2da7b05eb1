"""scripts/compare_evals.py: heads side by side with intervals, paired against the first; one error line else."""

import json
from pathlib import Path

import pytest

from headway.infer.intervals import prompt_key


@pytest.fixture
def compare(load_script):
    return load_script("compare_evals")


def write_eval(folder: Path, gain: float, prompts: int = 24) -> Path:
    """An eval.json whose prompts spread widely in tau; `gain` more tau on every prompt."""
    rows = [{"prompt": prompt_key(f"p{i}"), "category": "c", "steps": 50 + 7 * i,
             "emitted": round((1.3 + (i % 5) * 0.4 + gain) * (50 + 7 * i))} for i in range(prompts)]
    res = {"tau": sum(r["emitted"] for r in rows) / sum(r["steps"] for r in rows), "temperature": 0.0,
           "max_new_tokens": 64, "per_prompt": rows}
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps(res))
    return folder


def test_a_real_gain_is_above_zero_and_the_noise_of_none_holds_it(compare, tmp_path, capsys):
    base, better, same = (write_eval(tmp_path / n, g) for n, g in (("base", 0.0), ("better", 0.06), ("same", 0.0)))
    assert compare.main([str(base), str(better / "eval.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].endswith("(above zero)") and "+0.060 tau on 24 shared prompts" in out[-1]
    assert len([line for line in out if line.startswith("| ")]) == 3  # header and two heads
    assert compare.main([str(base), str(same)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("(holds zero: no evidence of a difference)")


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: (d / "bad.json").write_text("{not json") and d / "bad.json", "is not a readable eval.json"),
    (lambda d: (d / "old.json").write_text('{"tau": 2.0}') and d / "old.json", "no per-prompt counts"),
    (lambda d: (d / "other.json").write_text('{"x": 1}') and d / "other.json", "is not an eval.json"),
    (lambda d: (d / "text.json").write_text('{"tau": "high"}') and d / "text.json", "no numeric \"tau\""),
])
def test_bad_input_is_one_error_line_and_exit_2(compare, tmp_path, capsys, make, match):
    base = write_eval(tmp_path / "base", 0.0)
    assert compare.main([str(base), str(make(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("error: ") and match in captured.err
