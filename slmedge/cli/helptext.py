"""How ``--help`` reads: wrapped at spaces only, never inside a word at a hyphen (click's wrapper
splits ``compressed-tensors`` or ``--group-size`` across two lines, and a line copied from the
help would no longer run), and arguments in the usage line as click writes them (``PATH``,
``[MODEL]``), not as typer does (``{path}``, ``[model]``)."""

from __future__ import annotations

# Stands in for "-" while click wraps a text (a character its wrapper does not break at, one
# column wide); every one is "-" again before the help is printed.
_UNBROKEN = "\u2011"


def _whole(text: str) -> str:
    return text.replace("-", _UNBROKEN)


def _context_class(base):
    """``base`` (the click Context class typer uses: typer may carry its own copy of click) whose
    help formatter keeps hyphenated words whole."""

    class Formatter(base.formatter_class):
        def write_usage(self, prog, args="", prefix=None):
            super().write_usage(_whole(prog), _whole(args), prefix)

        def write_text(self, text):
            super().write_text(_whole(text))

        def write_dl(self, rows, *args, **kwargs):
            super().write_dl([(_whole(first), _whole(second)) for first, second in rows], *args, **kwargs)

        def getvalue(self):
            return super().getvalue().replace(_UNBROKEN, "-")

    class Context(base):
        formatter_class = Formatter

    return Context


def _usage_pieces(param):
    def pieces(ctx) -> list[str]:
        name = (param.metavar or param.name).upper()
        name = name if param.required else f"[{name}]"
        return [name + ("..." if param.nargs != 1 else "")]

    return pieces


def plain_help(group) -> None:
    """Every command under ``group`` (the click group typer built) gets the help described above."""
    context = _context_class(group.context_class)

    def visit(cmd):
        cmd.context_class = context
        for param in cmd.params:
            if param.param_type_name == "argument":
                param.get_usage_pieces = _usage_pieces(param)
        for sub in (getattr(cmd, "commands", None) or {}).values():
            visit(sub)

    visit(group)
