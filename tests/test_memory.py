"""Peak memory of ``compress``: the model is never whole in fp32 (issue 17).

A random llama of ~103M parameters in bf16 (built here: 32 blocks of width 512, the tiny tokenizer,
so nearly every parameter sits in the blocks), compressed in a child process that reports its own
high-water mark (VmHWM). The budget over the child's resident size before the call (taken after a
warm-up run on a tiny model, so that imports and lazily loaded modules are in that baseline):

    bf16 size of the model + one block in fp32 + the tensors outside the blocks in fp32
    + the calibration activations x 3 (the inputs, a block's outputs, statistics' temporaries)
    + the true-sequential short-cuts' records (GPTQ: the inputs of o_proj, the MLP and down_proj)
    + ALLOWANCE

ALLOWANCE (192 MiB) is the fixed part: the artifact's compact tensors, held until they are written
(4-bit codes and scales: ~55 MB here), the method's working set on one linear (GPTQ's Hessian, its
Cholesky factor and inverse, the factor cached for the linears sharing a Hessian, the column loop's
rows: 8 MB each at 1408 columns), allocator slack. Measured on this machine (quiet, at the commit
that set 192 MiB): RTN 313 MiB and GPTQ 359 MiB over the baseline against a budget of 406 MiB. The
model in fp32 is 2 bytes per parameter more than in bf16 (196 MiB here): a version that casts the
whole model, or keeps each layer's dense fp32 result, exceeds the budget, as the control
(``write=False``, which keeps the compressed model whole in fp32 on purpose: 591 MiB) shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import calib_text, save_tiny, tiny_tokenizer  # noqa: E402

ALLOWANCE = 192 * 2**20
HIDDEN, INTERMEDIATE, LAYERS = 512, 1408, 32
NSAMPLES, SEQLEN = 4, 128

CHILD = r"""
import json, sys
from pathlib import Path

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

from slmedge.compress.api import compress
from slmedge.compress.recipe import Recipe

args = json.loads(sys.argv[1])
def recipe():
    return Recipe(method=args["method"], bits=4, group_size=128, calibration=args["calib"],
                  nsamples=args["nsamples"], seqlen=args["seqlen"], batch_size=4)
# Warm-up on a tiny model: every module compress imports is loaded before the baseline.
compress(args["tiny"], recipe(), Path(args["out"]) / "warm", device="cpu", write=args["write"])
base = status("VmRSS")
warm_peak = status("VmHWM")
compress(args["model"], recipe(), Path(args["out"]) / "art", device="cpu", write=args["write"])
print(json.dumps({"base": base, "warm_peak": warm_peak, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def model_100m(tmp_path_factory):
    """A random bf16 llama with ~103M parameters, nearly all in its 32 blocks (vocabulary 384)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("m100")
    config = LlamaConfig(vocab_size=384, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    model.save_pretrained(root / "model", safe_serialization=True)
    tiny_tokenizer().save_pretrained(root / "model")
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    outside = params - LAYERS * block
    del model
    return {"path": root / "model", "params": params, "block": block, "outside": outside,
            "tiny": save_tiny("llama", root / "tiny"), "calib": calib_text(root / "calib.txt", repeats=400)}


def _peak(model_100m, tmp_path, method: str, write: bool = True) -> dict:
    args = {"method": method, "model": str(model_100m["path"]), "tiny": str(model_100m["tiny"]),
            "calib": str(model_100m["calib"]), "out": str(tmp_path), "write": write,
            "nsamples": NSAMPLES, "seqlen": SEQLEN}
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _budget(m: dict) -> int:
    activations = NSAMPLES * SEQLEN * HIDDEN * 4 * 3
    activations += NSAMPLES * SEQLEN * (HIDDEN + HIDDEN + INTERMEDIATE) * 4  # compress.shortcuts.plan_bytes
    return 2 * m["params"] + 4 * m["block"] + 4 * m["outside"] + activations + ALLOWANCE


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_compress_peak_is_the_bf16_model_plus_one_block_in_fp32(method, model_100m, tmp_path):
    assert 95e6 < model_100m["params"] < 110e6
    got = _peak(model_100m, tmp_path, method)
    used = got["peak"] - got["base"]
    budget = _budget(model_100m)
    mib = 2**20
    print(f"{method}: {used / mib:.0f} MiB over the baseline, budget {budget / mib:.0f} MiB")
    assert used <= budget, (f"{method}: peak {used / mib:.0f} MiB over the baseline, budget {budget / mib:.0f} MiB "
                            f"(bf16 model {2 * model_100m['params'] / mib:.0f} MiB, fp32 block "
                            f"{4 * model_100m['block'] / mib:.0f} MiB)")
    # The artifact holds what it should: the compact layout, about the codes' size plus the rest.
    manifest = json.loads((tmp_path / "art" / "slmedge.json").read_text())
    assert manifest["format_version"] == 2
    weights = sum(f["bytes"] for f in manifest["files"].values())
    assert weights < 0.4 * 2 * model_100m["params"]


def test_the_budget_catches_a_model_whole_in_fp32(model_100m, tmp_path):
    """The control: ``write=False`` keeps the compressed model whole in fp32 (and every layer's
    dense result), what the writing path must never do; it must exceed the same budget."""
    got = _peak(model_100m, tmp_path, "rtn", write=False)
    print(f"whole in fp32: {(got['peak'] - got['base']) / 2**20:.0f} MiB over the baseline")
    assert got["peak"] - got["base"] > _budget(model_100m)


def test_a_block_is_computed_in_memory_of_its_own(tmp_path):
    # A source loaded from safetensors is memory-mapped: writing into its pages (RTN rounds in
    # place, every method writes its result back) costs a copy-on-write fault per page. The
    # engine computes each block in a copy when moving it to fp32 left its tensors where they were.
    from slmedge.compress.engine import _to_compute
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    layer.register_buffer("fp32_buf", torch.ones(3))
    layer.register_buffer("ids", torch.arange(3))
    before = {n: t.data_ptr() for n, t in list(layer.named_parameters()) + list(layer.named_buffers())}
    values = {n: t.clone() for n, t in layer.state_dict().items()}
    _to_compute(layer, torch.device("cpu"))
    after = {n: t.data_ptr() for n, t in list(layer.named_parameters()) + list(layer.named_buffers())}
    assert all(after[n] != before[n] for n in before if n != "ids")
    assert after["ids"] == before["ids"]  # integer buffers are not the block's arithmetic
    assert all(torch.equal(layer.state_dict()[n], v) and layer.state_dict()[n].dtype == (torch.int64 if n == "ids" else torch.float32)
               for n, v in values.items())
    bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    _to_compute(bf16, torch.device("cpu"))
    assert bf16.weight.dtype == torch.float32


def _mapped_resident(name: str) -> int:
    """Bytes of ``name`` (a file) resident in this process's mappings of it (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="utf-8", errors="replace"):
        fields = line.split()
        if "-" in fields[0] and len(fields[0]) > 8 and fields[0][0] in "0123456789abcdef" and ":" not in fields[0]:
            inside = len(fields) >= 6 and fields[-1].endswith(name)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_a_blocks_source_pages_are_handed_back_once_read(tmp_path):
    """transformers 5 memory-maps the source's safetensors file, one mapping for the whole file: the
    pages of every block read stayed resident until the last block was done (Qwen2.5-0.5B, RTN W4:
    peak RSS 2.80 GB, 2.08 GB with this). The engine hands a block's pages back once it is read in
    fp32 (``_page_out``): they leave this process's resident set, and the tensors still read the
    same values (a page touched again is read again from the file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slmedge.compress.engine import _file_mappings, _page_out, _source_ranges
    from slmedge.models.source import SOURCE_DTYPE, load

    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m", safe_serialization=True)
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    fd = os.open(tmp_path / "m" / "model.safetensors", os.O_RDONLY)
    os.fsync(fd)  # pages just written are dirty: the kernel reclaims a file's page only once it is on disk
    os.close(fd)
    model = load(str(tmp_path / "m"), dtype=SOURCE_DTYPE).model
    block = model.model.layers[0]
    ranges = _source_ranges(block)
    assert _file_mappings(), "the source is memory-mapped (else there is nothing to hand back)"
    values = {k: v.clone() for k, v in block.state_dict().items()}  # reads every page of the block
    read = _mapped_resident("model.safetensors")
    block_bytes = sum(n for _, n in ranges)
    assert read >= block_bytes
    _page_out(ranges)
    assert read - _mapped_resident("model.safetensors") > 0.9 * block_bytes
    assert all(torch.equal(block.state_dict()[k], v) for k, v in values.items())


def test_handing_pages_back_changes_no_byte_of_the_artifact(tmp_path, monkeypatch):
    from slmedge.compress import engine
    from slmedge.compress.api import compress
    from slmedge.compress.recipe import Recipe

    src = save_tiny("llama", tmp_path / "m")
    files = {}
    for label in ("with", "without"):
        if label == "without":
            monkeypatch.setattr(engine, "_page_out", lambda ranges: None)
        compress(str(src), Recipe(method="rtn", bits=4, group_size=32), tmp_path / label, device="cpu")
        manifest = json.loads((tmp_path / label / "slmedge.json").read_text())
        files[label] = {k: v["sha256"] for k, v in manifest["files"].items()}
    assert files["with"] == files["without"]
