"""Model files that carry code are refused before any library reads them.

A model folder is other people's files, and some of their fields make transformers fetch or run code:
``auto_map`` (classes from a ``*.py`` beside the weights or in another Hub repository), a
``trust_remote_code`` key, ``custom_pipelines``, and an attention or experts implementation naming a
kernel repository (``"kernels-community/..."``): transformers 4.56-5.2 downloaded and ran such a kernel
with ``trust_remote_code=False`` (CVE-2026-4372), and later releases still fetch kernels for some
values (a ``flash_attention_*`` that is not installed). slmedge chooses the attention itself, so a
file's choice is refused unless it is one of the plain built-in implementations.

:func:`refuse_code` reads the JSON files transformers reads (configs, tokenizer and generation
configs), every nested configuration included (``text_config``, ``vision_config``...), and raises
:class:`~slmedge.errors.RemoteCodeError` naming the file and the field, unless the user passed
``--trust-remote-code``. It is called wherever a model folder enters slmedge (``models.source.resolve``
and ``load``, the GGUF import, the study's models), before transformers sees the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RemoteCodeError

# The files of a model folder transformers reads configuration from.
FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "processor_config.json",
         "preprocessor_config.json", "special_tokens_map.json", "chat_template.json", "adapter_config.json")
# Keys whose presence alone means code: classes to import, or permission to.
CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
# Keys naming an implementation transformers may fetch as a Hub kernel; the values allowed from a file.
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")
BUILTIN_ATTENTION = frozenset({"eager", "sdpa", "flex_attention"})
EXPERTS_KEYS = ("experts_implementation", "_experts_implementation", "_experts_implementation_internal")
BUILTIN_EXPERTS = frozenset({"eager", "grouped_mm", "batched_mm"})

HOW_TO_ALLOW = "slmedge runs no code from model files; pass --trust-remote-code only if you trust its authors"


def code_fields(value, path: str = "") -> list[tuple[str, str]]:
    """(field path, why) for every field of a parsed JSON ``value`` that names code to fetch or run."""
    found: list[tuple[str, str]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in CODE_KEYS:
                found.append((where, "names code to import or allows running it"))
            elif key in ATTENTION_KEYS + EXPERTS_KEYS and item is not None:
                allowed = BUILTIN_ATTENTION if key in ATTENTION_KEYS else BUILTIN_EXPERTS
                for name, choice in (item.items() if isinstance(item, dict) else [("", item)]):
                    if choice is not None and choice not in allowed:
                        sub = f"{where}.{name}" if name else where
                        found.append((sub, f"is {choice!r}, not one of the built-in implementations "
                                           f"({', '.join(sorted(allowed))}): transformers may fetch it as a Hub kernel"))
            found.extend(code_fields(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.extend(code_fields(item, f"{path}[{i}]"))
    return found


def refuse_config(config: dict, where: str, trust_remote_code: bool = False) -> None:
    """Refuse a parsed configuration ``config`` (read from ``where``) that names code, unless trusted."""
    if trust_remote_code:
        return
    found = code_fields(config)
    if found:
        field, why = found[0]
        more = f" (and {len(found) - 1} more field(s))" if len(found) > 1 else ""
        hint = ""
        from .architectures import ARCHITECTURES

        if field.split(".")[0] == "auto_map" and config.get("model_type") in ARCHITECTURES:
            # Phi-3 and others still ship their original code although transformers has their architecture.
            hint = (f" (its architecture, {config['model_type']}, is built into transformers: delete auto_map from "
                    "a copy of the folder to load it with transformers' own code)")
        raise RemoteCodeError(f"{where}: the field {field} {why}{more}; {HOW_TO_ALLOW}{hint}")


def refuse_code(folder, trust_remote_code: bool = False) -> None:
    """Refuse a model folder one of whose configuration files names code, before anything else reads it.
    A file that is not JSON is left to the reader that needs it (it says what is wrong with it)."""
    if trust_remote_code:
        return
    folder = Path(folder)
    for name in FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        refuse_config(config, str(path), trust_remote_code)
