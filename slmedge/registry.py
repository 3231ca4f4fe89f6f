"""One kind of registry for every kind of plug-in (runtimes, transports, export formats, metrics):
a name -> entry mapping that refuses a second entry under a name it already holds."""

from __future__ import annotations


class Registry(dict):
    """``kind`` names what it holds in messages ("runtime", "transport"...). Iterates in
    registration order, which is the order lists of them are shown in."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, entry, what: str = "", taken: set[str] | None = None):
        """Register ``entry`` as ``name``; ``taken``: further names already in use (aliases)."""
        if name in self or (taken is not None and name in taken):
            raise ValueError(f"{self.kind} '{name}' registered twice" + (f" ({what})" if what else ""))
        self[name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Drop a registration (a plug-in registered by a test)."""
        self.pop(name, None)
