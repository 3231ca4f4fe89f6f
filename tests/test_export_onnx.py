"""ONNX export on tiny models: onnxruntime runs what we write, and the artifact's codes arrive as they are."""

import errno
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from transformers import AutoModelForCausalLM

from slmedge.compress.artifact import Artifact
from slmedge.compress.quant import QuantSpec
from slmedge.errors import ArtifactError, SlmedgeError, UnsupportedArchitectureError
from slmedge.export import onnx as ox
from slmedge.export.onnx import ONNXExportError, ONNXVerificationError, export_onnx
from slmedge.backends.ort import OnnxModelError, OrtDecoder

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TINY_TYPES, tiny_tokenizer  # noqa: E402

IDS = [1, 17, 42, 99, 5, 250, 3, 77, 123, 64, 8, 300, 12, 45]


def torch_logits(folder, ids=IDS):
    from slmedge.export.verify import torch_model  # an HF folder, or an artifact's rebuilt model

    model = torch_model(Path(folder), torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()




def decode_matmulnbits(model, node_name_prefix: str) -> np.ndarray:
    """Independent decoder of a MatMulNBits node: (N, K) weights from B, scales and zero points."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.name.startswith(node_name_prefix))
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    k, n, bits, bs = a["K"], a["N"], a["bits"], a["block_size"]
    b = inits[node.input[1]].reshape(n, -1)
    if bits == 4:
        q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, -1).astype(np.float32)
    else:
        q = b.astype(np.float32)
    nb = q.shape[1] // bs
    scales = inits[node.input[2]].reshape(n, nb)
    if len(node.input) > 3 and node.input[3]:
        zp = inits[node.input[3]].reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :nb]
        zp = zp.astype(np.float32)
    else:
        zp = np.full((n, nb), 2 ** (bits - 1), np.float32)
    w = (q.reshape(n, nb, bs) - zp[:, :, None]) * scales[:, :, None]
    return w.reshape(n, nb * bs)[:, :k]


# --- fp32 / fp16: every architecture ----------------------------------------------------------------


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_fp32_onnx_gives_torch_logits_for_every_architecture(model_type, tiny_models, tmp_path):
    src = tiny_models(model_type)
    report = export_onnx(src, tmp_path / "onnx", "fp32")
    assert report["type"] == "fp32" and report["verification"]["mean_kl"] < 1e-7  # float rounding (gemma2: 4.7e-8)
    dec = OrtDecoder(tmp_path / "onnx")
    ref = torch_logits(src)
    assert np.abs(dec.logits(IDS) - ref).max() < 1e-4
    # The KV cache: prefill 5 tokens, then one token at a time.
    assert np.abs(dec.incremental_logits(IDS, 5) - ref).max() < 1e-4
    assert dec.num_layers == 2
    manifest = json.loads((tmp_path / "onnx" / "slmedge-export.json").read_text())
    assert manifest["files"]["model.onnx"]["bytes"] == (tmp_path / "onnx" / "model.onnx").stat().st_size
    assert (tmp_path / "onnx" / "tokenizer.json").is_file() and (tmp_path / "onnx" / "config.json").is_file()


def test_greedy_decoding_through_the_kv_cache_generates_what_torch_generates(tiny_models, tmp_path):
    """The export's KV cache path, step by step as a generation loop uses it, picks torch's tokens."""
    src = tiny_models("qwen2")
    export_onnx(src, tmp_path / "onnx", "fp32")
    ids = torch.tensor([IDS[:6]])
    torch_model = AutoModelForCausalLM.from_pretrained(src).eval()
    want = torch_model.generate(ids, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(ids))[0].tolist()
    dec = OrtDecoder(tmp_path / "onnx")
    seq = list(IDS[:6])
    logits, past = dec.run(np.asarray([seq]))
    for _ in range(10):
        seq.append(int(logits[0, -1].argmax()))
        logits, past = dec.run(np.asarray([[seq[-1]]]), past, past_len=len(seq) - 1)
    assert seq == want


def test_fp16(tiny_models, tmp_path):
    report = export_onnx(tiny_models("llama"), tmp_path / "onnx", "fp16")
    v = report["verification"]
    assert v["mean_kl"] < 1e-4 and v["top1_agreement"] > 0.95
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    assert any(i.data_type == onnx.TensorProto.FLOAT16 and len(i.dims) == 2 for i in model.graph.initializer)


# --- codes -> MatMulNBits ---------------------------------------------------------------------------


CODE_CASES = [
    ("llama", "gptq", dict(bits=4, group_size=32, symmetric=True), 4, False),
    ("llama", "awq", dict(bits=4, group_size=32, symmetric=False), 4, True),
    ("qwen3", "awq", dict(bits=4, group_size=64, symmetric=False), 4, True),
    ("phi3", "gptq", dict(bits=4, group_size=32, symmetric=True), 4, False),
    ("gemma3_text", "gptq", dict(bits=4, group_size=32, symmetric=False), 4, True),
    ("mistral", "rtn", dict(bits=8, group_size=32, symmetric=True), 8, False),
    ("qwen2", "gptq", dict(bits=3, group_size=32, symmetric=True), 4, True),  # 3-bit codes, explicit zero points
]


@pytest.mark.parametrize("model_type,method,kw,bits,zero_points", CODE_CASES,
                         ids=[f"{c[0]}-{c[1]}-w{c[2]['bits']}" for c in CODE_CASES])
def test_artifact_codes_become_matmulnbits_unchanged(model_type, method, kw, bits, zero_points, artifacts, tmp_path):
    art_dir = artifacts(model_type, method, **kw)
    # auto: the type that keeps the codes; accuracy level 0: fp32 compute, so logits compare tightly
    report = export_onnx(art_dir, tmp_path / "onnx", accuracy_level=0)
    layers = Artifact.open(art_dir).layers()
    assert report["type"] == ("int4" if bits == 4 else "int8") and report["exact"]
    assert report["codes_kept"] == len(layers)
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    torch_model = Artifact.open(art_dir).load_model()
    for name, res in layers.items():
        prefix = "/" + name.replace(".", "/") + "/MatMul"
        prefix = prefix.replace("/layers/", "/layers.")
        decoded = decode_matmulnbits(model, prefix)
        weight = torch_model.get_submodule(name).weight.data.numpy()
        assert np.array_equal(decoded, weight), name  # exactly the artifact's dequantized weights
        assert report["layers"][name]["zero_points"] == zero_points
        assert report["layers"][name]["block_size"] == res.spec.group_width(weight.shape[1])
    # Logits: close to the dequantized torch model (the head is 8-bit, the embedding fp16).
    ref = torch_logits(art_dir)
    got = OrtDecoder(tmp_path / "onnx").logits(IDS)
    from slmedge.models.gguf_check import compare_logits

    stats = compare_logits(ref, got)
    assert stats["mean_kl"] < 1e-3 and stats["top1_agreement"] > 0.9
    # The same file with everything else left fp32 is exact up to float error.
    export_onnx(art_dir, tmp_path / "exact", keep_fp32_head=True, accuracy_level=0)
    assert np.abs(OrtDecoder(tmp_path / "exact").logits(IDS) - ref).max() < 1e-3


def test_default_accuracy_level_quantizes_activations_and_still_verifies(artifacts, tmp_path):
    art_dir = artifacts("llama", "awq", bits=4, group_size=32, symmetric=False)
    report = export_onnx(art_dir, tmp_path / "onnx")
    assert report["accuracy_level"] == 4 and report["verification"]["mean_kl"] < 0.02
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    levels = {helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}


def test_ragged_last_group_is_padded_with_its_zero_point(tiny_models, calib_file, artifacts, tmp_path):
    from transformers import LlamaConfig

    # 96 input columns with group 64: one full group and a ragged one of 32.
    cfg = LlamaConfig(vocab_size=384, hidden_size=96, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg)
    src = tmp_path / "ragged"
    m.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    art = artifacts("llama", "awq", source=src, bits=4, group_size=64, symmetric=False)
    report = export_onnx(art, tmp_path / "onnx")
    assert report["exact"]
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    weight = Artifact.open(art).load_model().model.layers[0].self_attn.q_proj.weight.data.numpy()
    assert np.array_equal(decode_matmulnbits(model, "/model/layers.0/self_attn/q_proj/MatMul"), weight)


def test_uncompressed_int4_and_int8_use_onnxruntimes_quantizer(tiny_models, tmp_path):
    src = tiny_models("llama")
    r4 = export_onnx(src, tmp_path / "int4", "int4")
    assert r4["ops"].get("MatMulNBits", 0) >= 14 and not r4["exact"] and r4["codes_kept"] == 0
    r8 = export_onnx(src, tmp_path / "int8", "int8-dynamic")
    assert r8["ops"].get("MatMulInteger", 0) >= 14 or r8["ops"].get("DynamicQuantizeMatMul", 0) >= 14
    assert r8["verification"]["mean_kl"] < 0.1


def test_per_channel_codes_of_a_non_power_of_two_width(artifacts, calib_file, tmp_path):
    # mistral's 64-wide inputs are fine per channel; exact refuses widths MatMulNBits cannot block.
    assert ox.cannot_place(QuantSpec(4, -1, True), 64) is None
    assert "power of two" in ox.cannot_place(QuantSpec(4, -1, True), 576)
    assert "power of two" in ox.cannot_place(QuantSpec(4, 48, True), 96)


def test_codes_that_do_not_fit_are_requantized_with_a_warning_or_refused_with_exact(artifacts, tmp_path, monkeypatch):
    art = artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True)
    monkeypatch.setattr(ox, "cannot_place", lambda spec, cols: "pretend it cannot")
    with pytest.raises(ONNXExportError, match="pretend it cannot"):
        export_onnx(art, tmp_path / "exact", "int4", exact=True)
    assert not (tmp_path / "exact").exists()
    with pytest.warns(UserWarning, match="calibration is not kept"):
        report = export_onnx(art, tmp_path / "requant", "int4")
    assert report["codes_kept"] == 0 and not report["exact"]


def test_exact_refuses_types_that_hold_no_codes(artifacts, tiny_models, tmp_path):
    art = artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True)
    with pytest.raises(ONNXExportError, match="cannot hold the artifact's codes"):
        export_onnx(art, tmp_path / "a", "fp16", exact=True)
    with pytest.raises(ONNXExportError, match="no codes to keep"):
        export_onnx(tiny_models("llama"), tmp_path / "b", "int4", exact=True)
    assert not list(tmp_path.iterdir())


def test_external_data_past_the_limit(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(ox, "LARGE", 1000)  # pretend the 2 GB limit is 1 KB
    report = export_onnx(tiny_models("qwen2"), tmp_path / "onnx", "fp32")
    assert (tmp_path / "onnx" / "model.onnx_data").is_file()
    assert report["verification"]["mean_kl"] < 1e-9
    assert np.abs(OrtDecoder(tmp_path / "onnx").logits(IDS) - torch_logits(tiny_models("qwen2"))).max() < 1e-4


# --- bad input ---------------------------------------------------------------------------------------


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=384)).save_pretrained(src)
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'; supported: llama, mistral, qwen2, qwen3, phi3"):
        export_onnx(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wrong_or_missing_checksum_is_refused(artifacts, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True), art)
    with open(art / "quantization.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        export_onnx(art, tmp_path / "out")
    manifest = json.loads((art / "slmedge.json").read_text())
    del manifest["files"]["weights.safetensors"]["sha256"]
    (art / "slmedge.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError):
        export_onnx(art, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_verification_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setitem(ox.TOLERANCES, "fp32", {"mean_kl": -1.0, "top1": 2.0})
    with pytest.raises(ONNXVerificationError, match="nothing was written"):
        export_onnx(tiny_models("llama"), tmp_path / "out", "fp32")
    assert not list(tmp_path.iterdir())


def test_full_disk_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", full)
    with pytest.raises(SlmedgeError, match=r"no space left on \S+/out \(needed more than [0-9.]+ MB\); nothing was "
                                           "written there"):
        export_onnx(tiny_models("llama"), tmp_path / "out", "fp32")
    assert not list(tmp_path.iterdir())
    assert not list(tmp_path.iterdir())


def test_runner_refuses_an_onnx_file_without_kv_cache(tmp_path):
    x = helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, None])
    y = helper.make_tensor_value_info("logits", onnx.TensorProto.INT64, [1, None])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(OnnxModelError, match="no KV cache"):
        OrtDecoder(tmp_path / "m.onnx")


# --- memory: the model is never whole ----------------------------------------------------------------


def test_the_traced_model_holds_no_linear_weight_and_no_full_model_is_built(artifacts, tmp_path, monkeypatch):
    """The traced model's linears are stubs (no weight); neither the artifact's nor an HF model is ever
    loaded whole for the export itself (verification aside)."""
    import transformers

    from slmedge.export import onnx_stub
    from slmedge.models import artifact_weights

    art = artifacts("qwen2", "gptq", bits=4, group_size=32, symmetric=True)
    seen = {}
    real = onnx_stub.trace_decoder

    def spy(model, *a, **k):
        params = dict(model.named_parameters())
        seen["linear_weights"] = [n for n, m in model.named_modules()
                                  if isinstance(m, torch.nn.Linear) or getattr(m, "weight", None) is not None
                                  and m.weight.dim() == 2 and m is not model.get_input_embeddings()]
        seen["numel"] = sum(p.numel() for p in params.values())
        seen["meta"] = [n for n, p in params.items() if p.is_meta]
        return real(model, *a, **k)

    def refuse(*a, **k):
        raise AssertionError("the whole model was built")

    monkeypatch.setattr(onnx_stub, "trace_decoder", spy)
    monkeypatch.setattr(artifact_weights, "load_model", refuse)
    monkeypatch.setattr(artifact_weights, "state_dict", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))
    report = export_onnx(art, tmp_path / "onnx", "int4", verify=False, accuracy_level=0)
    assert report["codes_kept"] == len(Artifact.open(art).layers()) and report["exact"]
    cfg = json.loads((art / "config.json").read_text())
    embedding = cfg["vocab_size"] * cfg["hidden_size"]
    assert seen["linear_weights"] == [] and seen["meta"] == []
    # the embedding, norms and biases only: far below one decoder layer's linears
    assert seen["numel"] < embedding + 4 * cfg["hidden_size"] * (cfg["num_hidden_layers"] + 1) * 8
    # The file is the artifact's codes all the same (the logits checked here, against torch).
    monkeypatch.undo()
    ref = torch_logits(art)
    got = OrtDecoder(tmp_path / "onnx").logits(IDS)
    from slmedge.models.gguf_check import compare_logits

    assert compare_logits(ref, got)["mean_kl"] < 1e-3


MEMORY_CHILD = r"""
import json, sys
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
import numpy, torch, onnx, onnxruntime, transformers  # noqa: E401
from slmedge.export.onnx import export_onnx
export_onnx(sys.argv[3], sys.argv[2] + "-warm", "int4", verify=False)  # lazy imports, first-use caches
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark starts again from here: imports are not the export's
base = status("VmRSS")
export_onnx(sys.argv[1], sys.argv[2], "int4", verify=False)
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


def test_int4_export_peak_memory_stays_near_the_fp32_model_size(artifacts, tmp_path):
    """In a child process (after a warm-up export of the tiny artifact, so that lazy imports are not
    counted): the int4 export's peak RSS grows by less than the model's fp32 size (measured here:
    0.90; the codes are read one linear at a time, unpacked one byte per weight and packed into the
    graph, the proto and its reloads, plus the allocator's fragments). The way before the stubs (the
    fp32 model, torch.onnx's folded copy of it, the proto and its reloads) grew by about five times
    it, and stubs made of ConstantOfShape, which torch.onnx's shape inference computed in full (every
    linear's fp32 weight held until the trace ended), by 1.15 times it."""
    import subprocess

    from transformers import LlamaConfig

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the high-water mark")
    cfg = LlamaConfig(vocab_size=384, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    src = tmp_path / "wide"
    model.save_pretrained(src)
    del model
    tiny_tokenizer().save_pretrained(src)
    art = artifacts("llama", "rtn", source=src, bits=4, group_size=32, symmetric=True)
    warm = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=True)
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(art), str(tmp_path / "onnx"), str(warm)],
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = r["peak"] - r["base"]
    print(f"the int4 export grew by {grew / 1e6:.0f} MB = {grew / fp32_bytes:.2f} x the fp32 model")
    assert grew < 1.0 * fp32_bytes, f"the export grew by {grew / 1e6:.0f} MB; the fp32 model is {fp32_bytes / 1e6:.0f} MB"
    assert OrtDecoder(tmp_path / "onnx").logits(IDS).shape == (len(IDS), 384)


def _nbits_tensors(model) -> dict[str, list[np.ndarray]]:
    """MatMulNBits node name -> its constant inputs (codes, scales, zero points), as arrays."""
    inits = {i.name: i for i in model.graph.initializer}
    return {n.name: [numpy_helper.to_array(inits[i]) for i in n.input[1:] if i in inits]
            for n in model.graph.node if n.op_type == "MatMulNBits"}


@pytest.mark.parametrize("algo", ["rtn", "k_quant", "hqq"])
def test_onnxruntimes_own_quantizers_make_the_file_an_onnxruntime_user_makes(algo, tiny_models, tmp_path):
    """``--type ort-ALGO``: onnxruntime's MatMulNBitsQuantizer with that algorithm, called as a user calls it
    (4-bit, asymmetric, block 32) on the fp32 graph: every MatMulNBits' codes, scales and zero points equal."""
    from onnxruntime.quantization import matmul_nbits_quantizer as q

    src = tiny_models("llama")
    report = export_onnx(src, tmp_path / algo, f"ort-{algo}")
    assert report["codes_kept"] == 0 and not report["exact"] and report["type"] == f"ort-{algo}"
    export_onnx(src, tmp_path / "fp32", "fp32")
    config = {"rtn": q.RTNWeightOnlyQuantConfig, "k_quant": q.KQuantWeightOnlyQuantConfig,
              "hqq": lambda: q.HQQWeightOnlyQuantConfig(block_size=32, bits=4)}[algo]()
    user = q.MatMulNBitsQuantizer(onnx.load(str(tmp_path / "fp32" / "model.onnx")), bits=4, block_size=32,
                                  is_symmetric=False, accuracy_level=4, algo_config=config)
    user.process()
    want = _nbits_tensors(user.model.model)
    got = _nbits_tensors(onnx.load(str(tmp_path / algo / "model.onnx")))
    linears = [n for n in want if "/layers." in n]
    assert len(linears) >= 14 and set(linears) <= set(got)
    for name in linears:
        assert len(got[name]) == len(want[name]) >= 3, name  # asymmetric: zero points too
        for g, w in zip(got[name], want[name]):
            assert g.dtype == w.dtype and np.array_equal(g, w), name


def test_onnxruntimes_own_quantizers_refuse_what_they_cannot_do_before_any_work(artifacts, tiny_models, tmp_path):
    with pytest.raises(ONNXExportError, match=r"block 128 does not divide 64: use --block-size 16 or 32 or 64"):
        export_onnx(tiny_models("llama"), tmp_path / "b128", "ort-k_quant", block_size=128)
    art = artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True)
    with pytest.raises(ONNXExportError, match="--exact: ort-rtn is onnxruntime's own rtn quantizer"):
        export_onnx(art, tmp_path / "exact", "ort-rtn", exact=True)
    assert not list(tmp_path.iterdir())
    with pytest.warns(UserWarning, match="the artifact's codes are not kept"):
        report = export_onnx(art, tmp_path / "requant", "ort-rtn")
    assert report["codes_kept"] == 0 and report["requantized_by_onnxruntime"] == report["ops"]["MatMulNBits"] - 1 >= 14
