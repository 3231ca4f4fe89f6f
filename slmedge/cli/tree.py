"""The command line as data: every command, its usage, help, arguments and options, read from the
typer app itself. The documentation's command reference is built from it (docs/hooks), and the
test that checks every ``slmedge ...`` line shown in README.md and docs/ uses it to find the
command a line names and the options that command takes, so neither can drift from the code."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Param:
    """One option or argument of a command, as ``--help`` shows it."""

    names: list[str]  # --output, -o (both names of a flag pair too: --sym, --asym); an argument: its name
    kind: str  # "option" or "argument"
    shown: str  # the left column of --help ("-o, --output <path>")
    help: str  # the right column (with the default and the environment variable, as --help has them)
    required: bool
    flag: bool  # takes no value


@dataclass
class Command:
    """A command or group, by its words after ``slmedge`` ("targets list")."""

    path: str
    usage: str
    help: str
    short_help: str
    params: list[Param] = field(default_factory=list)
    group: bool = False
    passes_options_on: bool = False  # takes options it does not know (lm-eval hands them to lm-evaluation-harness)
    click_command: Any = None  # the click command typer built (typer may carry its own copy of click)

    @property
    def options(self) -> dict[str, Param]:
        return {n: p for p in self.params if p.kind == "option" for n in p.names}

    @property
    def examples(self) -> list[str]:
        """The lines under "Example(s):" in its help (shell lines, comments included)."""
        out, inside = [], False
        for line in self.help.splitlines():
            if re.match(r"\s*Examples?:\s*$", line):
                inside = True
                continue
            if inside and line.strip():
                out.append(line.strip())
        return out

    @property
    def description(self) -> str:
        """The help text before its examples, without click's \\b markers."""
        text = re.split(r"^\s*Examples?:\s*$", self.help, maxsplit=1, flags=re.M)[0]
        return "\n".join(line for line in text.splitlines() if line.strip() != "\b").strip()


def _root_command():
    import typer

    from . import app

    return typer.main.get_command(app)


def _param(param, ctx) -> Param:
    option = param.param_type_name == "option"
    shown, text = param.get_help_record(ctx) or ("", "")
    names = [*param.opts, *param.secondary_opts] if option else [param.name]
    return Param(names=names, kind="option" if option else "argument", shown=shown, help=(text or "").strip(),
                 required=bool(param.required), flag=bool(option and param.is_flag))


def commands() -> dict[str, Command]:
    """Every command of ``slmedge`` by its words ("" is the root), in the order --help lists them."""
    root = _root_command()
    out: dict[str, Command] = {}

    def visit(cmd, path: list[str], parent):
        name = " ".join(["slmedge", *path])
        ctx = cmd.context_class(cmd, info_name=name if parent is None else path[-1], parent=parent)
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        settings = cmd.context_settings or {}
        group = hasattr(cmd, "list_commands")
        out[" ".join(path)] = Command(
            path=" ".join(path), usage=f"{name} {usage}".strip(), help=(cmd.help or "").strip(),
            short_help=cmd.get_short_help_str(limit=300), group=group,
            params=[_param(p, ctx) for p in cmd.get_params(ctx) if p.name != "help"],
            passes_options_on=bool(settings.get("ignore_unknown_options")), click_command=cmd)
        if group:
            for sub in cmd.list_commands(ctx):
                visit(cmd.get_command(ctx, sub), [*path, sub], ctx)

    visit(root, [], None)
    return out


# --- command lines as shown in documentation ----------------------------------------------------------

# How a command line may call slmedge: `slmedge`, `.venv/bin/slmedge`, `python -m slmedge`.
_PROGRAM = re.compile(r"(?:^|(?<=[\s`(]))(?:[\w./-]*/)?(?:slmedge|python3?(?:\.\d+)? -m slmedge)(?=\s|$|`)")


# Fenced blocks whose lines are shell commands; any other language (text: a command's output,
# toml, python) is not read.
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console", "zsh")


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, the command) of every ``slmedge ...`` call in Markdown ``text``: lines of shell
    code blocks (```bash, ```sh, ```console or no language) and inline code spans that start a
    call to slmedge (after a prompt, environment assignments, ``&&`` or ``|``). A shell comment
    ends the command; a trailing backslash joins the next line."""
    found: list[tuple[int, str]] = []
    fence: str | None = None  # the open block's language
    pending, start = "", 0
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fence = None if fence is not None else stripped.lstrip("`~").strip().split(" ")[0].lower()
            continue
        if fence == "console":  # a session: the lines after a prompt are commands, the rest output
            pieces = [line.lstrip()[2:]] if line.lstrip().startswith("$ ") else []
        elif fence is not None:
            pieces = [line] if fence in SHELL_BLOCKS else []
        else:
            pieces = re.findall(r"`([^`\n]+)`", line)
        for piece in pieces:
            if pending:
                piece, i0 = pending + " " + piece.strip(), start
            else:
                i0 = i
            if fence is not None and piece.rstrip().endswith("\\"):
                pending, start = piece.rstrip()[:-1], i0
                continue
            pending = ""
            for call in _calls(piece):
                found.append((i0, call))
    return found


def _calls(code: str) -> list[str]:
    """The slmedge calls in one line of shell: each from the program's name to the end of its
    command (a comment, ``&&``, ``;``, ``|`` or a closing parenthesis)."""
    code = re.sub(r"(^|\s)#.*$", "", code)  # a shell comment
    out = []
    for part in re.split(r"&&|\|\||;|\|", code):
        m = _PROGRAM.search(part)
        if m and not part[:m.start()].strip().endswith(("pip install", "install")):
            out.append("slmedge" + part[m.end():].split(")")[0].rstrip())  # "$(slmedge data path)"
    return out


@dataclass
class Problem:
    line: int
    command: str
    why: str


def check_command_line(command: str, tree: dict[str, Command] | None = None) -> str | None:
    """Why ``command`` (a ``slmedge ...`` line) would not run as written, or None: the command it
    names must exist, every option it uses must be one of that command's (or the root's), and
    click must parse it (option values of the right type, the arguments the command takes)."""
    tree = tree or commands()
    try:
        words = [w for w in shlex.split(command) if w not in ("...", "…")]  # "..." elides, in prose
    except ValueError as exc:
        return f"cannot be split as a shell line ({exc})"
    words = words[1:]  # "slmedge"
    root = tree[""]
    while words and words[0].startswith("-"):  # the root's own options (--debug)
        if words[0] == "--help":
            return None
        if words[0] not in root.options:
            return f"'{words[0]}' is not an option of slmedge itself (the command's options go after it)"
        words = words[1:]
    path: list[str] = []
    while words and " ".join([*path, words[0]]) in tree:
        path.append(words.pop(0))
    cmd = tree[" ".join(path)]
    if not words:  # the program or a command named alone
        return None
    if cmd.group and not words[0].startswith("-"):
        where = f"'slmedge {cmd.path}'" if cmd.path else "slmedge"
        return f"'{words[0]}' is not a command of {where}"
    if cmd.passes_options_on:
        return None
    opts = cmd.options
    rest = list(words)
    while rest:
        w = rest.pop(0)
        if w == "--":
            break
        if not w.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", w):
            continue
        name = w.split("=", 1)[0]
        if name == "--help":
            return None
        if name not in opts:
            return f"'{name}' is not an option of 'slmedge {cmd.path}'"
        if not opts[name].flag and "=" not in w:
            rest = rest[1:]  # its value
    try:
        cmd.click_command.make_context(cmd.path.split(" ")[-1] or "slmedge", list(words), resilient_parsing=False)
    except Exception as exc:  # noqa: BLE001 - click's usage errors (typer may carry its own click)
        if type(exc).__name__ == "Exit":
            return None
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return f"slmedge {cmd.path}: {message}"
    return None


def check_markdown(text: str, tree: dict[str, Command] | None = None) -> list[Problem]:
    """Every ``slmedge ...`` call in ``text`` that would not run as written."""
    tree = tree or commands()
    out = []
    for line, command in command_lines(text):
        why = check_command_line(command, tree)
        if why:
            out.append(Problem(line, command, why))
    return out
