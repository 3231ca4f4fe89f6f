"""slmedge methods: list the compression methods."""


from ..compress.methods import METHODS
from .common import Table, console


def methods_command():
    """List the compression methods and what they do.

    \b
    Example:
      slmedge methods
    """
    table = Table("method", "kind", "what it does")
    for info in METHODS.values():
        table.add_row(info.name, info.kind, info.summary)
    console.print(table)
