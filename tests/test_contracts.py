"""One source of truth for each contract: the artifact's file names and readers, the recipe's and
the evaluation's settings (study file keys, CLI options), the sparsity value, the method kinds."""

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from slmedge.compress.methods import METHODS
from slmedge.compress.recipe import Recipe
from slmedge.compress.sparsity import Sparsity
from slmedge.errors import ConfigError
from slmedge.evaluate.api import EvalSettings
from slmedge.study.spec import (EVAL_SET_BY_STUDY, METHOD_SET_BY_STUDY, StudyError, dataclass_kinds, load_study,
                                table_kinds)

PKG = Path(__file__).resolve().parent.parent / "slmedge"


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# --- the artifact's file names and readers ----------------------------------------------------------


def test_the_manifest_name_is_written_in_one_module():
    found = [str(p.relative_to(PKG.parent)) for p in sorted(PKG.rglob("*.py")) if '"slmedge.json"' in p.read_text()]
    assert found == ["slmedge/models/artifact_format.py"], found


def test_compress_artifact_reexports_the_one_definition():
    from slmedge.compress import artifact
    from slmedge.models import artifact_format

    for name in ("MANIFEST", "QUANT_FILE", "FORMAT", "FORMAT_VERSION", "is_artifact", "manifest_path", "read_manifest",
                 "open_manifest", "verify_files"):
        assert getattr(artifact, name) is getattr(artifact_format, name), name


def test_loading_a_model_imports_no_compression_code():
    code = ("import sys, slmedge.models.source, slmedge.models.artifact_format\n"
            "bad = sorted(m for m in sys.modules if m.startswith('slmedge.compress'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _rtn_artifact(tiny_models, tmp_path) -> tuple[Path, Recipe]:
    from slmedge.compress.api import compress

    recipe = Recipe(method="rtn", bits=4, group_size=32)
    out = tmp_path / "art"
    compress(str(tiny_models("llama")), recipe, out, device="cpu")
    return out, recipe


def test_artifacts_of_the_previous_version_with_an_empty_extra_still_open(tiny_models, tmp_path):
    from slmedge.cli.run import _reusable
    from slmedge.compress.artifact import MANIFEST, Artifact, is_artifact, read_manifest
    from slmedge.models.source import load, resolve

    out, recipe = _rtn_artifact(tiny_models, tmp_path)
    assert "extra" not in json.loads((out / MANIFEST).read_text())["recipe"]
    # What the previous version wrote: the recipe had an (always empty) "extra" table.
    data = json.loads((out / MANIFEST).read_text())
    data["recipe"]["extra"] = {}
    (out / MANIFEST).write_text(json.dumps(data))
    assert is_artifact(out) and resolve(str(out)).kind == "artifact"
    assert "extra" not in read_manifest(out)["recipe"]
    art = Artifact.open(out)  # checksums still verified
    assert Recipe.from_dict(art.manifest["recipe"]) == recipe
    assert _reusable(out, recipe) is not None  # `slmedge run` reuses it as before
    loaded = load(str(out))
    assert loaded.identity["kind"] == "artifact" and loaded.identity["recipe"]["method"] == "rtn"


def test_run_reuses_an_artifact_only_for_the_calibration_windows_it_was_made_on(tiny_models, calib_file, tmp_path):
    # `slmedge run` reuses an artifact of the same recipe, but not one whose calibration windows are no
    # longer what the recipe gives: an edited calibration file (or windows now led by BOS) recompress.
    from conftest import calib_text, small_recipe
    from slmedge.cli.run import _reusable
    from slmedge.compress.api import compress

    data = calib_text(tmp_path / "calib.txt")
    recipe = small_recipe(data, method="gptq", bits=4)
    out = compress(str(tiny_models("llama")), recipe, tmp_path / "art", device="cpu").artifact
    assert _reusable(out, recipe) is not None
    data.write_text(data.read_text(encoding="utf-8").replace("the", "a"), encoding="utf-8")
    assert _reusable(out, recipe) is None
    data.unlink()
    assert _reusable(out, recipe) is None  # gone: compressing again says so


def test_a_saved_recipe_with_unknown_keys_still_fails_loudly():
    data = Recipe(method="rtn").to_dict()
    assert Recipe.from_dict({**data, "extra": {}}) == Recipe(method="rtn")  # the previous version's empty table
    with pytest.raises(ConfigError, match="unknown recipe keys: extra"):
        Recipe.from_dict({**data, "extra": {"anything": 1}})
    with pytest.raises(ConfigError, match="unknown recipe keys: colour"):
        Recipe.from_dict({**data, "colour": "red"})
    assert "extra" not in _field_names(Recipe)
    with pytest.raises(TypeError):
        Recipe(extra={})


def test_open_manifest_says_what_is_wrong(tmp_path):
    from slmedge.errors import ArtifactError
    from slmedge.models.artifact_format import open_manifest

    with pytest.raises(ArtifactError, match="not an artifact directory"):
        open_manifest(tmp_path / "nothing")
    with pytest.raises(ArtifactError, match="incomplete"):
        open_manifest(tmp_path)
    (tmp_path / "slmedge.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        open_manifest(tmp_path)
    (tmp_path / "slmedge.json").write_text("[]")
    with pytest.raises(ArtifactError, match="not an slmedge artifact manifest"):
        open_manifest(tmp_path)


# --- Sparsity: parsed once -------------------------------------------------------------------------------


@pytest.mark.parametrize("value,ratio,nm,text", [("0.5", 0.5, None, "0.5"), (0.5, 0.5, None, "0.5"), ("2:4", 0.5, (2, 4), "2:4"),
                                                  (" 4 : 8 ", 0.5, (4, 8), "4:8"), ("0", 0.0, None, "0"),
                                                  ("0.75", 0.75, None, "0.75"), (0.123456789, 0.123456789, None, "0.123456789")])
def test_sparsity_is_parsed_once_into_a_value(value, ratio, nm, text):
    sp = Sparsity.parse(value)
    assert sp.ratio == ratio and sp.is_nm == (nm is not None) and sp.describe() == text
    if nm:
        assert (sp.n, sp.m) == nm
    assert Sparsity.parse(sp) is sp and Sparsity.parse(sp.describe()) == sp
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.ratio = 0.1


@pytest.mark.parametrize("value,words", [("half", "a ratio in [0, 1) or N:M such as 2:4, got 'half'"),
                                         ("1", "at least 0 and below 1, got 1"), ("-0.1", "at least 0 and below 1"),
                                         ("nan", "below 1, got nan"), ("4:4", "1 <= N < M"), ("0:4", "got 0:4"),
                                         (True, "got True"), ([2, 4], "got [2, 4]")])
def test_an_impossible_sparsity_says_why(value, words):
    with pytest.raises(ConfigError) as err:
        Sparsity.parse(value)
    assert words in str(err.value)


def test_a_sparsity_made_directly_is_checked_too():
    assert Sparsity(0.0, 2, 4).ratio == 0.5
    for bad in (dict(ratio=1.0), dict(ratio=0.0, n=4, m=4), dict(ratio=0.0, n=2)):
        with pytest.raises(ConfigError):
            Sparsity(**bad)


def test_the_recipe_holds_a_parsed_sparsity_and_saves_its_text(tmp_path):
    from slmedge.compress.api import default_output

    r = Recipe(method="wanda", bits=None, sparsity="2:4").validate()
    assert isinstance(r.sparsity, Sparsity) and r.sparsity.is_nm and r.sparsity.m == 4
    assert r.to_dict()["sparsity"] == "2:4" and Recipe.from_dict(r.to_dict()) == r
    assert json.loads(json.dumps(r.to_dict())) == r.to_dict()
    assert r.describe() == "wanda sparsity 2:4"
    assert default_output("m", r).name == "m-wanda-s2of4"
    assert default_output("m", Recipe(method="magnitude", bits=None, sparsity=0.5)).name == "m-magnitude-s0p5"
    with pytest.raises(ConfigError, match="got 'lots'"):
        Recipe(method="wanda", sparsity="lots")


def test_the_settings_that_applied_are_the_methods_own_and_those_it_used():
    # What a GGUF's manifest records of the recipe (Recipe.applied): RTN on a grid without importance read
    # no data and no uniform grid, so only what it did; GPTQ's and AWQ's own settings, never the other's.
    assert Recipe(method="rtn", bits=None, grid="q4_1").validate().applied() == {
        "method": "rtn", "grid": "q4_1", "skip": ["lm_head", "*embed_tokens*"]}
    weighted = Recipe(method="rtn", bits=None, grid="q4_k", importance=True, nsamples=16).validate().applied()
    assert weighted["importance"] is True and weighted["nsamples"] == 16 and "calibration" in weighted
    gptq = Recipe(method="gptq", bits=None, bpw=5.5, bpw_grids=("q4_k", "q6_k"), damp=0.02).validate().applied()
    assert gptq["damp"] == 0.02 and gptq["bpw_grids"] == ["q4_k", "q6_k"] and {"block_size", "act_order"} <= set(gptq)
    assert not [k for k in gptq if k.startswith("awq_") or k in ("bits", "group_size", "symmetric", "grid")]
    awq = Recipe(method="awq", bits=4, group_size=32, awq_grid=10).validate().applied()
    assert awq["awq_grid"] == 10 and (awq["bits"], awq["group_size"], awq["symmetric"]) == (4, 32, False)
    assert not {"damp", "block_size", "act_order", "true_sequential"} & set(awq)
    pruned = Recipe(method="wanda", bits=None, sparsity="2:4").validate().applied()
    assert pruned["sparsity"] == "2:4" and not {"bits", "group_size", "symmetric"} & set(pruned)
    assert Recipe(method="gptq", true_sequential=False).validate().applied()["true_sequential"] is False
    # every setting is read by every method or named as some methods' own: a new one is placed on purpose
    shared = {"method", "bits", "group_size", "symmetric", "grid", "bpw", "bpw_grids", "importance", "sparsity",
              "calibration", "nsamples", "seqlen", "seed", "batch_size", "skip", "true_sequential"}
    own = {name for info in METHODS.values() for name in info.cls.settings}
    assert {f.name for f in dataclasses.fields(Recipe)} == shared | own and not shared & own


# --- the study file's keys come from the dataclasses -------------------------------------------------


def _study_text(method_lines: str, evaluate: str = "") -> str:
    return ('name = "c"\nmodels = ["smollm2-135m"]\n\n[calibration]\nnsamples = 4\nseqlen = 16\n\n'
            f'[evaluate]\nmetrics = ["memory"]\nlangs = []\n{evaluate}\n[[methods]]\n{method_lines}\n')


def _load(tmp_path, text: str):
    f = tmp_path / "c.toml"
    f.write_text(text)
    return load_study(f)


def test_every_recipe_and_eval_setting_is_a_study_key_unless_the_study_sets_it():
    kinds = table_kinds()
    assert set(kinds["methods"]) == (_field_names(Recipe) - set(METHOD_SET_BY_STUDY)) | {"label"}
    assert set(kinds["evaluate"]) == _field_names(EvalSettings) - set(EVAL_SET_BY_STUDY)
    assert set(METHOD_SET_BY_STUDY) <= _field_names(Recipe) and set(EVAL_SET_BY_STUDY) <= _field_names(EvalSettings)
    assert {"block_size", "awq_clip", "skip", "sparsity", "true_sequential"} <= set(kinds["methods"])


def test_a_new_dataclass_field_gets_its_key_and_type():
    @dataclasses.dataclass
    class Settings:
        count: int = 1
        ratio: float | None = None
        names: tuple[str, ...] = ()
        flag: bool = False

    kinds = dataclass_kinds(Settings)
    assert [k.name for k in kinds.values()] == ["int", "float", "list of str", "bool"]
    assert kinds["count"].check(3) and not kinds["count"].check(True) and not kinds["count"].check("3")
    assert kinds["ratio"].check(1) and kinds["ratio"].check(0.5) and not kinds["ratio"].check(False)
    assert kinds["names"].check(["a"]) and not kinds["names"].check([1]) and not kinds["names"].check("a")

    @dataclasses.dataclass
    class Odd:
        table: dict = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="teach slmedge/study/spec.py"):  # a kind nobody thought of fails loudly
        dataclass_kinds(Odd)


def test_block_size_awq_clip_and_skip_are_settable_from_a_study(tmp_path):
    study = _load(tmp_path, _study_text('method = "gptq"\nbits = 4\nblock_size = 64\nskip = ["lm_head", "*mlp*"]')
                  + '\n[[methods]]\nmethod = "awq"\nawq_clip = false\n'
                  + '\n[[methods]]\nmethod = "sparsegpt"\nsparsity = 0.5\nblock_size = 32\n')
    gptq, awq, sgpt = study.methods
    assert gptq.settings["block_size"] == 64 and gptq.settings["skip"] == ["lm_head", "*mlp*"]
    assert awq.settings["awq_clip"] is False and sgpt.settings["block_size"] == 32
    assert sgpt.label == "sparsegpt-s0.5"
    # What a compress job builds from them (slmedge.study.engine: Recipe(method=..., **recipe)).
    r = Recipe(method=gptq.method, **gptq.settings).validate()
    assert r.block_size == 64 and r.skip == ("lm_head", "*mlp*") and r.nsamples == 4 and r.seqlen == 16
    assert Recipe(method=awq.method, **awq.settings).validate().awq_clip is False
    assert Recipe(method=sgpt.method, **sgpt.settings).validate().sparsity == Sparsity(0.5)


# (the line, words of the error, whether it names the key's line or the [[methods]] entry's)
@pytest.mark.parametrize("line,words,at_key", [
    ("block_size = 0", "[[methods]] gptq: block_size must be an integer of at least 1", False),
    ('block_size = "big"', "'block_size' must be a int", True),
    ('awq_clip = "no"', "'awq_clip' must be a bool", True),
    ('skip = "lm_head"', "'skip' must be a list of str", True),
    ("skip = [1]", "'skip' must be a list of str", True),
    ("seed = 3", "unknown key 'seed'", True),  # the study's seeds = [...] set it
    ("nsamples = 3", "unknown key 'nsamples'", True),  # [calibration] sets it
    ("extra = {}", "unknown key 'extra'", True),  # removed from the Recipe
])
def test_study_method_keys_are_checked_with_the_line(tmp_path, line, words, at_key):
    text = _study_text(f'method = "gptq"\nbits = 4\n{line}')
    with pytest.raises(StudyError) as err:
        _load(tmp_path, text)
    n = text.splitlines().index(line) + 1
    want_line = n if at_key else n - 3  # the [[methods]] header, three lines up
    assert words in str(err.value) and f"c.toml, line {want_line}:" in str(err.value), str(err.value)


@pytest.mark.parametrize("value,words", [('"half"', "got 'half'"), ("true", "'sparsity' must be a ratio"),
                                         ('"4:4"', "1 <= N < M"), ("1.0", "below 1")])
def test_a_bad_study_sparsity_names_the_method_and_why(tmp_path, value, words):
    with pytest.raises(StudyError) as err:
        _load(tmp_path, _study_text(f'method = "wanda"\nsparsity = {value}'))
    assert words in str(err.value) and "c.toml, line" in str(err.value)


def test_eval_settings_come_from_the_dataclass_and_the_study_sets_the_rest(tmp_path):
    study = _load(tmp_path, _study_text('method = "none"', "fidelity_windows = 3\n"))
    assert study.evaluate["fidelity_windows"] == 3
    for line, words in (('target = "cpu"', "unknown key 'target'"), ('corpora = "my.txt"', "'corpora' must be a list of str"),
                        ("stride = 0", "stride must be an integer of at least 1, got 0")):
        with pytest.raises(StudyError, match=words):
            _load(tmp_path, _study_text('method = "none"', line + "\n"))


# --- the CLI reaches every setting ----------------------------------------------------------------------

# Recipe fields `slmedge compress` has no option of the same name for, and why.
COMPRESS_NOT_OPTIONS: dict[str, str] = {}
# EvalSettings fields `slmedge evaluate` reaches under another option name.
EVALUATE_RENAMED = {
    "wikitext": "no_wikitext",  # --no-wikitext switches it off
    "corpora": "corpus",  # --corpus FILE, repeatable
}
# EvalSettings fields `slmedge evaluate` has no option for, and why.
EVALUATE_NOT_OPTIONS = {
    "fidelity_windows": "not an option of slmedge evaluate yet: the default (2 windows) is used",
    "memory_child": "internal: the memory probe runs in a child process; only tests switch it off",
}


def _unreachable(fields: set[str], params: set[str], renamed: dict, excluded: dict) -> set[str]:
    return {f for f in fields if f not in excluded and renamed.get(f, f) not in params}


def test_every_recipe_field_is_a_compress_option():
    from slmedge.cli.compress import compress_command, recipe_from_options

    params = set(inspect.signature(compress_command).parameters)
    assert not _unreachable(_field_names(Recipe), params, {}, COMPRESS_NOT_OPTIONS)
    assert set(COMPRESS_NOT_OPTIONS) <= _field_names(Recipe)
    # ... and each reaches the Recipe (recipe_from_options takes every option that is a field).
    assert _field_names(Recipe) - set(COMPRESS_NOT_OPTIONS) <= set(inspect.signature(recipe_from_options).parameters)


def test_every_eval_setting_is_an_evaluate_option():
    from slmedge.cli.evaluate import evaluate_command

    params = set(inspect.signature(evaluate_command).parameters)
    fields = _field_names(EvalSettings)
    assert not _unreachable(fields, params, EVALUATE_RENAMED, EVALUATE_NOT_OPTIONS)
    assert set(EVALUATE_NOT_OPTIONS) <= fields and set(EVALUATE_RENAMED) <= fields


def test_a_field_without_an_option_is_caught():
    assert _unreachable({"bits", "new_setting"}, {"bits"}, {}, {}) == {"new_setting"}
    assert _unreachable({"bits", "new_setting"}, {"bits"}, {}, {"new_setting": "why"}) == set()


def test_compress_options_reach_the_recipe(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from slmedge.cli import app
    from slmedge.compress import api

    seen = {}

    def fake_compress(model, recipe, output, **kw):
        seen["recipe"] = recipe
        raise ConfigError("stop here")

    monkeypatch.setattr(api, "compress", fake_compress)  # the command imports it when it runs
    res = CliRunner().invoke(app, ["compress", "--method", "sparsegpt", "--sparsity", "2:4", "--block-size", "64",
                                   "--no-awq-clip", "--skip", "*mlp*", "--damp", "0.05"])
    assert "stop here" in res.output
    r = seen["recipe"]
    assert r.block_size == 64 and r.awq_clip is False and r.damp == 0.05 and r.sparsity == Sparsity(0.5, 2, 4)
    assert r.skip == ("lm_head", "*embed_tokens*", "*mlp*")


# --- methods say what they are ---------------------------------------------------------------------------


def test_block_level_is_a_property_of_the_method_type():
    from slmedge.compress.methods import METHODS
    from slmedge.compress.methods.base import Method

    assert Method.block_level is False
    assert {n for n, info in METHODS.items() if info.cls.block_level} == {"awq"}
    for name, info in METHODS.items():
        method = info.cls(Recipe(method=name, bits=4, sparsity=None if info.kind == "quantize" else "0.5"))
        assert method.needs_calibration == (method.block_level or method.stats_class is not None), name
    assert not METHODS["rtn"].cls(Recipe(method="rtn")).needs_calibration
    engine = (PKG / "compress" / "engine.py").read_text()
    assert "getattr(method" not in engine and "compress_block\", None" not in engine
