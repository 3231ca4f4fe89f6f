"""slmedge targets: list, show, check and set up the places an evaluation can run."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Column

from .common import Table, bounded, console, errors_to_exit

targets_app = typer.Typer(help="Target profiles: list, show, check, setup.", no_args_is_help=True,
                          rich_markup_mode=None)


def _num(v, unit="") -> str:
    return "-" if not v else f"{v:g}{unit}"


@targets_app.command("list")
def list_command(wide: bool = typer.Option(False, "--wide", help="Also the runtimes and the description of each "
                                           "profile (wider than 80 columns).")):
    """List the target profiles (targets/*.toml, ~/.config/slmedge/targets, $SLMEDGE_TARGETS).

    Figures marked "auto" are this machine's, detected and measured the first time they are
    needed (`slmedge targets show cpu`).

    \b
    Examples:
      slmedge targets list
      slmedge targets list --wide
    """
    from ..targets.profiles import all_profiles

    with errors_to_exit():
        profiles = all_profiles()
    # Fits 80 columns: the figures a roofline uses; the rest under --wide or `targets show`.
    t = Table(Column("name", no_wrap=True), "transport", "arch", Column("cores", justify="right"),
              Column("RAM GiB", justify="right"), Column("GB/s", justify="right"),
              Column("GFLOP/s fp32", justify="right"))
    if wide:
        t.add_column("runtimes", overflow="fold")
        t.add_column("description", overflow="fold")
    for p in profiles.values():
        auto = "auto" if p.detect else None
        row = [p.name, p.transport, p.arch, auto or _num(p.cores), auto or _num(p.ram_gb),
               auto or _num(p.memory_bandwidth_gbs), auto or _num(p.peak_fp32_gflops)]
        if wide:
            row += [", ".join(p.runtimes), p.description]
        t.add_row(*row)
    # --wide: the table at its own width (a wide terminal shows it whole; a narrow one wraps lines).
    natural = console.measure(t, options=console.options.update(max_width=1000)).maximum
    (Console(width=max(console.width, natural)) if wide else console).print(t)
    console.print("details: slmedge targets show NAME (--wide: runtimes and descriptions); your own: a .toml file "
                  "in ~/.config/slmedge/targets")


@targets_app.command("show")
@bounded(context="context")
def show_command(name: str = typer.Argument(..., help="Target name or .toml file."),
                 model: Optional[str] = typer.Option(None, "--model", help="A .gguf/.onnx/.pte file (or an "
                                                     "export folder): project its decode and prefill rooflines on "
                                                     "this target."),
                 context: Optional[int] = typer.Option(None, "--context", help="Tokens in the KV cache for the "
                                                       "projection (default: 640, or the model's positions where "
                                                       "it has fewer)."),
                 as_json: bool = typer.Option(False, "--json", help="Print JSON."),
                 remeasure: bool = typer.Option(False, "--remeasure", help="cpu/cuda: measure bandwidth and "
                                                "compute again (run it with the machine otherwise idle).")):
    """Show one profile (the cpu profile with this machine's measured bandwidth and compute),
    and optionally a model's roofline projection on it.

    \b
    Examples:
      slmedge targets show cpu
      slmedge targets show raspberry-pi-5 --model model.gguf
    """
    from ..targets.profiles import get_profile, profile_dict

    with errors_to_exit():
        if remeasure:
            from ..paths import cache_dir

            for f in ("cpu-measured.json", "cuda-measured.json"):
                (cache_dir() / "targets" / f).unlink(missing_ok=True)
        prof = get_profile(name)
        data = profile_dict(prof)
        if model:
            data["projection"] = _projection(prof, model, context)
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    t = Table("field", Column("value", overflow="fold"), title=f"target {prof.name}")
    for k, v in data.items():
        if k != "projection" and v not in (None, "", [], {}):
            t.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    console.print(t)
    if model:
        p = data["projection"]
        t = Table("bound", "tokens/s", title=f"{p['model']} on {prof.name}: {p['label']}")
        if p.get("decode_bound_tps"):
            t.add_row(f"decode ({p['decode_bytes_per_token'] / 1e6:.1f} MB/token)", f"{p['decode_bound_tps']:.1f}")
        if p.get("prefill_bound_tps"):
            t.add_row(f"prefill ({p['prefill_peak']})", f"{p['prefill_bound_tps']:.1f}")
        console.print(t)


# The projection's default context: llama-bench's 512 prompt tokens and 128 generated ones.
DEFAULT_PROJECTION_CONTEXT = 640


def _projection(prof, model: str, context: int | None) -> dict:
    from pathlib import Path

    from ..errors import ConfigError, ModelNotFoundError
    from ..evaluate.system import kv_cache_bytes
    from ..export.formats import FORMATS, format_for_path, get_format
    from ..runtimes.registry import RUNTIMES
    from ..targets.roofline import roofline, set_against
    from ..targets.session import model_bytes

    path = Path(model)
    if not path.exists():  # a missing input (exit 1), not a bad setting
        raise ModelNotFoundError(f"--model {model} does not exist")
    fmt = format_for_path(path)
    if fmt is None or get_format(fmt).model_facts is None:
        takes = " or ".join(f.suffix for f in FORMATS.values() if f.model_facts is not None and f.suffix)
        raise ConfigError(f"--model takes a model file ({takes}) or an export folder holding one; {model} is not one")
    path = get_format(fmt).model_file(path)  # an export folder: the file its runtime opens
    from ..limits import check_length
    from ..models.shape import path_shape

    shape = path_shape(path)  # the context against the model's positions, before its facts are read
    positions = shape.positions if shape is not None else None
    if context is None:  # the default never asks more than the model has
        context = min(DEFAULT_PROJECTION_CONTEXT, positions) if positions else DEFAULT_PROJECTION_CONTEXT
    elif shape is not None:
        check_length("--context", context, positions, shape.positions_from)
    facts = get_format(fmt).model_facts(path)
    params, integer = facts.get("params"), bool(facts.get("quantized"))
    # The KV cache in the element size of the runtime that runs this format (llama.cpp: f16).
    runtime = next((s for s in RUNTIMES.values() if s.export_format == fmt), None)
    kv = kv_cache_bytes(facts.get("config") or {}, 1, runtime.kv_bytes_per_value if runtime else 4)
    # a static KV cache (an ExecuTorch program's) is read whole at every decode step, whatever --context says
    bounds = roofline(prof, model_bytes(path), kv, params, facts.get("kv_positions") or context, integer)
    out = set_against(bounds, None, None, measured=False)
    out["model"] = path.name
    return out


@targets_app.command("check")
def check_command(name: str = typer.Argument(..., help="Target name or .toml file.")):
    """Check that a target is reachable and has what it needs (with a fix for what is missing).

    \b
    Examples:
      slmedge targets check arm64
      slmedge targets check cuda
    """
    from ..targets.profiles import get_profile
    from ..targets.transports import transport_for

    with errors_to_exit():
        prof = get_profile(name)
        checks = transport_for(prof).checks()
    t = Table("check", "ok", Column("detail", overflow="fold"), Column("fix", overflow="fold"),
              title=f"target {prof.name} ({prof.transport})")
    for c in checks:
        t.add_row(c.what, "yes" if c.ok else "NO", c.detail, c.hint)
    console.print(t)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@targets_app.command("setup")
def setup_command(name: str = typer.Argument(..., help="An emulated target (arm64)."),
                  rebuild: bool = typer.Option(False, "--rebuild", help="Start from nothing."),
                  no_llama_cpp: bool = typer.Option(False, "--no-llama-cpp", help="Skip the llama.cpp cross build."),
                  if_needed: bool = typer.Option(False, "--if-needed", help="Do nothing when the environment "
                                                 "is already built for this slmedge and llama-cpp-python.")):
    """Build an emulated target's environment once into the user cache: qemu, an aarch64 Python,
    onnxruntime and an aarch64 build of llama.cpp.

    \b
    Example:
      slmedge targets setup arm64
    """
    from ..targets.profiles import get_profile
    from ..targets.registry import transport_for

    with errors_to_exit():
        transport = transport_for(get_profile(name))
        if if_needed and transport.is_set_up():
            console.print(f"target {transport.profile.name}: environment already built")
            return
        m = transport.setup(log=lambda msg: console.print(f"setup: {msg}", markup=False, highlight=False),
                            rebuild=rebuild, llama_cpp=not no_llama_cpp)
    v = m.get("versions", {})
    engines = ", ".join(f"{name} {v.get(name)}" for name in m.get("runtimes", ("onnxruntime", "llama.cpp")))
    console.print(f"ready: Python {v.get('python')} on {v.get('machine')} (emulated {m['qemu_cpu']}), "
                  f"{engines} — {m['seconds']:.0f} s")
