"""The compression recipe: one strict, typed description of what to do, saved with the artifact.

Its fields are the settings: the study file's [[methods]] keys are derived from them
(``slmedge.study.spec``) and a test holds the CLI's options to them, so a new setting is added
here once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .. import limits
from ..errors import ConfigError
from ..limits import LIMITS
from ..data import DEFAULT_CALIBRATION
from ..models.grids import GRIDS
from . import layouts
from .methods import METHODS, get_method
from .quant import QuantSpec
from .sparsity import Sparsity

__all__ = ["DEFAULT_SKIP", "Recipe", "Sparsity"]

DEFAULT_SKIP = ("lm_head", "*embed_tokens*")
AWQ_SEARCH_DTYPES = ("auto", "bfloat16", "float32")
# The settings of the calibration data, read only by a method that reads calibration data.
CALIBRATION_SETTINGS = ("calibration", "nsamples", "seqlen", "seed", "batch_size")
# The uniform grid's settings, read only off llama.cpp's grids: a grid fixes each of them (its codes'
# bits, the weights one scale covers, whether a block has a min), and a budget picks the grids.
UNIFORM_SETTINGS = ("bits", "group_size", "symmetric")
UNIFORM_OPTIONS = "--bits, --group-size, --sym/--asym"


def grid_implies(name: str) -> dict:
    """What llama.cpp grid ``name`` fixes of the uniform grid's settings: the bits of its codes, the
    weights one scale covers (its sub-block) and whether it is symmetric (no min per block)."""
    g = GRIDS[name]
    return {"bits": g.bits, "group_size": g.sub, "symmetric": not g.min}


def _shown(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@dataclass
class Recipe:
    method: str = "awq"
    # Quantization; bits=None means "do not quantize" (pruning methods alone). bits, group_size and
    # symmetric describe the uniform grid (scale and integer zero point per group, min/max scales).
    bits: int | None = 4
    group_size: int = 128
    symmetric: bool = False
    # A llama.cpp grid instead (models.grids: q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, iq4_xs, q3_k, q4_k,
    # q5_k, q6_k): its codes are kept exactly in the GGUF, each block's scale searched by importance
    # (compress.grid_fit); rows its super-blocks do not divide take llama.cpp's fallback grid. With a
    # grid, bits/group_size/symmetric are not used (bits=None still means "do not quantize" for pruners
    # given no grid).
    grid: str | None = None
    # Mixed grids to a budget: average bits per weight of the compressed linears as GGUF stores them
    # (codes, scales, mins), each linear's grid chosen from measured sensitivity (compress.budget).
    bpw: float | None = None
    # The grids a budget may choose among (each, or llama.cpp's fallback where its super-blocks do not
    # divide a linear's rows); None: all of them. E.g. ("q4_k", "q5_k", "q6_k") for K-quants only.
    # Or onnxruntime's MatMulNBits layouts (compress.layouts: "int4-g32", "int8-g128", ...; "onnx": a
    # default set): a budget for ONNX, sizes as the ONNX file stores them, codes on the uniform grid.
    bpw_grids: tuple[str, ...] | None = None
    # Whether the grid's scale search weighs each weight by its input channel's mean square over the
    # calibration tokens. None: the method's own statistics where it has them (GPTQ's Hessian diagonal,
    # AWQ's and Wanda's activations), data-free for RTN and magnitude; true makes RTN calibrate.
    importance: bool | None = None
    # Pruning: a ratio (0.5) or N:M (2:4), given as text or a number; parsed once, on construction.
    sparsity: Sparsity | None = None
    # Calibration.
    calibration: str = DEFAULT_CALIBRATION
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8  # calibration samples per block forward; bounds activation memory
    # Which linears are left alone (fnmatch patterns on module names).
    skip: tuple[str, ...] = DEFAULT_SKIP
    # GPTQ / SparseGPT.
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal (the papers' percdamp)
    block_size: int = 128  # columns processed together; the error is propagated lazily between blocks
    act_order: bool = True  # quantize columns by decreasing Hessian diagonal, with static groups
    # Statistics of later linears see the already-compressed earlier ones. None: the method's
    # reference behaviour (GPTQ, SparseGPT: on; Wanda: off, one pass per block).
    true_sequential: bool | None = None
    # AWQ.
    awq_grid: int = 20  # points of the scale-exponent grid in [0, 1)
    awq_clip: bool = True  # search a clipping ratio per group after scaling
    awq_max_tokens: int = 2048  # tokens the search losses use; SmolLM2 W4g64: 2048 -> ppl 29.72, 8192 -> 29.70 at 2.2x the time
    # What the inspected modules' linears compute in while the search takes its losses: "auto"
    # (bfloat16 where the device multiplies it natively, else float32), "bfloat16" or "float32".
    # The statistics, the scales and the quantization are fp32 whatever it says (methods.awq).
    awq_search_dtype: str = "auto"

    def __post_init__(self):
        self._normalize()

    def _normalize(self) -> None:
        if self.sparsity is not None:
            self.sparsity = Sparsity.parse(self.sparsity)
        if isinstance(self.skip, (list, tuple)):
            self.skip = tuple(self.skip)
        if isinstance(self.bpw_grids, list):
            self.bpw_grids = tuple(self.bpw_grids)

    @property
    def on_grid(self) -> bool:
        """Whether the linears go on llama.cpp's grids (one, or a mix to a budget) rather than the uniform one."""
        return self.grid is not None or self.bpw is not None

    @property
    def on_layouts(self) -> bool:
        """Whether a budget picks among onnxruntime's MatMulNBits layouts (``compress.layouts``) for ONNX."""
        return self.bpw is not None and bool(self.bpw_grids) and all(map(layouts.is_layout_name, self.bpw_grids))

    @property
    def quantizes(self) -> bool:
        return self.bits is not None or self.on_grid

    def quant_spec(self) -> QuantSpec | None:
        """The uniform grid; None when nothing is quantized or the linears go on llama.cpp's grids
        (resolved per linear: ``Method.spec_for``)."""
        if self.bits is None or self.on_grid:
            return None
        return QuantSpec(self.bits, self.group_size, self.symmetric)

    def to_dict(self) -> dict:
        """Plain JSON data (what the artifact's manifest holds); ``from_dict`` reads it back. On
        llama.cpp's grids the uniform grid's settings are left out: they did not shape the codes."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if not (self.on_grid and f.name in UNIFORM_SETTINGS)}
        data["skip"] = list(self.skip)
        data["bpw_grids"] = None if self.bpw_grids is None else list(self.bpw_grids)
        data["sparsity"] = None if self.sparsity is None else self.sparsity.describe()
        return data

    def applied(self) -> dict:
        """The settings that shaped the result: ``to_dict`` less those left unset (None), the uniform
        grid's on llama.cpp's grids or where nothing is quantized, the calibration data's for a method
        that read none, and the settings of the other methods (``Method.settings``). What a GGUF's
        manifest records (the artifact keeps the whole recipe); not for ``from_dict``, which fills
        what is missing with defaults."""
        info = get_method(self.method)
        method = info.cls(self)
        drop = {name for other in METHODS.values() for name in other.cls.settings} - set(info.cls.settings)
        if self.on_grid or not self.quantizes:
            drop.update(UNIFORM_SETTINGS)
        if not method.needs_calibration:
            drop.update(CALIBRATION_SETTINGS)
        if method.block_level or method.stats_class is None:  # no per-linear statistics to collect in order
            drop.add("true_sequential")
        return {k: v for k, v in self.to_dict().items() if v is not None and k not in drop}

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        data = dict(data)
        # Recipes saved by earlier versions carry ``extra``, a table nothing ever read (since
        # removed): empty, it is dropped; with anything in it, it is refused like any unknown key.
        if data.get("extra", None) == {}:
            del data["extra"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown recipe keys: {', '.join(unknown)}")
        return cls(**data)

    def validate(self, given=None) -> "Recipe":
        """Check every setting before any work starts; raise ConfigError with the reason.

        ``given``: the names of the settings the user gave (a CLI's options given on its command line,
        a study file's keys); None: those whose value is not their default (or None). A uniform-grid
        setting given beside a grid or a budget is refused unless it is what the grid fixes
        (``check_given``); on a grid those settings are then reset to their defaults, unused."""
        self._normalize()
        info = get_method(self.method)
        if self.bits is not None:
            limits.check("bits", self.bits)
            if not self.on_grid:
                self.quant_spec()
        self._validate_grid(info)
        self.check_given(given)
        spars = self.sparsity
        if info.kind == "quantize":
            if spars is not None and spars.ratio > 0:
                pruners = ", ".join(k for k, v in METHODS.items() if v.kind == "prune")
                raise ConfigError(f"{self.method} quantizes and does not prune; for sparsity use one of: {pruners}")
            if not self.quantizes:
                raise ConfigError(f"{self.method} needs a bit width (--bits 2..8) or a grid (--grid)")
        else:
            if spars is None:
                raise ConfigError(f"{self.method} prunes: give --sparsity (a ratio such as 0.5, or N:M such as 2:4)")
        # The group size is checked whether or not this recipe quantizes (a pruning recipe records
        # it too); against the model's layer widths in ``api.check_compatible``.
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or \
                not LIMITS["group_size"].contains(self.group_size):
            raise ConfigError(f"group size must be {LIMITS['group_size'].describe()}, got {self.group_size!r}")
        # Every count and length in its declared range (slmedge/limits.py says why each ends where it does).
        for name in ("nsamples", "seqlen", "batch_size", "block_size", "awq_grid", "awq_max_tokens", "damp"):
            limits.check(name, getattr(self, name))
        for name in ("symmetric", "act_order", "awq_clip", "true_sequential"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "true_sequential" and value is None):
                raise ConfigError(f"{name} must be true or false, got {value!r}")
        if self.awq_search_dtype not in AWQ_SEARCH_DTYPES:
            raise ConfigError(f"awq_search_dtype must be one of {', '.join(AWQ_SEARCH_DTYPES)}, got {self.awq_search_dtype!r}")
        if not isinstance(self.skip, tuple) or not all(isinstance(p, str) for p in self.skip):
            raise ConfigError(f"skip must be a list of module-name patterns, got {self.skip!r}")
        if not isinstance(self.calibration, str) or not self.calibration.strip():
            raise ConfigError(f"calibration must be a name, a file or hf:DATASET, got {self.calibration!r}")
        # Negative seeds are refused: random.Random(-n) draws the same windows as Random(n), so
        # -1 and 1 would share their calibration; torch's generator takes at most 64 bits.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not LIMITS["seed"].contains(self.seed):
            raise ConfigError(f"seed must be a non-negative integer (below 2**64), got {self.seed!r}")
        return self

    def check_given(self, given=None) -> None:
        """Refuse (ConfigError, one line naming both settings) a uniform-grid setting given beside a
        grid whose own value differs, or beside a bits-per-weight budget (which picks each linear's
        grid); a given value equal to the grid's is harmless. On a grid the uniform settings are then
        reset to their defaults: what the recipe records is what shaped the codes."""
        if not self.on_grid:
            return
        defaults = {f.name: f.default for f in fields(self) if f.name in UNIFORM_SETTINGS}
        if given is None:
            given = [n for n in UNIFORM_SETTINGS if getattr(self, n) is not None and getattr(self, n) != defaults[n]]
        fixed = f"a grid fixes the bits, the group size and the symmetry ({UNIFORM_OPTIONS}); give one or the other"
        for name in (n for n in UNIFORM_SETTINGS if n in set(given)):
            value = getattr(self, name)
            if value is None:
                continue
            if self.grid is None:
                raise ConfigError(f"{name} {_shown(value)} contradicts bpw {self.bpw:g}: a budget picks each "
                                  f"linear's grid, and {fixed}")
            own = grid_implies(self.grid)[name]
            if value != own:
                fact = {"bits": f"codes are {own}-bit", "group_size": f"scales cover {own} weights each",
                        "symmetric": "blocks have no min (symmetric)" if own else "blocks have a min (asymmetric)"}[name]
                raise ConfigError(f"{name} {_shown(value)} contradicts grid {self.grid}, whose {fact}: {fixed}")
        for name, value in defaults.items():
            setattr(self, name, value)

    def _validate_grid(self, info) -> None:
        if self.grid is not None:
            if not isinstance(self.grid, str) or self.grid not in GRIDS:
                raise ConfigError(f"unknown grid {self.grid!r}; choose one of: {', '.join(GRIDS)}")
            if self.bpw is not None:
                raise ConfigError("give a grid or a bits-per-weight budget (bpw), not both: a budget picks each "
                                  "linear's grid")
        if self.bpw is not None:
            limits.check("bpw", self.bpw)  # the range of llama.cpp's grids (tests/test_grids.py holds them equal)
        if self.bpw_grids is not None:
            names = self.bpw_grids
            if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                shown = list(names) if isinstance(names, tuple) else names
                raise ConfigError(f"bpw_grids (--bpw-grids) must be grid names, got {shown!r}")
            if not names:
                raise ConfigError(f"bpw_grids (--bpw-grids) names no grid: give some of {', '.join(GRIDS)}, "
                                  f"or ONNX layouts ({layouts.FORM}; {layouts.ALIAS}: all), comma-separated")
            onnx = [n for n in names if layouts.is_layout_name(n)]
            if onnx and len(onnx) < len(names):
                other = next(n for n in names if not layouts.is_layout_name(n))
                raise ConfigError(f"bpw_grids mixes ONNX layouts ({onnx[0]}) and llama.cpp grids ({other}): a budget "
                                  "is for one format; give layouts for ONNX or grids for GGUF")
            if onnx:
                names = self.bpw_grids = layouts.layout_names(names)  # canonical spelling; ConfigError if unknown
            unknown = [n for n in names if n not in GRIDS and not onnx]
            if unknown:
                raise ConfigError(f"bpw_grids: unknown grid {unknown[0]!r}; choose among: {', '.join(GRIDS)} "
                                  f"(or ONNX layouts: {layouts.FORM})")
            if len(set(names)) != len(names):
                raise ConfigError(f"bpw_grids names a grid twice: {', '.join(names)}")
            if self.bpw is None:
                raise ConfigError("bpw_grids names the grids a bits-per-weight budget may choose among: give the "
                                  "budget too (--bpw)")
        if self.importance is not None and not isinstance(self.importance, bool):
            raise ConfigError(f"importance must be true or false, got {self.importance!r}")
        if self.importance and not self.on_grid:
            raise ConfigError("importance weighting searches the scales of llama.cpp's grids (--grid or --bpw); "
                              "the uniform grid (--bits/--group-size) takes min/max scales")
        if self.on_grid and info.kind == "prune":
            from ..models.grids import get_grid

            zero = [n for n, g in GRIDS.items() if g.has_zero]
            if self.grid is not None and not get_grid(self.grid).has_zero:
                raise ConfigError(f"{self.method} prunes, and pruned weights must stay exactly zero: grid {self.grid} "
                                  f"has no zero level; choose one of: {', '.join(zero)}")
            if self.bpw is not None:
                raise ConfigError(f"{self.method} prunes: a bits-per-weight budget mixes grids without a zero level; "
                                  f"give a grid with one ({', '.join(zero)})")

    def describe(self) -> str:
        parts = [self.method]
        if self.grid is not None:
            parts.append(f"grid {self.grid}")
        elif self.bpw is not None:
            parts.append(f"{self.bpw:g} bpw mix" + (f" of {'/'.join(self.bpw_grids)}" if self.bpw_grids else ""))
        elif self.bits is not None:
            parts.append(self.quant_spec().describe())
        if self.sparsity is not None:
            parts.append(f"sparsity {self.sparsity.describe()}")
        return " ".join(parts)
