"""The transports an evaluation can run through, registered where they are defined.

``@register_transport("ssh")`` on a :class:`~slmedge.targets.transports.Transport` subclass makes
it the way to reach every profile with ``transport = "ssh"``. Each transport class says what the
rest of slmedge asks: whether it runs runtimes in this process (and so torch too), on which torch
device, whether its timings are emulated, which runtimes a profile gets by default, what a
profile of its kind must hold, and how to open a runtime there. Nothing else compares transport
names. The built-in transports register when ``slmedge.targets`` is imported.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..registry import Registry

TRANSPORTS: Registry = Registry("transport")  # name -> Transport subclass


def register_transport(name: str):
    """Class decorator: register a Transport subclass under ``name`` (a duplicate name is refused)."""

    def wrap(cls):
        TRANSPORTS.add(name, cls, cls.__qualname__)
        cls.kind = name
        return cls

    return wrap


def unregister_transport(name: str) -> None:
    """Remove a registration (for plug-ins registered by tests)."""
    TRANSPORTS.remove(name)


def transport_names() -> list[str]:
    return list(TRANSPORTS)


def transport_class(name: str) -> type:
    if name not in TRANSPORTS:
        raise ConfigError(f"transport '{name}' is not one of {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]


def transport_for(profile):
    """The transport that reaches ``profile``'s target."""
    return transport_class(profile.transport)(profile)
