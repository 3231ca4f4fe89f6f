"""Settings a llama.cpp grid or a bits-per-weight budget makes meaningless, and a grid's fallback said.

A grid fixes the uniform grid's bits, group size and symmetry (``recipe.grid_implies``); a budget
picks each linear's grid. Such a setting given beside either is refused with one line naming both,
unless it is what the grid fixes; a setting left at its default never is. What the recipe records
is what shaped the codes. The same rule holds in a study file. (The command-line cases are in the
bad-input table, tests/test_bad_input.py.)
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.compress.recipe import UNIFORM_SETTINGS, Recipe, grid_implies
from slmedge.errors import ConfigError
from slmedge.models.grids import GRIDS

runner = CliRunner()


def _other(name: str, value):
    """A value of setting ``name`` that is not ``value``."""
    return (not value) if name == "symmetric" else (8 if value != 8 else 2) if name == "bits" else value * 2


@pytest.mark.parametrize("grid", list(GRIDS))
def test_each_grid_refuses_what_contradicts_it_and_keeps_only_what_shaped_the_codes(grid):
    own = grid_implies(grid)
    g = GRIDS[grid]
    assert own == {"bits": g.bits, "group_size": g.sub, "symmetric": not g.min}
    for name in UNIFORM_SETTINGS:
        value = _other(name, own[name])
        with pytest.raises(ConfigError) as info:
            Recipe(method="rtn", grid=grid, **{name: value}).validate(given={name})
        shown = ("true" if value else "false") if name == "symmetric" else str(value)
        assert f"{name} {shown} contradicts grid {grid}" in str(info.value)
        assert "\n" not in str(info.value)
    # What the grid fixes, given: harmless, and recorded nowhere (the defaults stand in, unused).
    recipe = Recipe(method="rtn", grid=grid, **own).validate(given=set(UNIFORM_SETTINGS))
    assert not set(UNIFORM_SETTINGS) & set(recipe.to_dict())
    assert Recipe.from_dict(recipe.to_dict()) == recipe


def test_defaults_are_not_given():
    """A setting left at its default is not a contradiction (q3_k's codes are 3-bit, the default bits 4)."""
    Recipe(method="rtn", grid="q3_k").validate()
    Recipe(method="rtn", grid="q3_k").validate(given=set())
    with pytest.raises(ConfigError, match="bits 4 contradicts grid q3_k"):
        Recipe(method="rtn", grid="q3_k").validate(given={"bits"})  # the default value, given explicitly
    # Without a list of what was given, a value other than the default counts as given.
    with pytest.raises(ConfigError, match="group_size 64 contradicts grid q4_k"):
        Recipe(method="rtn", grid="q4_k", group_size=64).validate()


def test_a_budget_fixes_them_all():
    for name, value in (("bits", 4), ("group_size", 32), ("symmetric", True)):
        with pytest.raises(ConfigError, match=f"contradicts bpw 4.5: a budget picks each linear's grid"):
            Recipe(method="gptq", bpw=4.5, **{name: value}).validate(given={name})
    assert "bits" not in Recipe(method="gptq", bpw=4.5).validate().to_dict()
    assert Recipe(method="gptq", bits=3).validate().to_dict()["bits"] == 3  # the uniform grid keeps them


def test_the_artifact_records_what_shaped_the_codes(tiny_models, tmp_path):
    """q4_0 is 4-bit, one scale per 32 weights, symmetric: saying so is harmless and recorded nowhere."""
    out = tmp_path / "art"
    res = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--grid", "q4_0", "--bits", "4",
                              "-g", "32", "--sym", "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    recipe = json.loads((out / "slmedge.json").read_text())["recipe"]
    assert recipe["grid"] == "q4_0" and not set(UNIFORM_SETTINGS) & set(recipe), recipe


def test_a_study_method_takes_the_same_rule(tiny_models, tmp_path):
    from slmedge.study.spec import StudyError, load_study

    head = f'models = ["{tiny_models("llama")}"]\n[evaluate]\nmetrics = ["memory"]\n[[methods]]\nmethod = "rtn"\n'
    bad = tmp_path / "bad.toml"
    bad.write_text(head + 'grid = "q4_k"\nbits = 3\n')
    with pytest.raises(StudyError) as info:
        load_study(bad)
    with pytest.raises(ConfigError) as same:
        Recipe(method="rtn", grid="q4_k", bits=3).validate(given={"bits"})
    assert str(same.value) in str(info.value) and "bad.toml" in str(info.value)
    ok = tmp_path / "ok.toml"
    ok.write_text(head + 'grid = "q4_k"\nbits = 4\nsymmetric = false\n')  # q4_k's own: harmless, left out
    (method,) = load_study(ok).methods
    assert method.settings["grid"] == "q4_k" and not set(UNIFORM_SETTINGS) & set(method.settings)


def test_a_grid_s_fallback_is_announced(tiny_models, tmp_path):
    """The tiny Llama's rows are 64 and 128 wide, which Q4_K's 256-wide super-blocks do not divide:
    every linear takes llama.cpp's fallback, Q5_0; the table and its headline say so."""
    out = tmp_path / "art"
    res = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "--grid", "q4_k",
                              "-o", str(out), "--device", "cpu"], terminal_width=200)
    assert res.exit_code == 0, res.output
    text = " ".join(re.sub("[│┌┐└┘─┬┴├┤┼]", " ", res.output).split())  # the table's words, unwrapped
    assert "rtn grid q4_k -> q5_0 on every linear (llama.cpp's fallback)" in text, text
    assert "q5_0 (5.5 bits per weight) instead of q4_k on 14 of 14 linears" in text, text
    assert "model.layers.*.mlp.down_proj" in text and "not divisible by 256" in text, text
    summary = json.loads((out / "slmedge.json").read_text())["summary"]
    assert summary["grids"] == {"q5_0": {"linears": 14, "bits_per_weight": 5.5}}
    assert summary["fallback"]["to"] == ["q5_0"] and summary["fallback"]["count"] == 14
    assert summary["bits_per_weight"] == 5.5


def test_run_s_own_defaults_are_not_given(tiny_models, tmp_path, monkeypatch):
    """`slmedge run`'s --group-size defaults to 32, not q6_k's 16: left at its default, it is not a
    contradiction (the recipe reaches the compression, stopped there)."""
    import slmedge.cli.compress as cli_compress

    seen = {}

    def stop(model, recipe, output, **kwargs):
        seen["recipe"] = recipe
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_compress, "check_compress", stop)
    res = runner.invoke(app, ["run", str(tiny_models("llama")), "--grid", "q6_k", "--nsamples", "2", "--seqlen", "16",
                              "-o", str(tmp_path / "out")])
    assert res.exit_code == 130, res.output
    assert seen["recipe"].grid == "q6_k" and "group_size" not in seen["recipe"].to_dict()
