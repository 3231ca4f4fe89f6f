"""onnxruntime-genai export: the ONNX export (``export.onnx``), plus what onnxruntime-genai's
``Model`` reads beside it.

The decoder is written by ``export_onnx`` as it is, byte for byte (the traced graph, the artifact's
codes as MatMulNBits, verified against torch's logits); this module adds ``genai_config.json``
and checks the folder in genai's own generation loop. The config says what genai cannot guess:

- the model type (its ``config.json``'s), context length, vocabulary, special tokens (BOS, EOS,
  pad, from ``config.json`` and ``generation_config.json``);
- the decoder's inputs and outputs as the graph names them: ``input_ids``,
  ``attention_mask``, ``position_ids`` (optimum's Gemma exports have none), ``past_key_values.%d.key/value``
  in, ``logits`` and ``present.%d.key/value`` out (genai's builder writes the same names); the
  KV cache laid out (batch, kv heads, sequence, head size), head size and KV heads read from the
  graph's cache inputs;
- ``past_present_share_buffer: false``: the graph concatenates the past with the new
  positions (present is past + T long), it does not write into a buffer of the maximum length.

Verification (besides the ONNX export's own): the probe's greedy tokens from genai's Generator
equal onnxruntime's on the same file (up to the first EOS: genai's search stops there and leaves
it out, onnxruntime's loop emits it), genai's prefill logits equal onnxruntime's, and genai's logits
along the whole sequence (the probe and its greedy tokens, teacher-forced) are within the format's
tolerance of torch's on the source's weights (mean KL and top-1 agreement at every position, as the
ONNX export's own check; torch's agreement on the generated tokens alone is reported, not judged:
eight tokens cannot tell a 4-bit file's 70% from a broken one's).

This module does not import ``export.onnx`` at import time: it registers first, so that a folder
holding both a ``.onnx`` model and ``genai_config.json`` is recognised as this format, not as a
plain ONNX export (``formats.format_for_path`` takes the first format that recognises a folder).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import ArtifactError
from ..fsutil import atomic_directory, check_output_dir, sealed, sha256_file, write_json_atomic, write_text_atomic
from ..paths import recorded_path
from ..backends.genai import GENAI_CONFIG, is_genai_folder
from .errors import ExportError, ExportVerificationError
from .formats import get_format, register_format
from .inspect import EXPORT_MANIFEST, inspect_onnx, onnx_model_facts, onnx_model_files, onnx_rows, \
    verified_onnx_manifest
from .verify import check_logits, compare_logits, probe_text, source_tokenizer, torch_logits

FORMAT = "slmedge-onnxruntime-genai-export"  # the manifest's "format"
# genai_config.json as this module (and genai's own builder: json.dump(indent=4)) writes it starts so.
MAGIC = b'{\n    "model": {'
GREEDY_TOKENS = 8  # new tokens generated after the probe in the check
# Where genai's model type is not the config's model_type (genai's C++ names the decoder types).
GENAI_TYPES: dict[str, str] = {}


class GenaiExportError(ExportError):
    """An onnxruntime-genai export cannot be written as asked."""


class GenaiVerificationError(GenaiExportError, ExportVerificationError):
    """onnxruntime-genai's greedy tokens or logits of the written folder disagree with onnxruntime's
    on the same file or with torch's of its source; nothing is left at the output path."""


class _FromOnnx:
    """A constant of ``export.onnx`` read when first used (importing it here would register the ONNX
    format before this one)."""

    def __init__(self, name):
        self.name = name

    def value(self):
        from . import onnx

        return getattr(onnx, self.name)


class _LazyTuple(Sequence, _FromOnnx):
    def __getitem__(self, i):
        return self.value()[i]

    def __len__(self):
        return len(self.value())


class _LazyMapping(Mapping, _FromOnnx):
    def __getitem__(self, key):
        return self.value()[key]

    def __iter__(self):
        return iter(self.value())

    def __len__(self):
        return len(self.value())


TYPES = _LazyTuple("ONNX_TYPES")  # the ONNX export's types: the decoder is that export
TOLERANCES = _LazyMapping("TOLERANCES")


# --- genai_config.json ------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _graph_io(model_path: Path) -> dict:
    """The decoder's input/output names and its KV cache's fixed dimensions, from the graph."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inputs = {i.name: i for i in graph.input}
    outputs = [o.name for o in graph.output]
    keys = sorted(n for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
    if "input_ids" not in inputs or "logits" not in outputs or not keys:
        raise GenaiExportError(f"{model_path.name} is not a decoder with KV cache (input_ids, past_key_values.N.key "
                               "in; logits out): onnxruntime-genai cannot run it")
    dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[keys[0]].type.tensor_type.shape.dim]
    if len(dims) != 4 or dims[1] is None or dims[3] is None:
        raise GenaiExportError(f"{keys[0]} of {model_path.name} is not (batch, kv heads, sequence, head size): {dims}")
    return {"inputs": set(inputs), "outputs": set(outputs), "layers": len(keys), "kv_heads": dims[1],
            "head_size": dims[3]}


def _token_id(value):
    if isinstance(value, list):
        return [int(v) for v in value] if len(value) != 1 else int(value[0])
    return None if value is None else int(value)


def genai_config(folder: Path, model_name: str = "model.onnx") -> dict:
    """What onnxruntime-genai needs to run the decoder ``folder/model_name`` (an slmedge ONNX export)."""
    io = _graph_io(folder / model_name)
    cfg = _read_json(folder / "config.json")
    gen = _read_json(folder / "generation_config.json")
    text = cfg.get("text_config") or cfg
    model_type = cfg.get("model_type")
    if not model_type:
        raise GenaiExportError(f"{folder / 'config.json'} names no model_type")
    context = int(text.get("max_position_embeddings") or text.get("seq_length") or 2048)
    eos = _token_id(gen.get("eos_token_id", cfg.get("eos_token_id")))
    bos = _token_id(gen.get("bos_token_id", cfg.get("bos_token_id")))
    pad = _token_id(gen.get("pad_token_id", cfg.get("pad_token_id")))
    if pad is None:  # genai needs one; greedy search of one sequence never reads it
        pad = eos[0] if isinstance(eos, list) else eos
    inputs = {"input_ids": "input_ids"}
    for name in ("attention_mask", "position_ids"):
        if name in io["inputs"]:
            inputs[name] = name
    inputs.update({"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"})
    outputs = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    first = [outputs["present_key_names"] % 0, outputs["present_value_names"] % 0]  # layer 0's present
    missing = [n for n in first if n not in io["outputs"]]
    if missing:
        raise GenaiExportError(f"{model_name} has no output {missing[0]}: onnxruntime-genai cannot carry its KV cache")
    # No thread count: genai's default (all cores); slmedge's runtime sets the caller's.
    session = {"log_id": "onnxruntime-genai", "provider_options": []}
    return {
        "model": {
            "bos_token_id": bos,
            "context_length": context,
            "decoder": {
                "session_options": session,
                "filename": model_name,
                "head_size": io["head_size"],
                "hidden_size": int(text["hidden_size"]),
                "inputs": inputs,
                "outputs": outputs,
                "num_attention_heads": int(text["num_attention_heads"]),
                "num_hidden_layers": io["layers"],
                "num_key_value_heads": io["kv_heads"],
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": GENAI_TYPES.get(model_type, model_type),
            "vocab_size": int(text["vocab_size"]),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,  # present = concat(past, new): no shared buffer
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def write_genai_config(folder: Path, config: dict) -> Path:
    text = json.dumps(config, indent=4) + "\n"
    if not text.encode("utf-8").startswith(MAGIC):
        raise GenaiExportError("genai_config.json must start with its model section")  # MAGIC recognises it
    write_text_atomic(folder / GENAI_CONFIG, text)
    return folder / GENAI_CONFIG


# --- the folder: its manifest, model file, facts ------------------------------------------------


def _folder(path) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def read_genai_manifest(path) -> dict | None:
    """The manifest of an onnxruntime-genai export (its folder, or a file in it); None: it has none."""
    f = _folder(path) / EXPORT_MANIFEST
    if not f.is_file():
        return None
    manifest = json.loads(f.read_text(encoding="utf-8"))
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def verified_genai_manifest(path) -> dict | None:
    """The manifest after checking it and every file it lists against their sha256 (the ONNX
    export's checker: the same manifest file and layout); None: a folder slmedge did not write."""
    manifest = verified_onnx_manifest(_folder(path))
    if manifest is not None and manifest.get("format") != FORMAT:
        raise ArtifactError(f"{_folder(path) / EXPORT_MANIFEST} is not an onnxruntime-genai export's manifest "
                            f"(format {manifest.get('format')!r})")
    return manifest


def genai_model_file(path) -> Path:
    """The file genai opens first: the folder's genai_config.json (it names the decoder)."""
    p = Path(path)
    return p / GENAI_CONFIG if p.is_dir() else p


def _decoder(folder: Path) -> Path:
    try:
        name = _read_json(folder / GENAI_CONFIG)["model"]["decoder"]["filename"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{folder / GENAI_CONFIG} names no decoder file") from exc
    return folder / name


def genai_model_files(path) -> list[Path]:
    """What genai reads to run the model (and what a target gets): genai_config.json, the decoder
    and its external data."""
    folder = _folder(path)
    return [folder / GENAI_CONFIG, *onnx_model_files(_decoder(folder))]


def genai_model_facts(path) -> dict:
    return onnx_model_facts(_decoder(_folder(path)))


def inspect_genai(path) -> dict:
    folder = _folder(path)
    info = inspect_onnx(_decoder(folder))
    cfg = _read_json(folder / GENAI_CONFIG).get("model", {})
    manifest = read_genai_manifest(folder)
    if manifest is not None:
        manifest.pop("files", None)
    info.update({"path": str(folder), "format": "onnxruntime-genai", "manifest": manifest,
                 "genai": {"type": cfg.get("type"), "context_length": cfg.get("context_length"),
                           "decoder": cfg.get("decoder", {}).get("filename"),
                           "inputs": sorted(cfg.get("decoder", {}).get("inputs", {}).values())}})
    return info


def genai_rows(info: dict) -> list[tuple[str, str]]:
    g = info["genai"]
    return [("genai", f"type {g['type']}, context {g['context_length']}, decoder {g['decoder']}"), *onnx_rows(info)]


def _report_rows(report: dict) -> list[tuple[str, str]]:
    greedy = (report.get("verification") or {}).get("greedy")
    rows = [("codes kept exactly", f"{report['codes_kept']} linears; {report['requantized_by_onnxruntime']} by "
                                   "onnxruntime's quantizer")]
    if greedy:
        vs = greedy.get("vs_torch")
        rows.append(("greedy check", f"{greedy['new_tokens']} tokens: genai = onnxruntime"
                     + (f"; against torch along the sequence: top-1 {vs['top1_agreement']:.1%}, mean KL {vs['mean_kl']:.2e}"
                        if vs else f", torch agrees on {greedy['torch_agreement']:.0%}")))
    return rows


def _complete(out) -> bool:
    return (Path(out) / EXPORT_MANIFEST).is_file() and (Path(out) / GENAI_CONFIG).is_file()


# --- verification -------------------------------------------------------------------------------


def _ort_greedy(dec, ids: list[int], n_new: int, eos: set) -> list[int]:
    """onnxruntime's greedy tokens: a prefill, then one token at a time through the KV cache."""
    out, past = dec.run(np.asarray([ids]))
    new: list[int] = []
    while len(new) < n_new:
        token = int(np.argmax(out[0, -1]))
        new.append(token)
        if token in eos:
            break
        out, past = dec.run(np.asarray([[token]]), past, past_len=len(ids) + len(new) - 1)
    return new


def _before_eos(tokens: list[int], eos: set) -> list[int]:
    """A greedy decode's tokens up to its first EOS, the EOS left out: what genai's search returns
    (it stops at EOS and does not keep it) and what onnxruntime's loop emits (it keeps it) both mean this."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def verify_genai(folder: Path, src_path: Path, tolerance: Mapping, probe: str | None = None,
                 n_threads: int | None = None, n_new: int = GREEDY_TOKENS) -> dict:
    """genai's greedy tokens of the probe against onnxruntime's on the same file (equal) and
    torch's on the source (agreement at least the tolerance's top-1); its prefill logits against
    onnxruntime's; its tokenizer against the source's. Raises GenaiVerificationError."""
    import os

    from ..backends.genai import GenaiModel
    from ..backends.ort import OrtDecoder

    text = probe_text(probe)
    ids = source_tokenizer(src_path)(text, add_special_tokens=True)["input_ids"]
    model = GenaiModel(folder, int(n_threads or os.cpu_count() or 1))
    try:
        genai = model.greedy(ids, n_new)
        genai_logits = model.logits(ids)
        # The whole sequence it produced (the probe, then its greedy tokens but the last), scored at once:
        # what torch is compared with, at every position.
        seq = list(ids) + _before_eos(genai, model.eos)[:-1]
        seq_logits = genai_logits if len(seq) == len(ids) else model.logits(seq)
        genai_ids = model.encode(text)
    finally:
        model.close()
    dec = OrtDecoder(folder, n_threads=n_threads)
    ort_emitted = _ort_greedy(dec, ids, n_new, model.eos)
    genai, ort = _before_eos(genai, model.eos), _before_eos(ort_emitted, model.eos)
    stats = compare_logits(dec.logits(ids), genai_logits)
    if genai != ort:
        raise GenaiVerificationError(f"onnxruntime-genai's greedy tokens {genai} differ from onnxruntime's {ort} on "
                                     "the same file; nothing was written")
    if stats["mean_kl"] > 1e-4:
        raise GenaiVerificationError(f"onnxruntime-genai's logits of the probe differ from onnxruntime's on the same "
                                     f"file (mean KL {stats['mean_kl']:.2e}); nothing was written")
    # Against torch on the source, over every position of that sequence (the probe's and the generated
    # ones, teacher-forced), with the format's tolerance: as many positions as the ONNX export's own check
    # reads. The few generated tokens alone (8) cannot tell a lossy file's 70% top-1 from a broken one's.
    ref = torch_logits(src_path, seq)
    vs_torch = check_logits(ref, seq_logits, tolerance, "onnxruntime-genai's logits along its greedy sequence differ "
                            "from torch's on the source", error=GenaiVerificationError)
    torch_tokens = [int(t) for t in ref[len(ids) - 1 :].argmax(-1)]
    agreement = float(np.mean([a == b for a, b in zip(torch_tokens, genai)])) if genai else 1.0
    return {"probe_tokens": len(ids), "new_tokens": len(genai), "genai_tokens": genai, "onnxruntime_tokens": ort,
            "torch_tokens": torch_tokens, "ended_at_eos": len(ort) < len(ort_emitted), "onnxruntime_equal": True, "torch_equal": torch_tokens == genai,
            "torch_agreement": agreement, "vs_torch": {k: vs_torch[k] for k in ("mean_kl", "top1_agreement", "positions")
                                                       if k in vs_torch},
            "prefill_mean_kl_vs_onnxruntime": stats["mean_kl"],
            "prefill_max_abs_logit_diff_vs_onnxruntime": stats["max_abs_logit_diff"],
            "tokenizer_matches_source": genai_ids == list(ids) or genai_ids == list(ids)[1:],
            "tolerance": dict(tolerance)}


def _kind(report: dict) -> str:
    """The ONNX tolerance kind of what ``export_onnx`` wrote (its manifest)."""
    if report["type"] in ("fp32", "fp16"):
        return report["type"]
    if not report.get("exact"):
        return "requantized"
    return "kept-4bit-tables" if "int4" in (report.get("head_type"), report.get("embedding_type")) else "kept"


# --- the export ---------------------------------------------------------------------------------


@register_format("onnxruntime-genai", label="onnxruntime-genai", noun="an onnxruntime-genai export",
                 single_file=False, suffix="", folder_holds="model.onnx, genai_config.json, tokenizer",
                 default_stem="{model}-genai-{type}", complete=_complete, read_manifest=read_genai_manifest,
                 verified_manifest=verified_genai_manifest, model_file=genai_model_file,
                 model_files=genai_model_files, model_facts=genai_model_facts, tokenizer="beside",
                 packages=("onnx", "onnxruntime", "onnxruntime-genai"), types=TYPES, tolerances=TOLERANCES,
                 options=("block_size", "accuracy_level", "keep_fp32_head", "embedding_type", "head_type"),
                 error=GenaiExportError,
                 report_rows=_report_rows, inspect=inspect_genai, inspect_rows=genai_rows,
                 recognizes=is_genai_folder, magic=MAGIC)
def export_genai(source, out_dir, otype: str = "auto", exact: bool = False, verify: bool = True, *,
                 overwrite: bool = False, probe: str | None = None, n_threads: int | None = None,
                 block_size: int = 32, accuracy_level: int = 4, keep_fp32_head: bool = False,
                 embedding_type: str = "fp16", head_type: str = "int8") -> dict:
    """Write ``source`` (an slmedge artifact or an HF folder) as a folder onnxruntime-genai opens:
    the ONNX export of ``source`` (``export_onnx`` with the same type and options: the artifact's
    codes as MatMulNBits), ``genai_config.json``, config and tokenizer files and
    ``slmedge-export.json``. The folder appears only when complete and verified."""
    from .onnx import export_onnx

    started = time.perf_counter()
    get_format("onnxruntime-genai").check_type(otype)
    check_output_dir(out_dir, overwrite, EXPORT_MANIFEST, inputs=[source])  # before any work
    if verify:
        from ..backends.genai import require_genai

        require_genai()  # before the ONNX export: the check needs it
    with atomic_directory(out_dir, overwrite=overwrite, manifest=EXPORT_MANIFEST) as tmp:
        stage = tmp / ".onnx"
        report = export_onnx(source, stage, otype, exact, verify, probe=probe, n_threads=n_threads,
                             block_size=block_size, accuracy_level=accuracy_level, keep_fp32_head=keep_fp32_head,
                             embedding_type=embedding_type, head_type=head_type)
        for f in stage.iterdir():
            if f.name != EXPORT_MANIFEST:
                shutil.move(str(f), tmp / f.name)
        shutil.rmtree(stage)
        src_path = Path(report["source"])
        if not (tmp / "tokenizer.json").is_file():  # genai's tokenizer reads tokenizer.json
            source_tokenizer(src_path).save_pretrained(str(tmp))
        write_genai_config(tmp, genai_config(tmp))
        # The ONNX export's logits against torch's, and genai's greedy check under "greedy".
        verification = None
        if verify:
            greedy = verify_genai(tmp, src_path, TOLERANCES[_kind(report)], probe, n_threads)
            verification = {**report["verification"], "greedy": greedy}
        notes = list(report.get("notes") or [])
        if verify and not verification["greedy"]["tokenizer_matches_source"]:
            notes.append("onnxruntime-genai's tokenizer encodes the probe differently from the source's; slmedge "
                         "evaluate feeds the source tokenizer's ids")
        drop = ("files", "path", "bytes", "seconds", "verification", "notes", "format")
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        manifest = sealed({
            "format": FORMAT,
            **{k: v for k, v in report.items() if k not in drop and not k.startswith("manifest_")},
            "source": recorded_path(src_path, out_dir),  # relative to the folder: no absolute local path
            "genai": {"config": GENAI_CONFIG, "decoder": "model.onnx", "model_type": report.get("model_type")},
            "verification": verification,
            "notes": notes,
            "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
            "seconds": round(time.perf_counter() - started, 2),
        })
        write_json_atomic(tmp / EXPORT_MANIFEST, manifest)
    manifest = dict(manifest)
    manifest["path"] = str(out_dir)
    manifest["source"] = str(src_path)  # the report: where this run read it
    manifest["bytes"] = sum(f["bytes"] for n, f in manifest["files"].items() if n.startswith("model.onnx"))
    return manifest
