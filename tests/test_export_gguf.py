"""GGUF export on tiny models: llama.cpp loads what we write, and the artifact's codes arrive as they are."""

import json
import shutil
import warnings

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import small_recipe
from slmedge.compress.api import compress
from slmedge.compress.artifact import Artifact
from slmedge.errors import OutputExistsError, UnsupportedArchitectureError
from slmedge.export import GGUFExportError, GGUFVerificationError
from slmedge.export import gguf as gx
from slmedge.export import gguf_hparams as gh
from slmedge.export import gguf_quant as gq
from slmedge.export import gguf_vocab as gv
from slmedge.export.gguf import export_gguf
from slmedge.export.gguf_quant import permute_rows, unpermute_rows
from slmedge.export.gguf_vocab import pre_tokenizer_name
from slmedge.export.inspect import inspect_path, pack_tensors, read_gguf_manifest, unpack_tensors

# (model type, method, recipe overrides, GGUF type the codes must land in)
CASES = [
    ("llama", "gptq", dict(bits=4, group_size=32, symmetric=True), "Q4_0"),
    ("llama", "awq", dict(bits=4, group_size=32, symmetric=False), "Q4_1"),
    ("llama", "rtn", dict(bits=8, group_size=-1, symmetric=True), "Q8_0"),
    ("qwen2", "gptq", dict(bits=4, group_size=32, symmetric=True), "Q4_0"),
    ("qwen2", "awq", dict(bits=4, group_size=32, symmetric=False), "Q4_1"),
    ("qwen2", "rtn", dict(bits=8, group_size=-1, symmetric=True), "Q8_0"),
    ("mistral", "gptq", dict(bits=4, group_size=32, symmetric=True), "Q4_0"),
    ("qwen3", "awq", dict(bits=4, group_size=64, symmetric=False), "Q4_1"),
    ("phi3", "gptq", dict(bits=4, group_size=32, symmetric=True), "Q4_0"),
    ("phi3", "awq", dict(bits=4, group_size=32, symmetric=False), "Q4_1"),
    ("gemma3_text", "gptq", dict(bits=4, group_size=32, symmetric=True), "Q4_0"),
    ("gemma3_text", "awq", dict(bits=4, group_size=32, symmetric=False), "Q4_1"),
]




def read(path):
    reader = gguf.GGUFReader(str(path))
    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    fields = {name: f.contents() for name, f in reader.fields.items() if name not in big}
    return reader, fields, {t.name: t for t in reader.tensors}


# --- f32: the layout, metadata and tokenizer are right ------------------------------------------


def test_a_byte_level_bpe_marked_byte_fallback_is_written_as_gpt2(tiny_models, tmp_path):
    """transformers' conversion of a GGUF "gpt2" vocabulary (e.g. the embedded SmolLM2's HF folder,
    which scripts/make_random_model.py copies) writes BPE with byte_fallback *and* a ByteLevel
    pre-tokenizer: every byte already has its token, so it is GPT-2 style, not SentencePiece
    (written as SentencePiece, llama.cpp aborted in byte_to_token)."""
    src = tmp_path / "src"
    shutil.copytree(tiny_models("llama"), src)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = True
    (src / "tokenizer.json").write_text(json.dumps(tj))
    report = export_gguf(src, tmp_path / "m.gguf", qtype="f32")
    assert report["verification"]["tokenizer_agrees"]
    _, fields, _ = read(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.model"] == "gpt2"


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_f32_gguf_gives_torch_logits_in_llamacpp(model_type, tiny_models, tmp_path):
    out = tmp_path / "m.gguf"
    report = export_gguf(tiny_models(model_type), out, qtype="f32")
    v = report["verification"]
    assert v["tokenizer_agrees"]  # llama.cpp tokenizes the probe as transformers does
    assert v["mean_kl"] < 1e-5 and v["max_abs_logit_diff"] < 0.02 and v["top1_agreement"] > 0.97
    _, fields, tensors = read(out)
    assert fields["general.architecture"] == model_type
    # the tiny qwen2 tokenizer splits as Qwen2's does (tests/tiny.py)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == {"qwen2": "qwen2"}.get(model_type, "gpt-2")
    assert fields[f"{model_type}.block_count"] == 2 and fields[f"{model_type}.embedding_length"] == 64
    assert fields[f"{model_type}.attention.head_count_kv"] == (4 if model_type == "llama" else 2)
    assert "output.weight" not in tensors  # tied embeddings
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    assert report["qk_permuted"] == (model_type == "llama")


def test_f16_and_hf_folder_quantized_by_llamacpp(tiny_models, tmp_path):
    src = tiny_models("qwen2")
    f16 = export_gguf(src, tmp_path / "f16.gguf", qtype="f16")
    assert f16["tensors"]["blk.0.attn_q.weight"]["type"] == "F16" and f16["verification"]["mean_kl"] < 1e-4
    q4 = export_gguf(src, tmp_path / "q4.gguf", qtype="q4_0")  # no codes: llama.cpp's quantizer
    assert q4["requantized_by_llamacpp"] > 0 and q4["codes_kept"] == 0
    _, _, tensors = read(tmp_path / "q4.gguf")
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert tensors["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("model_type", sorted(gx.GGUF_ARCHITECTURES))
def test_every_gguf_architecture_f32_matches_torch_and_names_itself(model_type, tiny_models, tmp_path):
    out = tmp_path / "m.gguf"
    report = export_gguf(tiny_models(model_type), out, qtype="f32")
    v = report["verification"]
    assert v["tokenizer_agrees"] and v["mean_kl"] < 1e-5 and v["top1_agreement"] > 0.97
    _, fields, tensors = read(out)
    assert fields["general.architecture"] == gx.GGUF_ARCHITECTURES[model_type].arch.lower()
    manifest = read_gguf_manifest(out, fields)
    assert manifest["qtype"] == "f32" and manifest["source_kind"] == "hf_dir"
    assert set(manifest["tensors"]) <= set(tensors)
    if model_type == "phi3":  # fused projections as llama.cpp's phi3 expects them
        assert "blk.0.attn_qkv.weight" in tensors and tuple(tensors["blk.0.ffn_up.weight"].shape) == (64, 256)


def test_gemma3_writes_its_layer_types_and_norm_offset_and_refuses_what_llamacpp_would_compute_otherwise(
        tiny_models, tmp_path):
    src = tiny_models("gemma3_text")  # layer 0 sliding (window 16), layer 1 full; the probe is longer than 16
    report = export_gguf(src, tmp_path / "m.gguf", qtype="f32")
    assert report["verification"]["mean_kl"] < 1e-5  # without the per-layer flags llama.cpp slides both: KL ~0.1
    _, fields, tensors = read(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "gemma3"
    assert fields["gemma3.attention.sliding_window"] == 16
    assert list(fields["gemma3.attention.sliding_window_pattern"]) == [True, False]
    assert fields["gemma3.rope.freq_base_swa"] == 10000.0
    model = AutoModelForCausalLM.from_pretrained(src)
    for hf, name in (("model.layers.0.self_attn.q_norm", "blk.0.attn_q_norm.weight"),
                     ("model.layers.1.pre_feedforward_layernorm", "blk.1.ffn_norm.weight"),
                     ("model.norm", "output_norm.weight")):  # Gemma's RMSNorm scales by 1 + weight
        weight = model.get_submodule(hf).weight.data.numpy()
        assert np.array_equal(np.asarray(tensors[name].data), weight + 1), name
    # Configurations llama.cpp's gemma3 would silently compute differently are refused, with nothing written.
    for key, value, words in (("query_pre_attn_scalar", 32, "query_pre_attn_scalar 32"),
                              ("layer_types", ["sliding_attention"], "layer_types"),
                              ("attn_logit_softcapping", 50.0, "soft-capping")):
        bad = tmp_path / key
        shutil.copytree(src, bad)
        config = json.loads((bad / "config.json").read_text())
        config[key] = value
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(GGUFExportError, match=words):
            export_gguf(bad, tmp_path / f"{key}.gguf", qtype="f32", verify=False)
        assert not (tmp_path / f"{key}.gguf").exists()


def test_gemma3_query_scale_follows_llamacpp_which_takes_62_layers_for_the_27b():
    # llama.cpp's gemma3 scales queries by 1/sqrt(head_dim), but a 62-layer model (its "27B") by
    # 1/sqrt(hidden // heads): Gemma 3 27B's query_pre_attn_scalar 168 = 5376 // 32, head_dim 128.
    from types import SimpleNamespace

    class Writer:
        def __getattr__(self, name):
            return lambda *a, **k: None

    def config(layers, scalar):
        return SimpleNamespace(num_hidden_layers=layers, hidden_size=5376, num_attention_heads=32,
                               query_pre_attn_scalar=scalar, layer_types=["full_attention"] * layers,
                               attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=None)

    gh.add_layer_types(Writer(), config(62, 168), head_dim=128)  # the 27B as it is
    gh.add_layer_types(Writer(), config(34, 128), head_dim=128)  # any other depth: head_dim
    with pytest.raises(GGUFExportError, match=r"hidden_size // heads \(its 27B rule\) 168"):
        gh.add_layer_types(Writer(), config(62, 128), head_dim=128)
    with pytest.raises(GGUFExportError, match="head_dim 128"):
        gh.add_layer_types(Writer(), config(34, 168), head_dim=128)


def test_unsupported_gguf_architecture_lists_the_supported_ones(tiny_models, tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match="supported: llama, mistral, qwen2, qwen3, phi3, gemma3_text"):
        export_gguf(tiny_models("gemma2"), tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_k_quants_go_through_llamacpp_with_a_warning_and_the_manifest_says_so(artifacts, tmp_path):
    art_dir = artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True)
    with pytest.warns(UserWarning, match="calibration"):
        report = export_gguf(art_dir, tmp_path / "m.gguf", qtype="q4_k_m")
    assert report["codes_kept"] == 0 and report["requantized_by_llamacpp"] > 0 and not report["exact"]
    _, fields, _ = read(tmp_path / "m.gguf")
    manifest = read_gguf_manifest(tmp_path / "m.gguf", fields)
    assert manifest["tensors"]["blk.0.ffn_up.weight"]["type"] == "requantized by llama.cpp (q4_k_m)"
    assert manifest["tensors"]["blk.0.ffn_up.weight"]["codes_kept"] is False
    # inspect (and its --tensors table) names the type llama.cpp chose for each such tensor
    chosen = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    shown = inspect_path(tmp_path / "m.gguf")["manifest"]["tensors"]
    assert {name: e["type"] for name, e in shown.items() if "requantized" in e["type"]} == \
        {name: f"{chosen[name]}, requantized by llama.cpp (q4_k_m)" for name, e in manifest["tensors"].items()
         if e["type"].startswith("requantized")}
    assert shown["blk.0.ffn_up.weight"]["type"] == f"{report['tensors']['blk.0.ffn_up.weight']['type']}, " \
                                                   "requantized by llama.cpp (q4_k_m)"
    with pytest.raises(GGUFExportError, match="cannot be kept"):
        export_gguf(art_dir, tmp_path / "e.gguf", qtype="q4_k_m", exact=True)
    assert not (tmp_path / "e.gguf").exists()


def test_the_manifest_names_the_blocks_that_share_an_entry_once_and_reads_back_per_tensor():
    q4 = {"codes_kept": True, "grid": "Q4_K", "type": "Q4_K"}
    q6 = {"codes_kept": True, "grid": "Q6_K", "type": "Q6_K"}
    norm = {"codes_kept": False, "type": "F32"}
    entries = {"token_embd.weight": {"codes_kept": False, "type": "Q6_K"}, "output_norm.weight": norm}
    for i in range(30):
        entries[f"blk.{i}.attn_norm.weight"] = norm
        entries[f"blk.{i}.attn_q.weight"] = {**q4, "sparsity": 0.5} if i == 12 else q4
        entries[f"blk.{i}.ffn_down.weight"] = q6 if i in (0, 1, 2, 7, 29) else q4
    packed = pack_tensors(entries)
    assert packed == {"token_embd.weight": entries["token_embd.weight"], "output_norm.weight": norm,
                      "blk.{0-29}.attn_norm.weight": norm,
                      "blk.{0-11,13-29}.attn_q.weight": q4, "blk.12.attn_q.weight": {**q4, "sparsity": 0.5},
                      "blk.{0-2,7,29}.ffn_down.weight": q6, "blk.{3-6,8-28}.ffn_down.weight": q4}
    assert unpack_tensors(packed) == entries
    order = list(unpack_tensors(packed))  # block by block, as `slmedge inspect --tensors` lists them
    assert order[:4] == ["blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.attn_norm.weight"]
    assert order[-2:] == ["output_norm.weight", "token_embd.weight"]
    assert len(json.dumps(packed)) * 10 < len(json.dumps(entries))
    assert unpack_tensors(entries) == entries  # a manifest written one key per tensor reads the same
    for hostile in ({"blk.{0-99999999}.attn_q.weight": q4}, {"blk.{5-2}.attn_q.weight": q4},
                    {"blk.{1-}.attn_q.weight": q4}, {"blk.{0,,2}.attn_q.weight": q4},
                    {"blk.{0-1}.attn_q.weight": q4, "blk.1.attn_q.weight": q6}):
        with pytest.raises(ValueError, match="manifest"):
            unpack_tensors(hostile)


# --- codes -> blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,method,kw,qtype", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_artifact_codes_reach_gguf_blocks_unchanged(model_type, method, kw, qtype, artifacts, tmp_path):
    art_dir = artifacts(model_type, method, **kw)
    out = tmp_path / "m.gguf"
    # auto: the type matching the codes; the embedding/head kept at f16 so logits compare tightly
    report = export_gguf(art_dir, out, keep_f16_uncoded=True)
    assert report["qtype"] == qtype.lower() and report["exact"] and report["requantized_by_llamacpp"] == 0
    art = Artifact.open(art_dir)
    layers = art.layers()
    assert report["codes_kept"] == len(layers)
    manifest = read_gguf_manifest(out)
    assert sum(t["codes_kept"] for t in manifest["tensors"].values()) == len(layers)
    stored = json.loads(read(out)[1]["slmedge.manifest"])["tensors"]  # one key per kind of tensor
    assert len(stored) < len(manifest["tensors"]) and unpack_tensors(stored) == manifest["tensors"]
    model = art.load_model()
    _, _, tensors = read(out)
    heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 4 if model_type == "llama" else 2}
    permuted = model_type in ("llama", "mistral")
    for name, res in layers.items():
        gname = next(g for g, info in report["tensors"].items() if info.get("hf_name") == f"{name}.weight")
        t = tensors[gname]
        assert t.tensor_type == gguf.GGMLQuantizationType[qtype], name
        decoded = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(res.codes.shape)
        rel = name.split(".", 3)[-1]
        if permuted and rel in heads:  # undo llama.cpp's rotary row order
            decoded = unpermute_rows(decoded, heads[rel])
        weight = model.get_submodule(name).weight.data.numpy()
        if qtype == "Q4_1":  # m = -scale*zero is rounded to fp16: within half an fp16 step of m
            m = (res.scales.float() * res.zeros.float()).abs().max().item()
            assert np.abs(decoded - weight).max() <= m * 2.0**-11 + 1e-7, name
        else:
            assert np.array_equal(decoded, weight), name
    v = report["verification"]
    assert v["tokenizer_agrees"] and v["mean_kl"] < 0.01 and v["top1_agreement"] >= 0.9


def test_uncoded_tensors_get_llamacpps_type_and_codes_stay_exact(artifacts, tmp_path):
    art_dir = artifacts("qwen2", "gptq", bits=4, group_size=32, symmetric=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing calibrated is lost: no warning
        report = export_gguf(art_dir, tmp_path / "m.gguf", "q4_0")
    assert report["exact"] and report["codes_kept"] == 14
    emb = report["tensors"]["token_embd.weight"]
    assert emb.get("uncoded") and emb["type"] not in ("F16", "F32")  # what llama.cpp gives it in a q4_0 file
    small = export_gguf(art_dir, tmp_path / "f16emb.gguf", "q4_0", keep_f16_uncoded=True)
    assert small["tensors"]["token_embd.weight"]["type"] == "F16"
    assert report["bytes"] < small["bytes"]


def test_blocks_follow_llamacpp_layout():
    # One row, one block: element j in the low nibble of byte j, element j+16 in its high nibble.
    from slmedge.compress.quant import QuantSpec

    codes = np.arange(32, dtype=np.uint8)[None] % 16
    scales = np.array([[0.5]], dtype=np.float16)
    zeros = np.array([[8]], dtype=np.uint8)
    blocks = gq.codes_to_blocks(codes, scales, zeros, QuantSpec(4, 32, True), gq.QTYPES["q4_0"])
    assert blocks.shape == (1, 18)
    assert blocks[0, 2] == (codes[0, 0] | (codes[0, 16] << 4))
    decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(decoded[0], 0.5 * (codes[0].astype(np.float32) - 8))
    # A ragged last group (96 columns, group 64): every 32-block still sits in one group.
    spec = QuantSpec(8, 64, True)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (3, 96)).astype(np.uint8)
    scales = rng.uniform(-0.1, 0.1, (3, 2)).astype(np.float16)
    zeros = np.full((3, 2), 128, dtype=np.uint8)
    blocks = gq.codes_to_blocks(codes, scales, zeros, spec, gq.QTYPES["q8_0"])
    s = np.repeat(scales.astype(np.float32), 64, axis=1)[:, :96]
    assert np.array_equal(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0),
                          s * (codes.astype(np.float32) - 128))


def test_qk_permutation_is_llamacpp_convert():
    w = torch.randn(48, 8)
    n_head = 3
    expected = w.reshape(n_head, 2, 48 // n_head // 2, 8).swapaxes(1, 2).reshape(w.shape)  # convert_hf_to_gguf
    assert np.array_equal(permute_rows(w.numpy(), n_head), expected.numpy())
    assert np.array_equal(unpermute_rows(permute_rows(w.numpy(), n_head), n_head), w.numpy())
    # Group parameters (rows, G) follow the same row order.
    assert np.array_equal(permute_rows(w.numpy()[:, :2], n_head), expected.numpy()[:, :2])


def test_codes_that_do_not_fit_go_through_llamacpp_with_a_warning(artifacts, tmp_path):
    art_dir = artifacts("llama", "rtn", bits=4, group_size=16, symmetric=True)
    with pytest.raises(GGUFExportError, match="group size 16"):
        export_gguf(art_dir, tmp_path / "exact.gguf", exact=True)
    assert not (tmp_path / "exact.gguf").exists()
    with pytest.warns(UserWarning, match="calibration"):
        report = export_gguf(art_dir, tmp_path / "m.gguf", qtype="q4_0")
    assert report["codes_kept"] == 0 and report["requantized_by_llamacpp"] == 15 and not report["exact"]  # 14 + embedding
    assert report["tensors"]["blk.0.ffn_up.weight"]["type"] == "Q4_0"
    assert report["verification"]["top1_agreement"] > 0.5


# --- failures leave nothing ---------------------------------------------------------------------


def test_failed_verification_leaves_no_file(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setitem(gx.TOLERANCES, "f32", {"mean_kl": -1.0, "top1": 1.0})
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(GGUFVerificationError):
        export_gguf(tiny_models("llama"), out, qtype="f32")
    # Nothing is left, not even the folder the export made for its output (fsutil.output_lock)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "out").mkdir()  # a folder that was there stays, empty
    with pytest.raises(GGUFVerificationError):
        export_gguf(tiny_models("llama"), out, qtype="f32")
    assert list((tmp_path / "out").iterdir()) == []


def test_refusals(tiny_models, tmp_path):
    with pytest.raises(UnsupportedArchitectureError):
        export_gguf(tiny_models("gemma2"), tmp_path / "g.gguf", verify=False)
    with pytest.raises(GGUFExportError, match="unknown GGUF type"):
        export_gguf(tiny_models("llama"), tmp_path / "x.gguf", qtype="q7_z")
    with pytest.raises(GGUFExportError, match="neither"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "exists.gguf").write_bytes(b"x")
    with pytest.raises(OutputExistsError):
        export_gguf(tiny_models("llama"), tmp_path / "exists.gguf")
    assert (tmp_path / "exists.gguf").read_bytes() == b"x"


def test_pre_tokenizer_names():
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}}) == ("gpt-2", True)
    smollm = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                   {"type": "ByteLevel", "use_regex": True}]}
    assert pre_tokenizer_name({"pre_tokenizer": smollm}) == ("smollm", True)
    qwen = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": gv._QWEN2_REGEX}},
                                                 {"type": "ByteLevel", "use_regex": False}]}
    assert pre_tokenizer_name({"pre_tokenizer": qwen}) == ("qwen2", True)
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Whitespace"}}) == ("default", False)


def test_no_warning_when_codes_fit(artifacts, tmp_path):
    art_dir = artifacts("qwen2", "rtn", bits=8, group_size=-1, symmetric=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = export_gguf(art_dir, tmp_path / "m.gguf", verify=False)
    assert report["verification"] is None and report["qtype"] == "q8_0"


def test_sentencepiece_tokenizer_and_chat_template(tmp_path):
    """A Llama-2-style SentencePiece BPE (byte fallback) becomes llama.cpp's "llama" tokenizer."""
    import io

    import sentencepiece as spm
    from tiny import TEXT, tiny_model
    from transformers import AutoTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 4), model_writer=buf, vocab_size=384,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    # A folder holding the SentencePiece model, read as a Llama tokenizer (transformers 5 builds it from
    # tokenizer.model this way; its LlamaTokenizerFast(vocab_file=...) no longer reads the file).
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    (sp_dir / "tokenizer.model").write_bytes(buf.getvalue())
    (sp_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True, "add_eos_token": False}))
    tok = AutoTokenizer.from_pretrained(sp_dir)
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    src = tmp_path / "sp-llama"
    tiny_model("llama").save_pretrained(src)
    tok.save_pretrained(src)
    shutil.rmtree(sp_dir)
    report = export_gguf(src, tmp_path / "m.gguf", qtype="f32")
    assert report["tokenizer"]["model"] == "llama" and report["tokenizer"]["chat_template"]
    assert report["verification"]["tokenizer_agrees"] and report["verification"]["mean_kl"] < 1e-5
    _, fields, _ = read(tmp_path / "m.gguf")
    assert fields["tokenizer.chat_template"] == tok.chat_template
    assert fields["tokenizer.ggml.bos_token_id"] == 1 and fields["tokenizer.ggml.add_bos_token"] is True


def test_pruned_artifact_is_written_dense(artifacts, tmp_path):
    art_dir = artifacts("qwen2", "wanda", bits=None, sparsity="2:4")
    report = export_gguf(art_dir, tmp_path / "m.gguf")  # auto: no codes -> f16
    info = report["tensors"]["blk.0.ffn_up.weight"]
    assert report["qtype"] == "f16" and info["type"] == "F16" and info["sparsity"] == 0.5
    _, _, tensors = read(tmp_path / "m.gguf")
    t = tensors["blk.0.ffn_up.weight"]
    dense = np.asarray(t.data).reshape(128, 64)
    assert (dense.reshape(128, 16, 4) == 0).sum(-1).min() >= 2  # the zeros are there, stored densely
    assert report["verification"]["mean_kl"] < 1e-4


def test_pruned_artifact_quantized_by_llamacpp_when_asked(artifacts, tmp_path):
    art_dir = artifacts("qwen2", "wanda", bits=None, sparsity="2:4")
    report = export_gguf(art_dir, tmp_path / "m.gguf", qtype="q8_0")
    assert report["tensors"]["blk.0.ffn_up.weight"]["type"] == "Q8_0" and report["requantized_by_llamacpp"] > 0
    # No calibrated grid was lost (no warning); the user is told sparsity buys nothing in llama.cpp.
    assert report["notes"] == ["pruned weights are written dense with their zeros: llama.cpp gains no speed (and no "
                               "size) from unstructured sparsity"]


def test_llama3_rope_scaling_writes_rope_freqs(tmp_path):
    from tiny import tiny_config, tiny_tokenizer

    cfg = tiny_config("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64})  # short: most frequencies scaled
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) * 0.5 + 0.75) if "norm" in name else p.normal_(0, 0.08)
    src = tmp_path / "llama3"
    model.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    report = export_gguf(src, tmp_path / "m.gguf", qtype="f32")  # without rope_freqs: mean KL ~2e-2
    assert report["tensors"]["rope_freqs.weight"]["shape"] == [8]
    assert report["verification"]["mean_kl"] < 1e-5


def test_gguf_round_trip_keeps_the_base_files_tokenizer(tiny_models, calib_file, tmp_path):
    """Our GGUF -> slmedge compress (transformers' import, checked by llama.cpp) -> GGUF again: the
    tokenizer metadata is copied from the base GGUF file rather than rebuilt from transformers' import."""
    base = tmp_path / "tiny.gguf"
    export_gguf(tiny_models("llama"), base, qtype="f32")
    compress(str(base), small_recipe(calib_file, method="rtn", bits=4, symmetric=True), tmp_path / "a", device="cpu")
    report = export_gguf(tmp_path / "a", tmp_path / "again.gguf")
    assert report["tokenizer"]["source"] == "gguf:tiny.gguf" and report["qtype"] == "q4_0" and report["exact"]
    assert report["verification"]["tokenizer_agrees"] and report["verification"]["mean_kl"] < 0.01
    _, before, _ = read(base)
    _, after, _ = read(tmp_path / "again.gguf")
    assert {k: v for k, v in before.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in after.items() if k.startswith("tokenizer.")}


def _tokenizer_with(pre_tokenizer):
    from tiny import TEXT, VOCAB
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Merges learnt under GPT-2's split (digits, spaces and newlines merge freely), then the
    # pre-tokenizer under test: a wrong llama.cpp name then produces merges transformers cannot.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    extra = ["In 1969, 12345 people said: I'll go!", "Don't   stop\n\n  3.14159 1969 1969 123 123"]
    tok.train_from_iterator(TEXT * 4 + extra * 8, trainer)
    tok.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "smollm"])
def test_known_pre_tokenizers_tokenize_like_transformers_in_llamacpp(pre, tmp_path, monkeypatch):
    from tiny import tiny_model
    from tokenizers import Regex, pre_tokenizers

    def split(regex):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    pt = {"gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
          "qwen2": lambda: split(gv._QWEN2_REGEX), "llama-bpe": lambda: split(gv._LLAMA3_REGEX),
          "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])}[pre]()
    src = tmp_path / "m"
    # A llama model: transformers 5 reads a qwen2 model's tokenizer as its own Qwen2Tokenizer, whatever
    # pre-tokenizer tokenizer.json holds (tests/tiny.py); a llama model's is read as the file says.
    tiny_model("llama").save_pretrained(src)
    _tokenizer_with(pt).save_pretrained(src)
    probe = "In 1969, 12345 people said: I'll go!\n\n  Don't   stop 3.14159 naïve café 東京 🙂 ok"
    report = export_gguf(src, tmp_path / "m.gguf", qtype="f32", probe=probe)
    assert report["tokenizer"]["pre"] == pre and report["tokenizer"]["pre_recognised"]
    assert report["verification"]["tokenizer_agrees"]
    # Every other known name tokenizes the probe differently: the check above can tell them apart.
    wrong = next(name for name in ("gpt-2", "qwen2", "smollm") if name != pre)
    for key, name in list(gv.PRE_TOKENIZERS.items()):
        if name == pre:
            monkeypatch.setitem(gv.PRE_TOKENIZERS, key, wrong)
    with pytest.raises(GGUFVerificationError, match="tokenizes"):
        export_gguf(src, tmp_path / "wrong.gguf", qtype="f32", probe=probe)
    assert not (tmp_path / "wrong.gguf").exists()


# --- streaming: one tensor in memory at a time ---------------------------------------------------


def test_each_tensor_is_written_before_the_next_is_read_and_codes_come_one_linear_at_a_time(artifacts, tmp_path,
                                                                                             monkeypatch):
    """The writer lays out the tensor table first, then writes each tensor's data as soon as it is built:
    reads of the source and writes of the file alternate, GGUFWriter.add_tensor (which keeps every
    tensor until the end) is never used, and the artifact's codes are read one linear at a time."""
    from slmedge.export import source as es

    art_dir = artifacts("llama", "awq", bits=4, group_size=32, symmetric=False)  # Q4_1 kept + a requantized head
    events, layer_reads = [], []
    real_iter, real_write, real_layers = es.iter_weights, gguf.GGUFWriter.write_tensor_data, Artifact.layers

    def iter_weights(path, names=None):
        for name, w in real_iter(path, names):
            events.append("read")
            yield name, w

    def write_tensor_data(self, tensor, *a, **k):
        events.append("write")
        return real_write(self, tensor, *a, **k)

    def layers(self):
        layer_reads.append(len(self.manifest["layers"]))
        return real_layers(self)

    def add_tensor(*a, **k):
        raise AssertionError("GGUFWriter.add_tensor keeps every tensor in memory until the file is written")

    monkeypatch.setattr(gx, "iter_weights", iter_weights)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write_tensor_data)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    monkeypatch.setattr(Artifact, "layers", layers)
    out = tmp_path / "m.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = export_gguf(art_dir, out, verify=False)
    assert report["qtype"] == "q4_1" and report["codes_kept"] == 14 and report["requantized_by_llamacpp"] == 1
    reads = events.count("read")
    assert reads == len(read(out)[2]) and events.count("write") == reads  # llama: no extras, tied head skipped
    assert all(events[i:i + 2] == ["read", "write"] for i in range(0, len(events), 2)), events[:10]
    assert layer_reads and max(layer_reads) == 1  # never the whole model's codes at once
    # the file is the one a whole-in-memory writer gives: the tensor table matches the data written
    reader, _, tensors = read(out)
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1


def test_requantized_file_whose_placed_codes_changed_is_refused(artifacts, tmp_path, monkeypatch):
    """check_requantized compares the placed code blocks of the stage file and of llama.cpp's output
    (plain reads at the offsets they were written to): a changed byte there is refused."""
    art_dir = artifacts("llama", "awq", bits=4, group_size=32, symmetric=False)
    real = gx.llamacpp_quantize

    def quantize_and_flip(src, dst, qtype, n_threads=None, **kw):
        real(src, dst, qtype, n_threads, **kw)
        t = next(t for t in gguf.GGUFReader(str(dst)).tensors if t.name == "blk.1.ffn_down.weight")
        with open(dst, "r+b") as f:
            f.seek(int(t.data_offset) + int(t.n_bytes) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))

    monkeypatch.setattr(gx, "llamacpp_quantize", quantize_and_flip)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(GGUFExportError, match="changed the placed codes of blk.1.ffn_down.weight"):
            export_gguf(art_dir, tmp_path / "m.gguf", verify=False)
    assert not (tmp_path / "m.gguf").exists()


CHILD_EXPORT = """
import json, sys, warnings
warnings.simplefilter("ignore")
from slmedge.export.gguf import export_gguf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

# A tiny model's export first: every module the export imports, and every lazy initialisation, is done
# before the baseline; then the peak is reset (clear_refs 5) and measured over the real export alone.
export_gguf(sys.argv[4], sys.argv[2] + ".warm.gguf", sys.argv[3], verify=False)
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
report = export_gguf(sys.argv[1], sys.argv[2], sys.argv[3], verify=False)
print(json.dumps({"before": before, "hwm": status("VmHWM:"), "bytes": report["bytes"]}))
"""


@pytest.mark.parametrize("qtype", ["f16", "f32"])
def test_gguf_export_peak_memory_is_one_tensor_not_the_model(qtype, tiny_models, tmp_path):
    """VmHWM of a child process exporting a ~170M-parameter bf16 model (690 MB in fp32, 345 MB as f16):
    it grows by a few copies of the largest tensor and a fixed allowance, not by the model; a writer
    that holds every tensor until the end (GGUFWriter.add_tensor) exceeds the bound (measured here:
    +465 MB for f16, +727 MB for f32, against +82 and +88 MB streamed)."""
    import subprocess
    import sys

    from test_streamed import write_random_model
    from tiny import tiny_tokenizer

    folder = tmp_path / "m"
    sizes = write_random_model(folder)
    tiny_tokenizer().save_pretrained(folder)
    largest = 8192 * 1024 * 4  # the embedding (and the untied head), fp32
    allowance = 100 * 2**20  # the tokenizer's metadata, allocator slack
    bound = 3 * largest + allowance
    f16_model = sum(sizes.values()) // 2
    assert bound < 0.7 * f16_model  # the whole model as f16 alone would exceed it
    out = subprocess.run([sys.executable, "-c", CHILD_EXPORT, str(folder), str(tmp_path / "m.gguf"), qtype,
                          str(tiny_models("llama"))], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grew = m["hwm"] - m["before"]
    assert m["bytes"] > f16_model
    assert grew < bound, f"peak grew {grew / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB (f16 model {f16_model / 2**20:.0f} MiB)"


# --- Phi-3.5's LongRoPE ---------------------------------------------------------------------------


def _phi3_longrope(tiny_models, folder, original, maximum, seed=0, **scaling):
    """The tiny phi3 with a LongRoPE rope_scaling (head_dim 16: 8 factors each, all far from 1.0)."""
    shutil.copytree(tiny_models("phi3"), folder)
    rng = np.random.default_rng(seed)
    config = json.loads((folder / "config.json").read_text())
    config.update(original_max_position_embeddings=original, max_position_embeddings=maximum)
    config["rope_scaling"] = {"type": "longrope", "short_factor": rng.uniform(1.5, 4.0, 8).round(4).tolist(),
                              "long_factor": rng.uniform(4.0, 16.0, 8).round(4).tolist(), **scaling}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config["rope_scaling"]


@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_phi3_longrope_writes_the_long_and_short_factors_and_llamacpp_matches_torch(qtype, tiny_models, tmp_path,
                                                                                  monkeypatch):
    """Phi-3.5-mini's rope_scaling (longrope; 4096 -> 131072) as convert_hf_to_gguf.py's Phi3MiniModel writes it.
    The probe (~135 tokens) is shorter than the original context (512): transformers uses the short factors
    (it switches by the sequence's length), and so does llama.cpp, whose verification context (the probe
    plus a little, at least 64) is within the original one (it switches by its n_ctx)."""
    src, scaling = _phi3_longrope(tiny_models, tmp_path / "src", original=512, maximum=2048)
    report = export_gguf(src, tmp_path / "m.gguf", qtype=qtype)
    v = report["verification"]
    tol = 1e-5 if qtype == "f32" else 1e-4
    assert v["tokenizer_agrees"] and v["mean_kl"] < tol and v["top1_agreement"] > 0.97
    _, fields, tensors = read(tmp_path / "m.gguf")
    assert fields["phi3.context_length"] == 2048 and fields["phi3.rope.scaling.original_context_length"] == 512
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(np.sqrt(1 + np.log(4) / np.log(512)), rel=1e-6)
    for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32 and report["tensors"][name]["shape"] == [8]
        assert np.array_equal(np.asarray(tensors[name].data), np.asarray(scaling[key], dtype=np.float32)), name
    # The check above can fail: the same file with the factors written as 1.0 (the factors ignored), or
    # without the attention factor, gives llama.cpp logits that are refused against torch's.
    real = gh.add_longrope

    class NoAttentionFactor:
        def __init__(self, writer):
            self.writer = writer

        def __getattr__(self, name):
            return getattr(self.writer, name)

        def add_rope_scaling_attn_factors(self, value):
            self.writer.add_rope_scaling_attn_factors(1.0)

    for i, broken in enumerate((lambda w, c, s: [(n, np.ones_like(a)) for n, a in real(w, c, s)],
                                lambda w, c, s: real(NoAttentionFactor(w), c, s))):
        monkeypatch.setattr(gh, "add_longrope", broken)
        with pytest.raises(GGUFVerificationError, match="disagree"):
            export_gguf(src, tmp_path / f"broken{i}.gguf", qtype=qtype)
        assert not (tmp_path / f"broken{i}.gguf").exists()


def test_phi3_longrope_past_the_original_context_uses_the_long_factors_in_both(tiny_models, tmp_path):
    """An original context (16) shorter than the probe: transformers uses the long factors for the whole
    sequence, and llama.cpp, its n_ctx past the original context, too."""
    src, _ = _phi3_longrope(tiny_models, tmp_path / "src", original=16, maximum=2048)
    report = export_gguf(src, tmp_path / "m.gguf", qtype="f32")
    assert report["verification"]["mean_kl"] < 1e-5


def test_phi3_longrope_refuses_what_llamacpp_would_compute_differently(tiny_models, tmp_path):
    from types import SimpleNamespace

    class Writer:
        def __init__(self):
            self.calls = {}

        def __getattr__(self, name):
            return lambda *a, **k: self.calls.__setitem__(name, a)

    def config(**over):
        scaling = {"type": "longrope", "short_factor": [1.5] * 8, "long_factor": [4.0] * 8}
        scaling.update(over.pop("scaling", {}))
        base = dict(model_type="phi3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=None,
                    num_hidden_layers=2, intermediate_size=128, vocab_size=384, rms_norm_eps=1e-5,
                    max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
                    partial_rotary_factor=None, sliding_window=None, rope_scaling=scaling, rope_parameters=None)
        base.update(over)
        return SimpleNamespace(**base)

    from slmedge.models.architectures import ARCHITECTURES
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    arch = ARCHITECTURES["phi3"]
    # Phi-3.5-mini's context (4096 -> 131072) on transformers' own config: its attention factor is written.
    hf = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                    intermediate_size=128, vocab_size=384, max_position_embeddings=131072,
                    original_max_position_embeddings=4096, rope_scaling=config().rope_scaling)
    writer = Writer()
    extra = dict(gh.add_hparams(writer, hf, arch, gguf.LlamaFileType.ALL_F32))
    assert sorted(extra) == ["rope_factors_long.weight", "rope_factors_short.weight"]
    assert writer.calls["add_context_length"] == (131072,) and writer.calls["add_rope_scaling_orig_ctx_len"] == (4096,)
    hf_factor = _compute_longrope_parameters(hf, "cpu")[1]
    assert writer.calls["add_rope_scaling_attn_factors"][0] == pytest.approx(hf_factor) == pytest.approx(1.19023807)
    # With a rope_scaling.factor transformers takes that for the scale (sqrt(1 + ln 2 / ln 4096) = 1.0408), where
    # llama.cpp takes max_position_embeddings / original (32: 1.1902): refused, not written to compute otherwise.
    hf = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                    intermediate_size=128, vocab_size=384, max_position_embeddings=131072,
                    original_max_position_embeddings=4096, rope_scaling={**config().rope_scaling, "factor": 2.0})
    assert _compute_longrope_parameters(hf, "cpu")[1] == pytest.approx(1.04083300)
    with pytest.raises(GGUFExportError, match="transformers scales this model's rotary embedding by 1.04083"):
        gh.add_hparams(Writer(), hf, arch, gguf.LlamaFileType.ALL_F32)
    # An explicit attention_factor is what transformers applies: llama.cpp gets that value.
    writer = Writer()
    gh.add_hparams(writer, config(scaling={"attention_factor": 1.25}), arch, gguf.LlamaFileType.ALL_F32)
    assert writer.calls["add_rope_scaling_attn_factors"] == (1.25,)
    # No scaling past the original context: attention factor 1.
    writer = Writer()
    gh.add_hparams(writer, config(max_position_embeddings=4096), arch, gguf.LlamaFileType.ALL_F32)
    assert writer.calls["add_rope_scaling_attn_factors"] == (1.0,)
    for over, words in ((dict(scaling={"short_factor": [1.5] * 7}), r"short_factor must be 8 numbers"),
                        (dict(scaling={"long_factor": [4.0] * 16}), r"long_factor must be 8 numbers"),
                        (dict(partial_rotary_factor=0.5), r"must be 4 numbers \(rotary dimensions 8"),
                        (dict(scaling={"long_factor": None}), "no long_factor"),
                        (dict(scaling={"short_factor": [1.5] * 7 + [0.0]}), "positive"),
                        (dict(original_max_position_embeddings=None), "original_max_position_embeddings"),
                        (dict(scaling={"original_max_position_embeddings": 8192}), "differs")):
        with pytest.raises(GGUFExportError, match=words):
            gh.add_hparams(Writer(), config(**over), arch, gguf.LlamaFileType.ALL_F32)
    # From a folder: transformers' Phi3Config already refuses a wrong-length list, and nothing is written.
    bad, scaling = _phi3_longrope(tiny_models, tmp_path / "bad", original=512, maximum=2048)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_scaling"]["short_factor"] = scaling["short_factor"][:7]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GGUFExportError, match="short_factor"):
        export_gguf(bad, tmp_path / "bad.gguf", qtype="f32", verify=False)
    assert not (tmp_path / "bad.gguf").exists()
