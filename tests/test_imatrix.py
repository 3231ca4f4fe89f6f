"""`slmedge imatrix` (llama.cpp's importance-matrix file from slmedge's calibration) and `slmedge export
--imatrix` (llama.cpp's quantizer weighted by one), on tiny random models built here."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import one_line_error, require_import

from slmedge.cli import app

runner = CliRunner()
NSAMPLES, SEQLEN = 6, 32


@pytest.fixture(autouse=True)
def llama_cpp_installed():
    require_import("llama_cpp")
    require_import("gguf")


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def make(model, out, calib, *extra):
    res = cli("imatrix", model, "-o", out, "--calibration", calib, "--nsamples", NSAMPLES, "--seqlen", SEQLEN,
              "--batch-size", 4, *extra)
    assert res.exit_code == 0, res.output
    return out


def reference_stats(folder, calib):
    """sum of x^2 per input column and token count of every decoder linear, from hooks on the whole
    model's own forward pass (transformers, fp32) over the same calibration windows: independent of
    slmedge's block-by-block capture."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slmedge.data.calibration import load_calibration

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = load_calibration(str(calib), tok, NSAMPLES, SEQLEN, 0).tokens
    sums, counts = {}, {}

    def hook(name):
        def record(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            m.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(ids)
    return sums, counts


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_the_file_is_llamacpps_format_with_each_linears_squared_inputs(model_type, tiny_models, calib_file, tmp_path):
    import gguf

    from slmedge.export.imatrix import read_imatrix

    folder = tiny_models(model_type)
    path = make(folder, tmp_path / "m.imatrix.gguf", calib_file)
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.type"]
    assert bytes(field.parts[field.data[0]]).decode() == "imatrix"
    for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):  # llama-quantize needs all three
        assert key in reader.fields, key
    assert int(reader.fields["imatrix.chunk_count"].parts[-1][0]) == NSAMPLES
    assert int(reader.fields["imatrix.chunk_size"].parts[-1][0]) == SEQLEN
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    # The names are the GGUF tensors slmedge's export writes for these linears
    res = cli("export", folder, "--format", "gguf", "--type", "f16", "-o", tmp_path / "m.gguf", "--no-verify")
    assert res.exit_code == 0, res.output
    model_names = {t.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    entries = {n.removesuffix(".in_sum2") for n in tensors if n.endswith(".in_sum2")}
    assert entries and entries <= model_names and all(n.startswith("blk.") for n in entries)
    assert {n.removesuffix(".counts") for n in tensors if n.endswith(".counts")} == entries
    # ... and the values are the whole model's own forward pass's, per column
    sums, counts = reference_stats(folder, calib_file)
    from slmedge.export.imatrix import gguf_names
    from slmedge.models.architectures import architecture_for
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    names = gguf_names(config, architecture_for(config), sums)
    assert set(names.values()) == entries
    values, meta = read_imatrix(path)
    assert meta["entries"] == len(entries) and meta["slmedge"]["calibration"]["nsamples"] == NSAMPLES
    for hf, g in names.items():
        got = np.asarray(tensors[g + ".in_sum2"].data, dtype=np.float64).reshape(-1)
        assert int(np.asarray(tensors[g + ".counts"].data).reshape(-1)[0]) == counts[hf] == NSAMPLES * SEQLEN
        np.testing.assert_allclose(got, sums[hf].numpy(), rtol=2e-5, err_msg=hf)
        np.testing.assert_allclose(values[g], sums[hf].numpy() / counts[hf], rtol=2e-5, err_msg=hf)


def weighted_error(gguf_path, folder, imatrix_values):
    """sum over linears of sum_j imp_j * (w_ij - w'_ij)^2: the error llama.cpp's quantizer minimises
    with an importance matrix (w' read back from the file, in its row order)."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from slmedge.export.gguf_quant import permute_rows
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    weights = load_file(str(folder / "model.safetensors"))
    reader = gguf.GGUFReader(str(gguf_path))
    total = 0.0
    from slmedge.export.imatrix import gguf_names
    from slmedge.models.architectures import architecture_for

    arch = architecture_for(config)
    linears = [k.removesuffix(".weight") for k in weights if ".layers." in k and k.endswith("proj.weight")]
    names = gguf_names(config, arch, linears)
    by_name = {t.name: t for t in reader.tensors}
    for hf, g in names.items():
        w = weights[hf + ".weight"].float().numpy()
        if hf.endswith("q_proj"):
            w = permute_rows(w, config.num_attention_heads)
        elif hf.endswith("k_proj"):
            w = permute_rows(w, config.num_key_value_heads)
        t = by_name[g]
        got = dequantize(t.data, t.tensor_type).reshape(w.shape)
        total += float((imatrix_values[g][None, :] * (w - got) ** 2).sum())
    return total


def test_export_with_the_imatrix_weights_llamacpps_quantizer(tiny_models, calib_file, tmp_path):
    """The same model to Q4_0 by llama.cpp's quantizer, with and without the importance matrix: the
    file differs, records the matrix, and its importance-weighted error is lower."""
    from slmedge.export.imatrix import read_imatrix

    folder = tiny_models("llama")
    imx = make(folder, tmp_path / "m.imatrix.gguf", calib_file)
    values, _ = read_imatrix(imx)
    files = {}
    for name, extra in (("plain", ()), ("weighted", ("--imatrix", imx))):
        files[name] = tmp_path / f"{name}.gguf"
        res = cli("export", folder, "--format", "gguf", "--type", "q4_0", "-o", files[name], "--json", *extra)
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout)  # llama.cpp logs to stderr
        assert (report["imatrix"] is not None) == bool(extra)
    assert report["imatrix"]["entries_used"] == len(values) and report["imatrix"]["chunk_count"] == NSAMPLES
    assert files["plain"].read_bytes() != files["weighted"].read_bytes()
    plain, weighted = (weighted_error(files[n], folder, values) for n in ("plain", "weighted"))
    assert weighted < 0.97 * plain, (weighted, plain)
    from slmedge.export.gguf import read_gguf_manifest

    assert read_gguf_manifest(files["weighted"])["imatrix"]["sha256"]


def test_an_unusable_imatrix_is_refused_before_any_work(tiny_models, calib_file, tmp_path):
    folder = tiny_models("llama")
    other = make(tiny_models("phi3"), tmp_path / "phi3.imatrix.gguf", calib_file)
    out = tmp_path / "m.gguf"
    # made for another model: widths or names disagree
    res = cli("export", folder, "--format", "gguf", "--type", "q4_k_m", "-o", out, "--imatrix", other)
    one_line_error(res, "phi3.imatrix.gguf", "another model")
    assert res.exit_code == 1 and not out.exists()
    # not an importance matrix at all
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    res = cli("export", folder, "--format", "gguf", "--type", "q4_k_m", "-o", out, "--imatrix", junk)
    one_line_error(res, "junk.gguf", "not an importance matrix")
    assert res.exit_code == 1 and not out.exists()
    # a GGUF model file is not an importance matrix either (no imatrix keys)
    cli("export", folder, "--format", "gguf", "--type", "f16", "-o", tmp_path / "f16.gguf", "--no-verify")
    res = cli("export", folder, "--format", "gguf", "--type", "q4_k_m", "-o", out, "--imatrix", tmp_path / "f16.gguf")
    one_line_error(res, "imatrix.datasets")
    assert not out.exists()
    # missing file; another format
    res = cli("export", folder, "--format", "gguf", "--type", "q4_k_m", "-o", out, "--imatrix", tmp_path / "nope.gguf")
    one_line_error(res, "nope.gguf", "does not exist")
    res = cli("export", folder, "--format", "onnx", "--type", "int4", "-o", tmp_path / "onnx",
              "--imatrix", tmp_path / "phi3.imatrix.gguf")
    one_line_error(res, "--imatrix", "gguf")
    assert res.exit_code == 2 and not (tmp_path / "onnx").exists()


def test_nothing_to_weight_is_a_bad_setting(tiny_models, calib_file, tmp_path):
    """f16 and codes kept throughout: llama.cpp's quantizer never runs, so --imatrix is refused."""
    folder = tiny_models("llama")
    imx = make(folder, tmp_path / "m.imatrix.gguf", calib_file)
    res = cli("export", folder, "--format", "gguf", "--type", "f16", "-o", tmp_path / "f.gguf", "--imatrix", imx)
    one_line_error(res, "nothing", "importance matrix")
    assert res.exit_code == 2 and not (tmp_path / "f.gguf").exists()


def test_the_output_is_slmedges_own_to_replace(tiny_models, calib_file, tmp_path):
    folder = tiny_models("llama")
    foreign = tmp_path / "theirs.gguf"
    foreign.write_bytes(b"someone else's file")
    res = cli("imatrix", folder, "-o", foreign, "--calibration", calib_file, "--nsamples", NSAMPLES, "--seqlen", SEQLEN,
              "--overwrite")
    one_line_error(res, "theirs.gguf", "not an importance matrix slmedge wrote")
    assert foreign.read_bytes() == b"someone else's file"
    ours = make(folder, tmp_path / "ours.gguf", calib_file)
    before = ours.read_bytes()
    res = cli("imatrix", folder, "-o", ours, "--calibration", calib_file, "--nsamples", NSAMPLES, "--seqlen", SEQLEN)
    one_line_error(res, "exists", "--overwrite")
    make(folder, ours, calib_file, "--overwrite", "--seed", 1)
    assert ours.read_bytes() != before  # other windows, other statistics
    res = cli("imatrix", folder, "-o", tmp_path / "m.dat", "--calibration", calib_file)
    one_line_error(res, ".gguf")
    assert res.exit_code == 2 and not (tmp_path / "m.dat").exists()
    res = cli("imatrix", tmp_path / "missing-model", "-o", tmp_path / "x.gguf")
    assert res.exit_code == 1 and not (tmp_path / "x.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_an_architecture_slmedge_does_not_write_as_gguf_is_refused(tiny_models, calib_file, tmp_path):
    res = cli("imatrix", tiny_models("gemma2"), "-o", tmp_path / "g.gguf", "--calibration", calib_file,
              "--nsamples", NSAMPLES, "--seqlen", SEQLEN)
    one_line_error(res, "gemma2", "GGUF")
    assert res.exit_code == 1 and not (tmp_path / "g.gguf").exists()


def test_a_study_puts_files_weighted_by_an_importance_matrix_in_its_grid(tmp_path, tiny_models):
    """[[exports]] imatrix = true: each row's GGUF is quantized by llama.cpp weighted by slmedge's matrix of
    the row's model on the study's calibration windows (for the base row: llama.cpp's imatrix file, the
    baseline a llama.cpp user has for free); the matrix is not left behind, and its windows are part of
    the job: other calibration settings make another file."""
    import gguf

    from conftest import tiny_study_file
    from slmedge.evaluate.store import ResultsStore
    from slmedge.export.gguf import read_gguf_manifest
    from slmedge.study.engine import run_study
    from slmedge.study.jobs import build_jobs
    from slmedge.study.report import load_rows
    from slmedge.study.spec import load_study

    f = tiny_study_file(tmp_path, tiny_models("llama"), "imx", ['method = "none"'],
                        exports=('"gguf"\ntype = "q4_0"', '"gguf"\ntype = "q4_0"\nimatrix = true'), calibration=True)
    store = ResultsStore(tmp_path / "r.sqlite")
    try:
        counts = run_study(load_study(f), store)
        assert counts["failed"] == 0 and counts["ran_by_kind"]["export"] == 2
        rows = {r["labels"]["export"]: r for r in load_rows(store, "imx")}
    finally:
        store.close()
    assert set(rows) == {"gguf-q4_0", "gguf-q4_0-imatrix"}
    files = sorted((tmp_path / "work-imx" / "exports").glob("*.gguf"))
    assert len(files) == 2 and not [p for p in (tmp_path / "work-imx" / "exports").iterdir() if p.name.startswith(".")]
    manifests = {bool(read_gguf_manifest(p).get("imatrix")): p for p in files}
    assert set(manifests) == {False, True}
    weighted = read_gguf_manifest(manifests[True])["imatrix"]
    assert weighted["chunk_count"] == 64 and weighted["chunk_size"] == 128 and weighted["datasets"] == ["c4"]
    plain, imx = ({t.name: bytes(t.data) for t in gguf.GGUFReader(str(manifests[k])).tensors} for k in (False, True))
    assert plain["blk.0.ffn_down.weight"] != imx["blk.0.ffn_down.weight"]
    ppl = {k: r["metrics"]["perplexity"]["c.txt"] for k, r in rows.items()}
    assert all(v > 0 for v in ppl.values())
    # the windows are the job's inputs: 32 samples instead of 64 is another export
    before = {j.id for j in build_jobs(load_study(f), tmp_path / "w") if j.kind == "export"}
    f.write_text(f.read_text().replace("nsamples = 64", "nsamples = 32"))
    after = {j.id for j in build_jobs(load_study(f), tmp_path / "w") if j.kind == "export"}
    assert len(before & after) == 1  # the plain Q4_0 export reads no calibration


def test_a_study_refuses_an_imatrix_where_llamacpp_does_not_quantize(tmp_path, tiny_models):
    from conftest import tiny_study_file
    from slmedge.study.spec import StudyError, load_study

    for fmt in ('"gguf"\nimatrix = true', '"gguf"\ntype = "f16"\nimatrix = true', '"onnx"\ntype = "int4"\nimatrix = true'):
        f = tiny_study_file(tmp_path, tiny_models("llama"), "bad", ['method = "none"'], exports=(fmt,))
        with pytest.raises(StudyError, match=r"imatrix = true weights llama.cpp's quantizer"):
            load_study(f)


def test_an_artifact_that_keeps_its_codes_has_nothing_for_the_matrix_to_weight(artifacts, tiny_models, calib_file,
                                                                               tmp_path):
    """An RTN W4 g32 sym artifact to Q4_0: every block keeps its codes; llama.cpp quantizes the embedding and
    head alone, which a matrix (without --process-output) does not cover: a bad setting, said as such."""
    imx = make(tiny_models("llama"), tmp_path / "m.imatrix.gguf", calib_file)
    art = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=True)
    res = cli("export", art, "--format", "gguf", "--type", "q4_0", "-o", tmp_path / "a.gguf", "--imatrix", imx)
    one_line_error(res, "nothing to weight", "keep their codes")
    assert res.exit_code == 2 and not (tmp_path / "a.gguf").exists()


def test_a_full_disk_while_writing_the_matrix_is_one_line(tiny_models, calib_file, tmp_path, monkeypatch):
    import errno

    import gguf

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    out = tmp_path / "m.imatrix.gguf"
    res = cli("imatrix", tiny_models("llama"), "-o", out, "--calibration", calib_file, "--nsamples", NSAMPLES,
              "--seqlen", SEQLEN)
    one_line_error(res, "no space left", "m.imatrix.gguf")
    assert res.exit_code == 1 and not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- every file checked on read (issue 59): sealed when slmedge writes it, its values and model otherwise ----


def rewritten(src, dst, change=None, datasets=("/data/wiki.train.raw",)):
    """slmedge's matrix at ``src`` written as ``llama-imatrix`` writes one (the same keys and entries, no
    slmedge identity, no seal) at ``dst``; ``change(tensor name, values) -> values`` edits entries."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", list(datasets))
    writer.add_uint32("imatrix.chunk_count", NSAMPLES)
    writer.add_uint32("imatrix.chunk_size", SEQLEN)
    for t in sorted(reader.tensors, key=lambda t: t.name):
        values = np.array(t.data, dtype=np.float32)
        writer.add_tensor(t.name, change(t.name, values) if change else values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def q4(folder, out, imx):
    return cli("export", folder, "--format", "gguf", "--type", "q4_0", "-o", out, "--imatrix", imx, "--json")


@pytest.fixture
def matrix(tiny_models, calib_file, tmp_path):
    return make(tiny_models("llama"), tmp_path / "m.imatrix.gguf", calib_file)


def test_a_matrix_made_for_another_model_of_the_same_shapes_is_refused(matrix, tiny_models, tmp_path):
    from tiny import save_tiny

    other = save_tiny("llama", tmp_path / "other", seed=1)  # the same shapes, other weights
    out = tmp_path / "o.gguf"
    res = q4(other, out, matrix)
    one_line_error(res, "m.imatrix.gguf", "made for another model")
    assert res.exit_code == 1 and not out.exists()
    res = q4(tiny_models("llama"), out, matrix)  # its own model
    assert res.exit_code == 0, res.output


def test_slmedges_matrix_is_sealed_a_flipped_byte_or_a_cut_is_refused(matrix, tiny_models, tmp_path):
    import gguf

    from slmedge.export.imatrix import KEY, read_imatrix

    field = gguf.GGUFReader(str(matrix)).fields[KEY]
    assert json.loads(bytes(field.parts[field.data[0]]))["manifest_sha256"]  # the seal is written
    data = matrix.read_bytes()
    out = tmp_path / "o.gguf"
    for name, broken in (("flipped", data[:-7] + bytes([data[-7] ^ 0x40]) + data[-6:]),
                         ("cut", data[: len(data) * 2 // 3])):
        bad = tmp_path / f"{name}.imatrix.gguf"
        bad.write_bytes(broken)
        res = q4(tiny_models("llama"), out, bad)
        one_line_error(res, bad.name, "changed since slmedge wrote it")
        assert res.exit_code == 1 and not out.exists()
        assert "reshape" not in res.output and ".dat" not in res.output
    # the identity itself edited (the calibration claimed other): its seal no longer holds
    text = bytes(field.parts[field.data[0]])
    edited = tmp_path / "edited.imatrix.gguf"
    edited.write_bytes(data.replace(text, text.replace(b'"seed":0', b'"seed":7'), 1))
    assert edited.read_bytes() != data
    with pytest.raises(Exception, match="edited.imatrix.gguf.*(damaged or unsealed|changed since)"):
        read_imatrix(edited)


def test_llamacpps_own_matrix_is_read_and_its_values_checked(matrix, tiny_models, tmp_path):
    """A file without slmedge's identity (llama-imatrix's) is used; a NaN, a negative sum, a fractional
    count, sums that are no rows of their counts, a truncation: each one error line, exit 1, before work."""
    from slmedge.export.gguf import read_gguf_manifest

    folder = tiny_models("llama")
    theirs = rewritten(matrix, tmp_path / "theirs.imatrix.gguf")
    out = tmp_path / "o.gguf"
    res = q4(folder, out, theirs)
    assert res.exit_code == 0, res.output
    assert read_gguf_manifest(out)["imatrix"]["datasets"] == ["wiki.train.raw"]  # no local path for others

    def entry(suffix, edit):
        return lambda name, v: edit(v) if name == "blk.0.attn_q.weight" + suffix else v

    def nan(v):
        v = v.copy()
        v.flat[3] = np.nan
        return v

    def five(v):  # five counts (experts) for 64 sums: no whole rows
        return np.repeat(v.reshape(-1), 5)

    cases = {"nan": (entry(".in_sum2", nan), "NaN"),
             "negative": (entry(".in_sum2", lambda v: -v), "negative"),
             "fraction": (entry(".counts", lambda v: v + 0.5), "whole number"),
             "rows": (entry(".counts", five), "64 sums of squares for 5 counts")}
    for name, (change, words) in cases.items():
        bad = rewritten(matrix, tmp_path / f"{name}.imatrix.gguf", change)
        res = q4(folder, tmp_path / "x.gguf", bad)
        one_line_error(res, bad.name, "blk.0.attn_q.weight", words)
        assert res.exit_code == 1 and not (tmp_path / "x.gguf").exists(), name
    cut = tmp_path / "cut.imatrix.gguf"
    cut.write_bytes(theirs.read_bytes()[:-100])
    res = q4(folder, tmp_path / "x.gguf", cut)
    one_line_error(res, "cut.imatrix.gguf", "damaged or truncated")
    assert res.exit_code == 1 and "reshape" not in res.output and ".dat" not in res.output


def test_counts_that_do_not_match_the_windows_are_refused(tiny_models, tmp_path):
    """slmedge's own file (sealed as written): every count is its windows' tokens, chunk_count x chunk_size."""
    import torch as t

    from slmedge.export.imatrix import read_imatrix, write_imatrix

    class Stat:
        sum2, count = t.ones(64), NSAMPLES * SEQLEN - 1

    path = write_imatrix(tmp_path / "w.imatrix.gguf", {"q": Stat()}, {"q": "blk.0.attn_q.weight"}, chunk_size=SEQLEN,
                         chunk_count=NSAMPLES, datasets=["c4"], identity={"format": "slmedge-imatrix"})
    with pytest.raises(Exception, match=rf"w.imatrix.gguf: blk.0.attn_q.weight.counts says {NSAMPLES * SEQLEN - 1} "
                                        rf"tokens, but the file records {NSAMPLES * SEQLEN}"):
        read_imatrix(path)


def test_a_folder_or_a_missing_file_is_said_as_such(tiny_models, tmp_path):
    folder = tiny_models("llama")
    (tmp_path / "dir.gguf").mkdir()
    res = q4(folder, tmp_path / "o.gguf", tmp_path / "dir.gguf")
    one_line_error(res, "dir.gguf", "is a folder")
    assert res.exit_code == 1 and "does not exist" not in res.output
    res = q4(folder, tmp_path / "o.gguf", tmp_path / "none.gguf")
    one_line_error(res, "none.gguf", "does not exist")
    assert res.exit_code == 1


def test_more_windows_than_the_text_holds_are_refused(tiny_models, tmp_path):
    """llama-imatrix stops where its text ends; slmedge refuses windows that would repeat it."""
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox jumps over the lazy dog. " * 30, encoding="utf-8")
    out = tmp_path / "m.imatrix.gguf"
    res = cli("imatrix", tiny_models("llama"), "-o", out, "--calibration", short, "--nsamples", 5000, "--seqlen", SEQLEN)
    one_line_error(res, "--nsamples 5000", "short.txt", "--nsamples")
    assert res.exit_code == 2 and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
