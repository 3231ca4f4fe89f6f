"""The block-by-block forward pass (models.streamed): the whole fp32 model's logits, bit for bit, with one
decoder block in memory at a time, for every architecture and every kind of folder it reads."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slmedge.models.architectures import exact_attention

from conftest import small_recipe
from slmedge.compress.api import compress
from slmedge.compress.artifact import Artifact
from slmedge.models.streamed import StreamedModel, streamed_logits

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TINY_TYPES, VOCAB  # noqa: E402


def ids(batch=2, seq=40, seed=0):
    # 40 tokens: beyond the tiny Gemmas' 16-token sliding window, so their per-layer masks differ
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def full_logits(model, x):
    with torch.no_grad():
        return model(x).logits.float()


def watched(path):
    """A StreamedModel whose every block load is checked: only that block holds real tensors, and the
    real tensors in the model then are exactly the non-block ones plus that block's."""
    seen, real = [], []

    def on_block(i, model):
        seen.append(i)
        assert sm.materialized_blocks() == [i]
        real.append(sum(p.numel() for p in model.parameters() if not p.is_meta))

    sm = StreamedModel(path, on_block=on_block)
    return sm, seen, real


def block_numel(sm, i):
    return sum(p.numel() for p in sm.blocks[i].parameters())


def outside_numel(sm):
    return sum(p.numel() for n, p in sm.model.named_parameters() if not n.startswith(sm.layers_path + "."))


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_streamed_logits_equal_the_whole_models_for_every_architecture(model_type, tiny_models):
    src = tiny_models(model_type)
    x = ids()
    ref = full_logits(exact_attention(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)).eval(), x)
    sm, seen, real = watched(src)
    assert sm.materialized_blocks() == []  # built: nothing of any block is in memory
    got = sm(x)
    assert got.dtype == torch.float32 and got.shape == (2, 40, VOCAB)
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert seen == list(range(len(sm.blocks)))  # each block once, in order
    assert real == [outside_numel(sm) + block_numel(sm, i) for i in seen]
    assert sm.materialized_blocks() == []  # every block freed after the pass
    assert torch.equal(sm(x[:1, :7]), full_logits(exact_attention(AutoModelForCausalLM.from_pretrained(src)).eval(), x[:1, :7]))


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_streamed_logits_of_a_compact_artifact_equal_its_loaded_models(model_type, artifacts):
    art = artifacts(model_type, "rtn", bits=4)
    assert Artifact.open(art).version == 2
    x = ids(seed=1)
    ref = full_logits(Artifact.open(art).load_model().eval(), x)
    sm, seen, _ = watched(art)
    assert torch.equal(sm(x), ref)
    assert seen == list(range(len(sm.blocks)))


@pytest.mark.parametrize("method,kw", [("gptq", dict(bits=4, act_order=True)), ("wanda", dict(bits=None, sparsity=0.5)),
                                       ("sparsegpt", dict(bits=4, sparsity=0.5))])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3"])
def test_streamed_logits_of_v1_and_v2_artifacts_equal_their_loaded_models(model_type, method, kw, tiny_models,
                                                                          calib_file, tmp_path):
    from test_artifact_v2 import both_versions

    v1, v2, _ = both_versions(tiny_models(model_type), calib_file, tmp_path, method, **kw)
    assert Artifact.open(v1).version == 1 and Artifact.open(v2).version == 2
    x = ids(seed=2)
    ref = full_logits(Artifact.open(v1).load_model().eval(), x)
    assert torch.equal(full_logits(Artifact.open(v2).load_model().eval(), x), ref)
    for art in (v1, v2):
        assert torch.equal(streamed_logits(art, x), ref), art


def test_a_sharded_bf16_folder_and_a_missing_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_models("qwen2")
    model = exact_attention(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16))
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    x = ids(seed=3)
    ref = full_logits(exact_attention(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)).eval(), x)
    assert torch.equal(streamed_logits(folder, x), ref)
    # a block tensor the model needs and the files lack is refused by name, not left random
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    del index["weight_map"][name]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exception, match="mlp.up_proj.weight"):
        streamed_logits(folder, x)


def test_export_verification_uses_the_streamed_pass(tiny_models, monkeypatch):
    """export.verify's torch reference never loads the whole model (from_pretrained is not called)."""
    import numpy as np

    from slmedge.export import verify

    src = tiny_models("llama")
    probe = [1, 5, 9, 200, 17, 33]
    with torch.no_grad():
        ref = exact_attention(AutoModelForCausalLM.from_pretrained(src)).eval()(torch.tensor([probe])).logits[0].numpy()

    def refuse(*a, **k):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    got = verify.torch_logits(src, probe)
    assert got.shape == (len(probe), VOCAB) and np.array_equal(got, ref)


# --- peak memory, in a child process ------------------------------------------------------------------


CHILD = textwrap.dedent("""
    import json, sys, torch
    from slmedge.models.streamed import streamed_logits

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    from transformers import AutoConfig  # everything imported before the baseline
    import slmedge.models.artifact_weights, transformers.models.llama.modeling_llama  # noqa: F401
    before = status("VmRSS:")
    logits = streamed_logits(sys.argv[1], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    print(json.dumps({"before": before, "hwm": status("VmHWM:"), "shape": list(logits.shape)}))
""")


def write_random_model(folder: Path, layers=12, hidden=1024, inter=2816, vocab=8192):
    """A random bf16 llama written one block per shard (never whole in memory): ~170M parameters."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
                         max_position_embeddings=512)
    folder.mkdir()
    config.save_pretrained(folder)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    groups: dict[str, dict] = {}
    for name, p in meta.named_parameters():
        key = name.split(".")[2] if name.startswith("model.layers.") else "outside"
        groups.setdefault(key, {})[name] = p.shape
    g = torch.Generator().manual_seed(0)
    weight_map, sizes = {}, {}
    for key, shapes in groups.items():
        fname = f"model-{key}.safetensors"
        tensors = {n: (torch.ones(s) if "norm" in n else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
                   for n, s in shapes.items()}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        sizes[key] = sum(t.numel() for t in tensors.values()) * 4  # fp32 bytes
        weight_map.update({n: fname for n in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sizes


def test_peak_memory_is_the_outside_tensors_and_one_block_not_the_model(tmp_path):
    """VmHWM of a child process that runs the streamed pass over a ~170M-parameter model (690 MB in fp32):
    it grows by the non-block tensors, about one block (fp32, plus its bf16 read) and a fixed allowance,
    far less than the model in fp32; loading the model whole would exceed the bound."""
    folder = tmp_path / "m"
    sizes = write_random_model(folder)
    full = sum(sizes.values())
    block = max(v for k, v in sizes.items() if k != "outside")
    allowance = 120 * 2**20  # activations, logits, allocator slack and the files' page cache mappings
    bound = sizes["outside"] + 2 * block + allowance
    assert bound < 0.6 * full  # the check can tell one block from the whole model
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grew = m["hwm"] - m["before"]
    assert m["shape"] == [1, 8, 8192]
    assert grew < bound, (f"peak grew {grew / 2**20:.0f} MiB over the imports; bound {bound / 2**20:.0f} MiB "
                          f"(the model is {full / 2**20:.0f} MiB in fp32)")


# --- torch evaluation on the streamed model -------------------------------------------------------------


TEXT = ("Small language models run on phones, boards and laptops. Die Katze schläft auf dem Sofa. " * 30
        + "El perro corre por el parque con una pelota roja. 1, 2, 3, 4, 5 and then 6. " * 30)


def windows(n=5, seq=40, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [[int(t) for t in torch.randint(3, VOCAB, (seq,), generator=g)] for _ in range(n)]


def loads_of(runtime):
    seen = []
    runtime.streamed.on_block = lambda i, model: seen.append(i)
    return seen


def same_scores(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) and gx == gy for (x, gx), (y, gy) in zip(a, b))


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_torch_runtime_streamed_scores_as_the_whole_model_bit_for_bit(model_type, tiny_models):
    """Perplexity windows, fidelity's logits and hidden states, task continuations: the streamed runtime's are
    the whole model's, bit for bit; many windows go through one pass, so each block is read once per pass."""
    from slmedge.runtimes import TorchRuntime

    src = tiny_models(model_type)
    whole = TorchRuntime(exact_attention(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)))
    streamed = TorchRuntime.open_streamed(src)
    blocks = list(range(len(streamed.streamed.blocks)))
    loads = loads_of(streamed)
    wins = windows()
    # what the whole model gave before windows were batched: one padded forward per window
    before = [TorchRuntime.continuation_scores(whole, w[:1], [w[1:]])[0] for w in wins]
    assert same_scores(list(whole.sequence_scores(wins)), before)
    assert same_scores(list(streamed.sequence_scores(wins)), before)
    assert loads == blocks  # five windows, one pass
    loads.clear()
    streamed.batch_tokens = 2 * 39  # two windows a pass: three passes
    assert same_scores(list(streamed.sequence_scores(wins)), before)
    assert loads == blocks * 3
    with torch.no_grad():
        ref = [whole.model(torch.tensor([w]), use_cache=False, output_hidden_states=True) for w in wins]
    for rt in (whole, streamed):
        for r, (logits, hidden) in zip(ref, rt.sequence_outputs(wins, hidden=True)):
            assert np.array_equal(logits, r.logits[0].numpy()) and np.array_equal(hidden, r.hidden_states[-1][0].numpy())
        assert np.array_equal(rt.logits(wins[0]), ref[0].logits[0].numpy())
    groups = [(w[:20], [w[20:25], w[25:27], w[30:31]]) for w in wins] + [(wins[0][:1], [wins[1][:6]])]
    assert all(same_scores(a, b) for a, b in zip(streamed.score_groups(groups), whole.score_groups(groups)))
    assert streamed.streamed.materialized_blocks() == []
    streamed.close()


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3"])
def test_evaluation_of_a_compact_artifact_streamed_equals_it_loaded_whole(model_type, artifacts, monkeypatch):
    """Perplexity, fidelity and a task of a version-2 artifact (its blocks rebuilt from the codes one at a time)
    in the streamed torch runtime: the numbers of the whole loaded model, exactly."""
    from slmedge.evaluate.fidelity import fidelity
    from slmedge.evaluate.perplexity import runtime_perplexity
    from slmedge.evaluate.subject import open_subject
    from slmedge.evaluate.tasks import run_task

    art = artifacts(model_type, "rtn", bits=4)
    assert Artifact.open(art).version == 2
    out = {}
    for streamed in (False, True):
        sub = open_subject(str(art), streamed=streamed)
        assert sub.streamed is streamed and (sub.runtime.streamed is not None) is streamed
        ppl, _ = runtime_perplexity(sub.runtime, sub.encoder, TEXT, seqlen=48, max_windows=4)
        ref = open_subject(str(art), streamed=streamed)
        fid = fidelity((sub.runtime, sub.encoder), (ref.runtime, ref.encoder), TEXT, seqlen=48, max_windows=2,
                       reference_id=f"streamed={streamed}")  # not the other's cached reference
        summary, scores = run_task(sub.runtime, sub.encoder, "arc_easy", limit=6)
        out[streamed] = (ppl.to_dict(), {k: v for k, v in fid.items() if k != "reference_cached"}, summary,
                         [s.loglikelihoods for s in scores], sub.params, sub.identity)
        sub.close()
        ref.close()
    assert out[True] == out[False]


def test_whether_to_stream(tiny_models, monkeypatch):
    """Streamed when the whole fp32 model would not fit comfortably in the memory available, or when asked;
    never on a GPU, and never a folder without safetensors weights."""
    from slmedge.errors import ConfigError
    from slmedge.evaluate import subject
    from slmedge.evaluate.subject import STREAM_ENV, WHOLE_PEAK_FACTOR, open_subject, torch_streamed
    from slmedge.models.streamed import fp32_bytes

    src = tiny_models("qwen2")
    need = WHOLE_PEAK_FACTOR * fp32_bytes(src)
    whole = exact_attention(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32))
    assert fp32_bytes(src) == 4 * sum(p.numel() for p in whole.parameters())  # the tied head counted once
    monkeypatch.delenv(STREAM_ENV, raising=False)
    monkeypatch.setattr(subject, "memory_available", lambda: need - 1)
    assert torch_streamed(src) and not torch_streamed(src, device="cuda") and not torch_streamed(src, streamed=False)
    assert open_subject(src).streamed
    monkeypatch.setattr(subject, "memory_available", lambda: need)
    assert not torch_streamed(src) and torch_streamed(src, streamed=True)
    monkeypatch.setenv(STREAM_ENV, "always")
    assert torch_streamed(src)
    monkeypatch.setenv(STREAM_ENV, "never")
    monkeypatch.setattr(subject, "memory_available", lambda: 0)
    assert not torch_streamed(src) and not open_subject(src).streamed
    monkeypatch.setenv(STREAM_ENV, "sometimes")
    with pytest.raises(ConfigError, match=STREAM_ENV):
        torch_streamed(src)
    assert not torch_streamed(Path(src).parent)  # no config.json, no weights


@pytest.mark.parametrize("threads", [1, 2])
def test_torch_log_sum_exp_in_blocks_of_rows_is_that_of_the_whole_matrix(threads):
    """The torch runtime's token scores take each row's log-sum-exp in blocks of rows (a float64 copy of a
    block, not of a 512 x 151,936 window): the very values of one call over the whole matrix."""
    from slmedge.runtimes.base import _logsumexp_rows

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        for rows in (0, 1, 63, 64, 129, 300):
            x = (torch.randn(rows, 4099, generator=g) * 4).numpy()
            want = torch.logsumexp(torch.from_numpy(x).double(), -1).numpy()
            assert np.array_equal(_logsumexp_rows(x, in_torch=True), want), rows
    finally:
        torch.set_num_threads(old)
