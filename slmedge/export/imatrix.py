"""llama.cpp's importance-matrix file: written from slmedge's calibration statistics, read for its quantizer.

The format is the one ``llama-imatrix`` writes and ``llama-quantize --imatrix`` reads (llama.cpp's
tools/imatrix/imatrix.cpp and common/imatrix-loader.cpp): a GGUF file with ``general.type =
"imatrix"``, the keys ``imatrix.datasets`` (strings), ``imatrix.chunk_count`` and
``imatrix.chunk_size`` (u32; ``llama-quantize`` refuses a file without all three), and per weight
tensor two F32 tensors named after the model's GGUF tensor: ``<name>.in_sum2`` (the sum over tokens of
each input column's squared value) and ``<name>.counts`` (the number of tokens). The quantizer uses
``in_sum2 / counts`` per column. The legacy ``.dat`` format is not written.

slmedge's own file also carries ``slmedge.imatrix`` (a JSON identity: model, calibration), which is
how ``--overwrite`` knows the file is slmedge's to replace.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..data import DEFAULT_CALIBRATION
from ..errors import OutputExistsError
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
        writer.add_string(KEY, json.dumps(identity, sort_keys=True))
        for hf in sorted(stats, key=lambda n: names[n]):  # llama-imatrix writes the names sorted
            st = stats[hf]
            writer.add_tensor(names[hf] + SUM2, st.sum2.numpy().astype(np.float32).reshape(1, -1))
            writer.add_tensor(names[hf] + COUNTS, np.array([[float(st.count)]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
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
    ``llama-quantize`` does (a column group with a zero count weighs 1). Refuses, naming the file, what
    ``llama-quantize`` would refuse: not GGUF, no entries, a sum without its count, other than F32, or
    the metadata keys missing."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise ImatrixError(f"importance matrix {p} does not exist")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as exc:  # noqa: BLE001 - the gguf reader raises plain errors for other files
        raise ImatrixError(f"{p} is not an importance matrix in llama.cpp's GGUF format ({exc}); "
                           "the legacy .dat format is not read: convert it with llama-imatrix --in-file") from exc
    missing = [k for k in (DATASETS, CHUNK_COUNT, CHUNK_SIZE) if k not in reader.fields]
    if missing:
        raise ImatrixError(f"{p} lacks the importance-matrix keys {', '.join(missing)} (llama-quantize refuses it too)")
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
    values = {}
    for name, s in sums.items():
        c = np.rint(counts[name])  # llama.cpp reads the counts with lround
        per = s.reshape(len(c), -1)
        values[name] = np.where(c[:, None] > 0, per / np.where(c > 0, c, 1)[:, None], 1.0).astype(np.float32).reshape(-1)

    def field(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data] if key == DATASETS else int(f.parts[f.data[0]][0])

    meta = {"datasets": field(DATASETS), "chunk_count": field(CHUNK_COUNT), "chunk_size": field(CHUNK_SIZE),
            "entries": len(values), "slmedge": read_identity(p)}
    return values, meta


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
        from ..errors import ConfigError

        raise ConfigError(f"-o {out}: llama.cpp's importance-matrix files are GGUF; give a path ending in .gguf")


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
        stats, timings = importance_stats(loaded.model, loaded.arch, calib.tokens, dev, recipe.batch_size,
                                          progress=progress)
        names_hf = gguf_names(loaded.model.config, loaded.arch, stats)
        identity = {"base_model": loaded.identity, "calibration": calib.identity, "format": "slmedge-imatrix"}
        datasets = [str(calib.identity["spec"])]
        write_imatrix(out, stats, names_hf, chunk_size=recipe.seqlen, chunk_count=recipe.nsamples, datasets=datasets,
                      identity=identity, overwrite=overwrite)
    return {"path": str(out), "entries": len(stats), "tokens": int(calib.tokens.numel()),
            "calibration": calib.identity, "base_model": loaded.identity, "bytes": out.stat().st_size,
            "seconds": round(time.perf_counter() - started, 2), "timings": timings}
