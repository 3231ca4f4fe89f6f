"""Target profiles: one TOML file per target (``targets/*.toml`` in the repository, the user's
``~/.config/slmedge/targets`` and ``$SLMEDGE_TARGETS``; a later folder's file of the same name
wins).

    name = "raspberry-pi-5"
    transport = "ssh"            # local | emulated | ssh | cuda
    arch = "aarch64"
    cores = 4
    threads = 4
    ram_gb = 8
    memory_bandwidth_gbs = 17.1  # peak DRAM bandwidth (decode roofline)
    peak_fp32_gflops = 76.8      # prefill roofline, float models
    peak_int8_gops = 307.2       # prefill roofline, integer-kernel models
    runtimes = ["llama.cpp", "onnxruntime"]
    [ssh]  host = "pi5.local" ...

Files are validated strictly: an unknown key or a wrong type is an error naming the file.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import ConfigError, TargetError  # noqa: F401 - TargetError is imported from here too
from ..runtimes.registry import runtime_names
from .registry import transport_class, transport_names

TARGETS_ENV = "SLMEDGE_TARGETS"


class UnknownTargetError(ConfigError):
    """No profile of that name."""


@dataclass
class SshSettings:
    host: str = ""
    user: str = ""
    port: int = 22
    key: str = ""  # private key file; empty: ssh's defaults / agent
    known_hosts: str = ""  # empty: ~/.ssh/known_hosts
    python: str = "python3"
    workdir: str = ".cache/slmedge-runner"  # relative to the remote home
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 3600.0


@dataclass
class Profile:
    name: str
    transport: str
    description: str = ""
    arch: str = "x86_64"
    cores: int = 0
    threads: int = 0
    ram_gb: float = 0.0
    memory_bandwidth_gbs: float = 0.0
    peak_fp32_gflops: float = 0.0
    peak_int8_gops: float = 0.0
    runtimes: list[str] = field(default_factory=runtime_names)
    default_runtime: str = ""
    detect: bool = False  # cpu: cores, RAM, bandwidth and compute measured on this machine
    qemu_cpu: str = ""  # emulated: the CPU model qemu emulates
    gpu_layers: int = -1  # cuda: llama.cpp layers offloaded (-1: all)
    source: str = ""  # where the published figures come from
    ssh: SshSettings | None = None
    file: str = ""
    measured: dict = field(default_factory=dict)

    @property
    def emulated(self) -> bool:
        return transport_class(self.transport).emulated


_TYPES = {"name": str, "transport": str, "description": str, "arch": str, "cores": int, "threads": int,
          "ram_gb": (int, float), "memory_bandwidth_gbs": (int, float), "peak_fp32_gflops": (int, float),
          "peak_int8_gops": (int, float), "runtimes": list, "default_runtime": str, "detect": bool, "qemu_cpu": str,
          "gpu_layers": int, "source": str, "ssh": dict}
_SSH_TYPES = {"host": str, "user": str, "port": int, "key": str, "known_hosts": str, "python": str, "workdir": str,
              "connect_timeout_s": (int, float), "command_timeout_s": (int, float)}


# The numbers a profile may set -> their range in slmedge/limits.py (the key there). A number left
# out is "not known": detected on a detecting profile, no roofline projection otherwise; one given
# must be finite, positive and below its ceiling (a nan or 1e308 bandwidth gave "nan" and "inf"
# tokens/s projections).
_LIMITS = {"cores": "cores", "threads": "profile_threads", "ram_gb": "ram_gb",
           "memory_bandwidth_gbs": "memory_bandwidth_gbs", "peak_fp32_gflops": "peak_fp32_gflops",
           "peak_int8_gops": "peak_int8_gops", "gpu_layers": "gpu_layers"}
_SSH_LIMITS = {"port": "port", "connect_timeout_s": "connect_timeout_s", "command_timeout_s": "command_timeout_s"}


def _check_ranges(table: dict, keys: dict, where: str) -> None:
    from ..limits import check

    for key, limit in keys.items():
        if key in table:
            try:
                check(limit, table[key], key)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None


def _check(table: dict, types: dict, where: str) -> None:
    for key, value in table.items():
        if key not in types:
            raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(types)})")
        want = types[key]
        if isinstance(value, bool) and want is not bool or not isinstance(value, want):
            name = want.__name__ if isinstance(want, type) else "number"
            raise ConfigError(f"{where}: '{key}' must be a {name}, got {value!r}")


def parse_profile(path: Path) -> Profile:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read target profile {path}: {exc}") from exc
    where = str(path)
    _check(data, _TYPES, where)
    data.setdefault("name", Path(path).stem)
    if "transport" not in data:
        raise ConfigError(f"{where}: 'transport' is required ({' | '.join(transport_names())})")
    if data["transport"] not in transport_names():
        raise ConfigError(f"{where}: transport '{data['transport']}' is not one of {', '.join(transport_names())}")
    bad = [r for r in data.get("runtimes", []) if r not in runtime_names()]
    if bad:
        raise ConfigError(f"{where}: unknown runtime '{bad[0]}' (known: {', '.join(runtime_names())})")
    ssh = data.pop("ssh", None)
    if ssh is not None:
        _check(ssh, _SSH_TYPES, f"{where} [ssh]")
        _check_ranges(ssh, _SSH_LIMITS, f"{where} [ssh]")
        data["ssh"] = SshSettings(**ssh)
    _check_ranges(data, _LIMITS, where)
    if data.get("threads") and data.get("cores") and data["threads"] > data["cores"]:
        raise ConfigError(f"{where}: threads = {data['threads']} is more than its cores = {data['cores']}")
    transport_class(data["transport"]).check_profile(data, where)
    prof = Profile(**data, file=str(path))
    if prof.threads == 0:
        prof.threads = prof.cores
    return prof


def profile_dirs() -> list[Path]:
    """Folders searched for profiles, lowest priority first."""
    shipped = Path(__file__).resolve().parent / "shipped"  # the repository's targets/ links here
    user = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "slmedge" / "targets"
    extra = [Path(p).expanduser() for p in os.environ.get(TARGETS_ENV, "").split(os.pathsep) if p]
    return [shipped, user, *extra]


def all_profiles(broken: dict | None = None) -> dict[str, Profile]:
    """Every profile by name. ``broken``: collect a profile that cannot be read there (its file's
    stem -> the error) instead of raising, so one bad file does not hide the others."""
    found: dict[str, Profile] = {}
    for d in profile_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.toml")):
                try:
                    prof = parse_profile(f)
                except ConfigError as exc:
                    if broken is None:
                        raise
                    broken[f.stem] = exc
                    continue
                found[prof.name] = prof
    return found


def get_profile(name: str, detect: bool = True) -> Profile:
    """The profile ``name`` (or a .toml file); ``detect``: fill a detecting profile from this machine."""
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        prof = parse_profile(p)
    else:
        broken: dict = {}
        profiles = all_profiles(broken)
        if name not in profiles and name in broken:
            raise broken[name]  # the profile asked for is the one that cannot be read: say why
        if name not in profiles:
            raise UnknownTargetError(f"unknown target '{name}'; known: {', '.join(sorted(profiles)) or 'none'} "
                                     f"(profiles are read from {', '.join(str(d) for d in profile_dirs())})")
        prof = profiles[name]
    if prof.detect and detect:
        transport_class(prof.transport)(prof).detect()
    return prof


def profile_dict(prof: Profile) -> dict:
    out = {f.name: getattr(prof, f.name) for f in fields(prof) if f.name != "ssh"}
    if prof.ssh is not None:
        out["ssh"] = dict(prof.ssh.__dict__)
    return out

