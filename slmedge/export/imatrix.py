"""llama.cpp's importance-matrix file: written from slmedge's calibration statistics, read for its quantizer.

The format is the one ``llama-imatrix`` writes and ``llama-quantize --imatrix`` reads (llama.cpp's
tools/imatrix/imatrix.cpp and common/imatrix-loader.cpp): a GGUF file with ``general.type =
"imatrix"``, the keys ``imatrix.datasets`` (strings), ``imatrix.chunk_count`` and
``imatrix.chunk_size`` (u32; ``llama-quantize`` refuses a file without all three), and per weight
tensor two F32 tensors named after the model's GGUF tensor: ``<name>.in_sum2`` (the sum over tokens of
each input column's squared value) and ``<name>.counts`` (the number of tokens). The quantizer uses
``in_sum2 / counts`` per column. The legacy ``.dat`` format is not written.

slmedge's own file also carries ``slmedge.imatrix`` (a JSON identity: the model's weights sha256, the
calibration), sealed as slmedge's GGUF exports are (``models.gguf_seal``: the identity's own digest and
the sha256 of every other byte of the file), which is how ``--overwrite`` knows the file is slmedge's to
replace and how a reader knows nothing in it changed since. A file without it (``llama-imatrix``'s) is
read too, its values checked (finite, non-negative sums, whole counts, shapes) as every file's are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..data import DEFAULT_CALIBRATION
from ..errors import ArtifactError, ConfigError, OutputExistsError
from ..models.gguf_seal import ModifiedGGUFError, check_gguf, manifest_text, placeholder_manifest, seal_gguf
from .errors import GGUFExportError

KEY = "slmedge.imatrix"
DATASETS = "imatrix.datasets"
CHUNK_COUNT = "imatrix.chunk_count"
CHUNK_SIZE = "imatrix.chunk_size"
SUM2, COUNTS = ".in_sum2", ".counts"


class ImatrixError(GGUFExportError):
    """An importance-matrix file that cannot be read or used."""


def gguf_names(config, arch, hf_names) -> dict[str, str]:
    """HF linear name -> the GGUF tensor name of its weight (``blk.N.attn_q.weight``...), as slmedge's
    GGUF export names it (the ``gguf`` package's map for the architecture)."""
    import gguf

    if arch.gguf is None:
        raise ImatrixError(f"architecture '{arch.model_type}' has no GGUF layout: no llama.cpp tensor names")
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf.arch], int(config.num_hidden_layers))
    out = {}
    for name in hf_names:
        gname = tmap.get_name(f"{name}.weight", try_suffixes=(".weight",))
        if gname is None:
            raise ImatrixError(f"{name} has no GGUF tensor name for {arch.gguf.arch.lower()}")
        out[name] = gname
    return out


def write_imatrix(path: str | os.PathLike, stats: dict, names: dict[str, str], *, chunk_size: int, chunk_count: int,
                  datasets: list[str], identity: dict, overwrite: bool = False) -> Path:
    """Write ``stats`` ({HF name: compress.importance.Importance}) as llama.cpp's imatrix GGUF at
    ``path`` (``names``: HF name -> GGUF tensor name). The file appears complete or not at all; an
    existing file is replaced only with ``overwrite`` and only if slmedge wrote it."""
    import gguf

    from ..fsutil import temp_name

    out = Path(path)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(out)
    try:
        writer = gguf.GGUFWriter(str(tmp), arch="imatrix")  # general.architecture is not read by llama.cpp here
        writer.add_type("imatrix")
        writer.add_array(DATASETS, [str(d) for d in datasets])
        writer.add_uint32(CHUNK_COUNT, int(chunk_count))
        writer.add_uint32(CHUNK_SIZE, int(chunk_size))
        writer.add_string(KEY, manifest_text(placeholder_manifest(identity)))  # sealed once written
        for hf in sorted(stats, key=lambda n: names[n]):  # llama-imatrix writes the names sorted
            st = stats[hf]
            writer.add_tensor(names[hf] + SUM2, st.sum2.numpy().astype(np.float32).reshape(1, -1))
            writer.add_tensor(names[hf] + COUNTS, np.array([[float(st.count)]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        seal_gguf(tmp, KEY)
        os.replace(tmp, out)
    except OSError as exc:
        from ..fsutil import disk_full, no_space

        if disk_full(exc):
            raise no_space(out, sum(8 * st.sum2.numel() + 64 for st in stats.values())) from exc
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def read_identity(path: Path) -> dict | None:
    """slmedge's identity of an imatrix file it wrote; None for any other file."""
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get(KEY)
        return json.loads(bytes(field.parts[field.data[0]]).decode()) if field is not None else None
    except Exception:  # noqa: BLE001 - not a GGUF file, or not ours
        return None


def read_imatrix(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """``({GGUF tensor name: in_sum2 / counts per column (float32)}, metadata)`` of an importance-matrix
    file in llama.cpp's GGUF format (from ``llama-imatrix`` or ``slmedge imatrix``), normalised as
    ``llama-quantize`` does (a column group with a zero count weighs 1). Refuses (ImatrixError, one line
    naming the file) what ``llama-quantize`` would refuse (not GGUF, no entries, a sum without its count,
    other than F32, the metadata keys missing) and what it would quantize wrongly: a damaged or truncated
    file, a file slmedge wrote that changed since (its seal), sums of squares that are negative or not
    finite, counts that are not whole numbers of tokens (or, in slmedge's file, not its windows' tokens),
    sums whose length is not a multiple of their counts'. ``metadata["slmedge"]``: slmedge's identity of
    the file (None for ``llama-imatrix``'s), whose ``weights_sha256`` ``check_model`` compares."""
    import gguf

    p = Path(path)
    if p.is_dir():
        raise ImatrixError(f"importance matrix {p} is a folder, not a file: give the .gguf file itself")
    if not p.is_file():
        raise ImatrixError(f"importance matrix {p} does not exist")
    try:
        with open(p, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ImatrixError(f"cannot read the importance matrix {p} ({exc.strerror or exc})") from exc
    if magic != b"GGUF":
        raise ImatrixError(f"{p} is not an importance matrix in llama.cpp's GGUF format; the legacy .dat format is "
                           "not read: convert it with llama-imatrix --in-file")
    try:
        identity = check_gguf(p, KEY)  # slmedge's file: nothing in it changed since it was written
    except ModifiedGGUFError as exc:
        raise ImatrixError(f"{p} changed since slmedge wrote it (its bytes no longer match the sha256 its "
                           f"{KEY} records: damaged, truncated or edited); make it again with slmedge imatrix") from exc
    except ArtifactError as exc:
        raise ImatrixError(f"{p}: its {KEY} identity is damaged or unsealed, so nothing in the file can be trusted; "
                           "make it again with slmedge imatrix") from exc
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as exc:  # noqa: BLE001 - the gguf reader raises plain errors (numpy's, struct's) for damage
        raise ImatrixError(f"{p} is a damaged or truncated GGUF file ({p.stat().st_size} bytes; its header or tensors "
                           "end past its end or do not parse): it cannot be read as an importance matrix; make it "
                           "again") from exc
    missing = [k for k in (DATASETS, CHUNK_COUNT, CHUNK_SIZE) if k not in reader.fields]
    if missing:
        raise ImatrixError(f"{p} lacks the importance-matrix keys {', '.join(missing)} (llama-quantize refuses it too)")

    def field(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data] if key == DATASETS else int(f.parts[f.data[0]][0])

    meta = {"datasets": field(DATASETS), "chunk_count": field(CHUNK_COUNT), "chunk_size": field(CHUNK_SIZE),
            "slmedge": identity}
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ImatrixError(f"{p}: {t.name} is {t.tensor_type.name}, not F32")
        if t.name.endswith(SUM2):
            sums[t.name[:-len(SUM2)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
        elif t.name.endswith(COUNTS):
            counts[t.name[:-len(COUNTS)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise ImatrixError(f"{p} holds no importance-matrix entries")
    lone = sorted(set(sums) ^ set(counts))
    if lone:
        raise ImatrixError(f"{p}: {lone[0]} has a sum without a count or a count without a sum")
    tokens = meta["chunk_count"] * meta["chunk_size"] if identity is not None else None
    values = {}
    for name in sorted(sums):
        s, c = sums[name], counts[name]
        _check_entry(p, name, s, c, tokens)
        c = np.rint(c)  # llama.cpp reads the counts with lround
        per = s.reshape(len(c), -1)
        values[name] = np.where(c[:, None] > 0, per / np.where(c > 0, c, 1)[:, None], 1.0).astype(np.float32).reshape(-1)
    meta["entries"] = len(values)
    return values, meta


def _check_entry(p: Path, name: str, s: np.ndarray, c: np.ndarray, tokens: int | None) -> None:
    """One entry's sums of squares and counts, as llama.cpp's quantizer needs them (ImatrixError naming
    the file and the tensor): finite, non-negative sums; one count per expert (the sums' length a multiple
    of the counts'), each a finite whole number >= 0; in slmedge's own file, each its windows' tokens."""
    if c.size == 0 or s.size == 0 or s.size % c.size:
        raise ImatrixError(f"{p}: {name} has {s.size} sums of squares for {c.size} counts; the sums must be one row "
                           "per count (the file is damaged)")
    bad = int((~np.isfinite(s)).sum())
    if bad:
        raise ImatrixError(f"{p}: {name}{SUM2} holds {bad} NaN or infinite values; a sum of squares is a finite "
                           "number (the file is damaged): make it again")
    bad = int((s < 0).sum())
    if bad:
        raise ImatrixError(f"{p}: {name}{SUM2} holds {bad} negative values; a sum of squares is >= 0 (the file is "
                           "damaged): make it again")
    if not np.isfinite(c).all() or (c < 0).any() or (np.abs(c - np.rint(c)) > 1e-3).any():
        raise ImatrixError(f"{p}: {name}{COUNTS} holds {c[:4].tolist()}...; a count is a whole number of tokens >= 0 "
                           "(the file is damaged): make it again")
    if tokens is not None and (np.rint(c) != tokens).any():
        raise ImatrixError(f"{p}: {name}{COUNTS} says {int(np.rint(c).max())} tokens, but the file records "
                           f"{tokens} (its {CHUNK_COUNT} x {CHUNK_SIZE}): its counts do not match; make it again")


def weights_sha256(folder) -> str | None:
    """One sha256 of a model folder's weights, as an importance matrix slmedge writes records it and as
    an export compares it: an artifact's (its weights and codes, from its manifest), a plain folder's
    safetensors files'. None: no local folder (a Hub model transformers downloads itself)."""
    if folder is None:
        return None
    from ..models.artifact_format import is_artifact, manifest_path
    from ..models.source import _artifact_weights_sha, weights_digest

    if is_artifact(folder):
        return _artifact_weights_sha(json.loads(manifest_path(folder).read_text(encoding="utf-8")))
    return weights_digest(Path(folder))


def model_names(weights: str | None, base: dict | None = None) -> set[str]:
    """What identifies a model to ``check_model``: its weights' sha256 (``weights_sha256``) and the GGUF it
    was imported from, where it was (``base``: a source identity, ``models.source.load``'s)."""
    names = {weights} if weights else set()
    if isinstance(base, dict):
        names |= {f"gguf:{base['gguf_sha256']}"} if base.get("gguf_sha256") else set()
        names |= {base["weights_sha256"]} if base.get("weights_sha256") else set()
    return names


def check_model(path, meta: dict, folder) -> None:
    """Refuse an importance matrix slmedge made for another model than the one in ``folder`` (being
    exported), a model of the same shapes included: the weights sha256 its identity records against the
    folder's (``weights_sha256``). A matrix of an artifact's base model is one for the artifact too
    (llama.cpp's quantizer rounds the artifact's weights, whose inputs are the base's). A file without an
    identity (``llama-imatrix``'s; a Hub model's) is checked by its shapes alone, against the tensors."""
    identity = meta.get("slmedge") or {}
    recorded = model_names(identity.get("weights_sha256"), identity.get("base_model"))
    if not recorded or folder is None:
        return
    from ..models.artifact_format import is_artifact, manifest_path

    weights = weights_sha256(folder)
    ours = model_names(weights)
    if is_artifact(folder):
        ours |= model_names(None, json.loads(manifest_path(folder).read_text(encoding="utf-8")).get("base_model"))
    if ours and not recorded & ours:
        shown = identity.get("weights_sha256") or next(iter(recorded))
        raise ImatrixError(f"the importance matrix {path} was made for another model (weights sha256 "
                           f"{shown.removeprefix('gguf:')[:12]}..., this model's {(weights or '')[:12]}...): make one "
                           "for this model (or the base it was compressed from) with slmedge imatrix")


# --- making one from a model ------------------------------------------------------------------


def default_output(model: str | None) -> Path:
    import re

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model or "smollm2-135m").name).strip("-") or "model"
    return Path("slmedge-out") / f"{name.removesuffix('.gguf')}.imatrix.gguf"


def check_output(out: Path, overwrite: bool) -> None:
    """Refused before the model loads: a directory, a file slmedge did not write, one without --overwrite."""
    if out.exists():
        if out.is_dir():
            raise OutputExistsError(f"{out} is a directory: an importance matrix is one file; give a path ending in .gguf")
        if read_identity(out) is None:
            raise OutputExistsError(f"{out} is not an importance matrix slmedge wrote; --overwrite only replaces "
                                    "slmedge's own outputs: choose another output")
        if not overwrite:
            raise OutputExistsError(f"{out} exists; pass --overwrite to replace it")
    if out.suffix != ".gguf":
        raise ConfigError(f"-o {out}: llama.cpp's importance-matrix files are GGUF; give a path ending in .gguf")


def check_windows(calibration: dict, spec: str) -> None:
    """Refuse windows that hold more tokens than the calibration text (ConfigError, before the model's
    calibration pass): ``llama-imatrix`` stops when its text runs out, and windows drawn again and again
    from the same tokens would weigh them as if they were that much text."""
    nsamples, seqlen, have = calibration["nsamples"], calibration["seqlen"], calibration["stream_tokens"]
    per = seqlen - int(bool(calibration.get("bos")))  # a window's text tokens (BOS first where the model adds it)
    if nsamples * per > have:
        raise ConfigError(f"--nsamples {nsamples} x --seqlen {seqlen} takes {nsamples * per:,} tokens of text, but "
                          f"calibration '{calibration.get('spec', spec)}' has {have:,}: the windows would repeat it "
                          f"(llama-imatrix stops where its text ends); use --nsamples {max(1, have // per)} or fewer, "
                          "a shorter --seqlen, or more text")


def imatrix_recipe(calibration: str = DEFAULT_CALIBRATION, nsamples: int = 128, seqlen: int = 512, seed: int = 0,
                   batch_size: int = 8):
    """The calibration settings as a recipe, validated as a compression's: the same windows (the same
    seed gives the same token ids as ``slmedge compress``), the same bounds."""
    from ..compress.recipe import Recipe

    return Recipe(method="wanda", sparsity="0.5", calibration=calibration, nsamples=nsamples, seqlen=seqlen,
                  seed=seed, batch_size=batch_size).validate()


def make_imatrix(model: str | None = None, output=None, *, calibration: str = DEFAULT_CALIBRATION, nsamples: int = 128,
                 seqlen: int = 512, seed: int = 0, batch_size: int = 8, data_dir=None, device: str | None = "auto",
                 overwrite: bool = False, trust_remote_code: bool = False, revision: str | None = None,
                 text_field: str = "text", progress=None) -> dict:
    """Compute ``model``'s importance statistics on calibration text (``compress.importance``) and write
    them as llama.cpp's importance matrix at ``output``. Returns a report."""
    import time

    from ..compress.api import check_compress_bounds
    from ..compress.importance import importance_stats
    from ..compress.engine import resolve_device
    from ..data.calibration import load_calibration, read_texts
    from ..fsutil import output_lock
    from ..models.source import SOURCE_DTYPE, load, resolve
    from ..paths import shareable_source

    started = time.perf_counter()
    recipe = imatrix_recipe(calibration, nsamples, seqlen, seed, batch_size)
    out = Path(output) if output is not None else default_output(model)
    check_output(out, overwrite)
    resolve(model, revision, trust_remote_code)  # a missing model is said first
    dev = resolve_device(device)
    check_compress_bounds(model, recipe, revision, dev)
    if not recipe.calibration.startswith("hf:"):
        read_texts(recipe.calibration, data_dir, text_field)
    with output_lock(out):
        check_output(out, overwrite)
        loaded = load(model, revision=revision, trust_remote_code=trust_remote_code, dtype=SOURCE_DTYPE)
        if loaded.arch.gguf is None:  # before any calibration work: llama.cpp would have no tensor names for it
            from ..errors import UnsupportedArchitectureError
            from ..models.architectures import ARCHITECTURES

            written = ", ".join(k for k, a in ARCHITECTURES.items() if a.gguf is not None)
            raise UnsupportedArchitectureError(
                f"architecture '{loaded.arch.model_type}' is not written as GGUF by slmedge, so an importance matrix "
                f"for llama.cpp has no tensor names to use; GGUF architectures: {written}")
        calib = load_calibration(recipe.calibration, loaded.tokenizer, recipe.nsamples, recipe.seqlen, recipe.seed,
                                 data=data_dir, text_field=text_field)
        check_windows(calib.identity, recipe.calibration)
        stats, timings = importance_stats(loaded.model, loaded.arch, calib.tokens, dev, recipe.batch_size,
                                          progress=progress)
        names_hf = gguf_names(loaded.model.config, loaded.arch, stats)
        # the model by its weights' sha256 (what export compares) and, for others, no local path (paths.shareable_source)
        identity = {"base_model": shareable_source(loaded.identity, out.parent), "calibration": calib.identity,
                    "format": "slmedge-imatrix",
                    "weights_sha256": loaded.identity.get("weights_sha256") if loaded.identity.get("kind") in
                    ("hf_dir", "artifact") else weights_sha256(loaded.hf_dir)}
        datasets = [str(calib.identity["spec"])]
        write_imatrix(out, stats, names_hf, chunk_size=recipe.seqlen, chunk_count=recipe.nsamples, datasets=datasets,
                      identity=identity, overwrite=overwrite)
    return {"path": str(out), "entries": len(stats), "tokens": int(calib.tokens.numel()),
            "calibration": calib.identity, "base_model": loaded.identity, "bytes": out.stat().st_size,
            "seconds": round(time.perf_counter() - started, 2), "timings": timings}
