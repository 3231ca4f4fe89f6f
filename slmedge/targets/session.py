"""What a model needs of a target before anything is copied: its bytes (and KV cache) against the
target's RAM."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TargetError

if TYPE_CHECKING:
    from .profiles import Profile


class TooLargeForTargetError(TargetError):
    """The model (and its KV cache) would not fit the target's RAM."""


def model_bytes(path: Path) -> int:
    p = Path(path)
    if p.is_dir():
        return sum(q.stat().st_size for q in p.iterdir() if q.is_file())
    from ..export.formats import format_for_path, get_format

    fmt = format_for_path(p)
    return sum(q.stat().st_size for q in (get_format(fmt).model_files(p) if fmt else [p]))


def check_fits(profile: Profile, path: Path, kv_bytes: int | None = None) -> None:
    if not profile.ram_gb:
        return
    need = model_bytes(path) + (kv_bytes or 0)
    have = profile.ram_gb * (1 << 30)
    # The runtime, Python and the OS need room too: refuse above 90% of the RAM.
    if need > 0.9 * have:
        raise TooLargeForTargetError(
            f"{Path(path).name} needs {need / (1 << 30):.2f} GiB ({model_bytes(path) / (1 << 30):.2f} GiB of weights"
            + (f" + {kv_bytes / (1 << 30):.2f} GiB of KV cache" if kv_bytes else "")
            + f"), more than 90% of target '{profile.name}''s {profile.ram_gb:g} GiB RAM; nothing was copied")
