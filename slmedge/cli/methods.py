"""slmedge methods: list the compression methods."""

from .common import Table, console


def methods_command():
    """List the compression methods and what they do.

    \b
    Example:
      slmedge methods
    """
    from ..compress.methods import METHODS

    table = Table("method", "kind", "what it does")
    for info in METHODS.values():
        table.add_row(info.name, info.kind, info.summary)
    console.print(table)
