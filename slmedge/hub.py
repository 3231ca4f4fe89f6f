"""Whether the Hugging Face Hub can be reached, asked once per process and in a couple of seconds,
so that a command that would fetch from the Hub offline says so at once instead of after the hub
libraries' retries. Standard library only: the data layer (Hub calibration sets) and the model layer
(Hub model ids) both ask it."""

from __future__ import annotations

import os

HUB_CHECK_TIMEOUT_S = 2.0
_hub_reachable: dict[tuple[str, int], bool] = {}  # (host, port) -> answered; asked once per process


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline_setting() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for no network."""
    return _env_on("HF_HUB_OFFLINE") or _env_on("TRANSFORMERS_OFFLINE")


def _hub_address() -> tuple[str, int]:
    """Where a Hub request would connect first: the HTTPS proxy when one is set, else the Hub
    endpoint (HF_ENDPOINT, default https://huggingface.co)."""
    from urllib.parse import urlsplit

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        proxy = os.environ.get(var, "").strip()
        if proxy:
            u = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if u.hostname:
                return u.hostname, u.port or (443 if u.scheme == "https" else 80)
    u = urlsplit(os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co")
    return u.hostname or "huggingface.co", u.port or (80 if u.scheme == "http" else 443)


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """Whether the Hub (or the proxy in front of it) takes a TCP connection within ``timeout``
    seconds, name lookup included; asked once per process and address."""
    import socket
    import threading

    address = _hub_address()
    if address not in _hub_reachable:
        answered: list[bool] = []

        def attempt() -> None:
            try:
                with socket.create_connection(address, timeout=timeout):
                    answered.append(True)
            except OSError:
                pass

        probe = threading.Thread(target=attempt, daemon=True)  # a name lookup that hangs is not waited for
        probe.start()
        probe.join(timeout)
        _hub_reachable[address] = bool(answered)
    return _hub_reachable[address]
