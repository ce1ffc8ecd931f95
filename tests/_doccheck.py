"""The documentation check: what README.md and docs/ say against the live CLI and the repository.

Three checks, each a function that returns a list of problems (one line each, naming the page):

- :func:`undocumented_options`: every option of every command's ``--help`` (the Typer app of
  ``deltazip.deltacli``, read live) appears as ``--option`` in the page that owns the command: the
  ``docs/*.md`` whose title names it (``# deltazip compress``, ``# deltazip pack / unpack``);
- :func:`dead_references`: every relative Markdown link (and its ``#anchor``) resolves inside the
  repository, and so does every path (``bench/compress.py``, ``docs/format.md``, ``format.md``) and
  dotted module name (``deltazip.kernels.reference.sbmm``) a user page or docs/architecture.md names;
- :func:`unparsable_commands`: every ``deltazip ...`` line in a fenced code block of the README or a
  docs page names a command that exists and options it has, each value of the option's type, with the
  right number of arguments. Synopsis notation is understood: ``[--bits 4]``, ``2:4|none``, ``...``,
  upper-case placeholders (``BASE``, ``N``) and shell variables stand for values of the right type.

The checks read plain files and the click command tree Typer builds (the same tree ``--help``
renders), so they run in well under a second.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Top-level names a prose path may start with: the repository's folders and files (read live).
_SKIP_TOP = {".git", ".venv", ".venv-latest", "build", "dist"}


def user_pages(root: Path = ROOT) -> list[Path]:
    """README.md and docs/*.md except docs/architecture.md (a contributors' page) and docs/dev/."""
    return [root / "README.md"] + sorted(p for p in (root / "docs").glob("*.md") if p.name != "architecture.md")


def all_pages(root: Path = ROOT) -> list[Path]:
    """Every Markdown page of the documentation: README.md, docs/ and its subfolders (dev records)."""
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def rel(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


# --- the CLI -------------------------------------------------------------------------------------


def cli_commands() -> dict:
    """``{name: click command}`` of the live ``deltazip`` app (what ``deltazip NAME --help`` shows)."""
    import typer.main

    from deltazip.deltacli.app import app

    return dict(typer.main.get_command(app).commands)


def root_options() -> list[str]:
    import typer.main

    from deltazip.deltacli.app import app

    return [o for p in typer.main.get_command(app).params if p.param_type_name == "option" and not p.hidden
            for o in (*p.opts, *p.secondary_opts)]


def options_of(cmd) -> list:
    """The visible options of a click command, ``--help`` left out."""
    return [p for p in cmd.params if p.param_type_name == "option" and not p.hidden and "--help" not in p.opts]


def owner_page(name: str, root: Path = ROOT) -> Path | None:
    """The docs/*.md page whose title (first line) names command ``name``, or None."""
    word = re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])")
    owners = [p for p in sorted((root / "docs").glob("*.md"))
              if p.name != "architecture.md" and word.search(p.read_text(encoding="utf-8").split("\n", 1)[0])
              and p.read_text(encoding="utf-8").startswith("#")]
    return owners[0] if len(owners) == 1 else None


def undocumented_options(commands: dict | None = None, root: Path = ROOT) -> list[str]:
    """One line per option of ``--help`` missing from its command's page (or per command without one)."""
    live = commands is None
    commands = cli_commands() if live else commands
    problems = []
    for name, cmd in sorted(commands.items()):
        page = owner_page(name, root)
        if page is None:
            problems.append(f"deltazip {name}: no docs/*.md page (or more than one) has a title naming it")
            continue
        text = page.read_text(encoding="utf-8")
        for p in options_of(cmd):
            for opt in (*p.opts, *p.secondary_opts):
                if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                    problems.append(f"deltazip {name} {opt}: in --help but not in {rel(page, root)}")
    readme = (root / "README.md").read_text(encoding="utf-8")
    for opt in root_options() if live else []:
        if opt not in readme:
            problems.append(f"deltazip {opt}: in --help but not in README.md")
    return problems


# --- links and file references -------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
_MODULE = re.compile(r"(?<![\w.])deltazip(?:\.\w+)+")


def prose_and_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(prose lines, fenced-code lines)`` of a Markdown page, each as ``(line number, text)``."""
    prose, code, fenced = [], [], False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append((i, line))
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = prose_and_code(page.read_text(encoding="utf-8"))
    out, seen = set(), {}
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def _top_level(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name not in _SKIP_TOP}


def _path_pattern(root: Path) -> re.Pattern:
    """Paths in prose: starting with a top-level folder (``bench/x.py``) or naming a top-level file."""
    tops = sorted(_top_level(root), key=len, reverse=True)
    dirs = "|".join(re.escape(t) for t in tops if (root / t).is_dir())
    files = "|".join(re.escape(t) for t in tops if (root / t).is_file())
    return re.compile(rf"(?<![\w./~$-])(?:(?:{dirs})/[\w./*<>{{}}-]*[\w*/>}}]|(?:{files})(?![\w-])|(?:\.\./)+[\w./-]*[\w/])(?![\w(])")


_BARE_MD = re.compile(r"(?<![\w./~$`-])[\w-]+\.md(?![\w(`])")


def _resolves(ref: str, page: Path, root: Path) -> bool:
    ref = ref.rstrip("/")
    for base in (page.parent,) if ref.startswith("../") else (page.parent, root):
        target = base / ref
        if "*" in ref:
            if list(base.glob(ref)):
                return True
        elif target.exists() and target.resolve().is_relative_to(root.resolve()):
            return True
        elif "." in target.name and (mod := target.parent / (target.name.split(".")[0] + ".py")).is_file():
            # bench/_pairs.synthetic_7b: an attribute of a module, named by its path
            return re.search(rf"\b{re.escape(target.name.split('.', 1)[1])}\b", mod.read_text(encoding="utf-8")) is not None
    return False


def _module_resolves(name: str, root: Path) -> bool:
    """``deltazip.pkg.mod.attr``: the module file exists and names each attribute after it."""
    parts = name.split(".")[1:]
    here = root / parts[0]
    if not (here / "__init__.py").is_file():
        return True  # not a package of the repository: a logger name (deltazip.access) or the like
    rest = parts[1:]
    while rest and (here / rest[0]).is_dir():
        here, rest = here / rest[0], rest[1:]
    if not rest:
        return True
    if not (here / f"{rest[0]}.py").is_file():
        # an attribute of the package itself (its __init__) or a module that does not exist
        init = here / "__init__.py"
        return init.is_file() and re.search(rf"\b{re.escape(rest[0])}\b", init.read_text(encoding="utf-8")) is not None
    src = (here / f"{rest[0]}.py").read_text(encoding="utf-8")
    return all(re.search(rf"\b{re.escape(a)}\b", src) for a in rest[1:])


def dead_references(pages: list[Path] | None = None, ref_pages: list[Path] | None = None,
                    root: Path = ROOT) -> list[str]:
    """Markdown links of ``pages`` (default: every page) that do not resolve inside the repository, and
    paths and ``deltazip.*`` module names in the prose of ``ref_pages`` (default: the user pages and
    docs/architecture.md; dev records may name files that no longer exist) that do not exist."""
    pages = all_pages(root) if pages is None else pages
    ref_pages = user_pages(root) + sorted((root / "docs").glob("architecture.md")) if ref_pages is None else ref_pages
    problems = []
    for page in pages:
        prose, _ = prose_and_code(page.read_text(encoding="utf-8"))
        for n, line in prose:
            for m in _LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if _URL.match(target):
                    continue
                path, _, anchor = target.partition("#")
                dest = page if not path else (page.parent / path)
                if not dest.exists() or not dest.resolve().is_relative_to(root.resolve()):
                    problems.append(f"{rel(page, root)}:{n}: link {target} does not resolve inside the repository")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{rel(page, root)}:{n}: link {target}: {rel(dest, root)} has no heading "
                                    f"#{anchor}")
    pattern = _path_pattern(root)
    for page in ref_pages:
        prose, _ = prose_and_code(page.read_text(encoding="utf-8"))
        for n, line in prose:
            line = _LINK.sub(" ", line)  # links are checked above
            line = re.sub(r"\b[a-z][a-z0-9+.-]*://\S+", " ", line)  # URLs
            for m in pattern.finditer(line):
                ref = m.group(0).rstrip(".")
                if re.search(r"/[A-Z][A-Z0-9_]*(\.|/|$)|[{<]", ref):  # bench/NAME.py: a placeholder
                    continue
                if not _resolves(ref, page, root):
                    problems.append(f"{rel(page, root)}:{n}: {ref} does not exist in the repository")
            for m in _BARE_MD.finditer(re.sub(r"`[^`]*`", " ", line)):  # format.md in prose; `x.md` may be an output
                if not _resolves(m.group(0), page, root):
                    problems.append(f"{rel(page, root)}:{n}: {m.group(0)} does not exist in the repository")
            for m in _MODULE.finditer(line):
                if not _module_resolves(m.group(0), root):
                    problems.append(f"{rel(page, root)}:{n}: {m.group(0)} names no module or attribute in the "
                                    f"repository")
    return problems


# --- deltazip commands in code blocks ------------------------------------------------------------

_SHELL_BREAK = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}
_PLACEHOLDER = re.compile(r"^\$|^[A-Z][A-Z0-9_]*(?:[:./-][\w:./-]*)?$|\$\{?[A-Z_]")


@dataclass
class Command:
    page: Path
    line: int
    text: str


def code_commands(pages: list[Path] | None = None, root: Path = ROOT) -> list[Command]:
    """Every ``deltazip ...`` command line (continuations joined) in a fenced code block of ``pages``."""
    pages = [root / "README.md"] + sorted((root / "docs").glob("*.md")) if pages is None else pages
    out = []
    for page in pages:
        _, code = prose_and_code(page.read_text(encoding="utf-8"))
        buf, start = "", 0
        for n, line in code:
            if buf:
                buf += " " + line.strip()
            else:
                buf, start = line.strip(), n
            if buf.endswith("\\"):
                buf = buf[:-1]
                continue
            cmd = re.sub(r"^\$\s+", "", buf)
            cmd = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", cmd)  # DELTAZIP_DEBUG=1 deltazip ...
            if re.match(r"^(?:\S*/)?deltazip\s", cmd + " ") and not cmd.startswith("deltazip:"):
                out.append(Command(page, start, re.sub(r"^\S*/deltazip", "deltazip", cmd)))
            buf = ""
    return out


def _segment(tokens: list[str]) -> list[str]:
    """The tokens of the first shell command: up to a pipe, ``&&``, ``;`` or a redirection outside
    synopsis brackets (inside them ``|`` separates alternatives)."""
    depth, out = 0, []
    for t in tokens:
        if depth == 0 and t in _SHELL_BREAK:
            break
        depth += t.count("[") - t.count("]")
        out.append(t)
    return out


def _convert(param, value: str, cmd) -> None:
    """Convert ``value`` as the option's type does when the command parses it (raises when it cannot)."""
    if hasattr(param, "get_runtime_param"):  # Typer >= 0.25: its own coercion over pydantic-like types
        from typer._click import Context

        param.get_runtime_param().coerce([value] if param.multiple else value, param=param, ctx=Context(cmd))
    else:
        param.type.convert(value, param, None)


def _value_ok(param, value: str, cmd) -> str | None:
    """None when ``value`` (or each ``|`` alternative) is a placeholder or converts to the option's type."""
    for alt in value.split("|"):
        alt = alt.replace("[", "").replace("]", "")
        if not alt or alt == "..." or _PLACEHOLDER.search(alt):
            continue
        try:
            _convert(param, alt, cmd)
        except Exception as e:  # click's BadParameter and friends: the message says why
            return f"{alt!r} is not a valid value of {param.opts[0]} ({str(e).strip() or type(e).__name__})"
    return None


def parse_problem(cmd: Command, commands: dict) -> str | None:
    """Why ``cmd`` does not parse against its command's options, or None."""
    try:
        tokens = _segment(shlex.split(cmd.text, comments=True))
    except ValueError as e:
        return f"not a shell command line ({e})"
    tokens = [t for t in (t.replace("[", "").replace("]", "") if t.startswith(("[", "--")) or t.endswith("]")
                          else t for t in tokens) if t not in ("", "|", "...", "options", "OPTIONS")]
    synopsis = any(c in cmd.text for c in "[|") or "..." in cmd.text
    if len(tokens) < 2:
        return "no command after deltazip"
    if tokens[1].startswith("-"):
        return None if tokens[1] in ("--version", "--help") else f"unknown option {tokens[1]} of deltazip"
    name = tokens[1]
    if name not in commands:
        return f"deltazip has no command {name!r} (commands: {', '.join(sorted(commands))})"
    click_cmd = commands[name]
    by_opt = {o: p for p in click_cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}
    by_opt["--help"] = None
    args = [p for p in click_cmd.params if p.param_type_name == "argument"]
    given, seen, i = [], set(), 2
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("--"):
            for opt in t.split("/") if "/--" in t else [t]:  # --sym/--asym: alternatives
                key, eq, val = opt.partition("=")
                if key not in by_opt:
                    return f"deltazip {name} has no option {key}"
                p = by_opt[key]
                if p is None:
                    continue
                seen.add(p.name)
                if p.is_flag or p.count:
                    if eq:
                        return f"{key} is a flag and takes no value"
                    continue
                if not eq:
                    if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                        return f"{key} needs a value"
                    i += 1
                    val = tokens[i]
                bad = _value_ok(p, val, click_cmd)
                if bad:
                    return bad
        elif t.startswith("-") and len(t) > 1 and not t[1].isdigit():
            return f"deltazip {name} has no option {t} (short options are not defined)"
        else:
            given.append(t)
        i += 1
    fixed = [a for a in args if a.nargs != -1]
    variadic = [a for a in args if a.nargs == -1]
    if len(given) > len(fixed) and not variadic:
        return f"deltazip {name} takes {len(fixed)} argument(s), the line gives {len(given)}: {given}"
    if not synopsis:
        need = len([a for a in fixed if a.required]) + len([a for a in variadic if a.required])
        if len(given) < need:
            return f"deltazip {name} needs {need} argument(s), the line gives {len(given)}"
        missing = [p.opts[0] for p in click_cmd.params if p.param_type_name == "option" and p.required
                   and p.name not in seen]
        if missing:
            return f"deltazip {name} needs {', '.join(missing)}"
    return None


def unparsable_commands(commands: dict | None = None, pages: list[Path] | None = None,
                        root: Path = ROOT) -> list[str]:
    commands = cli_commands() if commands is None else commands
    problems = []
    for c in code_commands(pages, root):
        why = parse_problem(c, commands)
        if why:
            problems.append(f"{rel(c.page, root)}:{c.line}: `{c.text}`: {why}")
    return problems


# --- development records in user pages -----------------------------------------------------------

DEV_RECORD = re.compile(r"issue [0-9]|issues? \d+(?:/\d+)?\b|was lent|this window|no GPU was|this session|"
                        r"\bcommit [0-9a-f]{7,}\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b(?=\))|git worktree", re.I)


def dev_records(pages: list[Path] | None = None, root: Path = ROOT) -> list[str]:
    """Lines of user pages that speak of how the code was built (issue numbers, commits, sessions)."""
    problems = []
    for page in user_pages(root) if pages is None else pages:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            m = DEV_RECORD.search(line)
            if m:
                problems.append(f"{rel(page, root)}:{n}: {m.group(0)!r} is a development record: move it to docs/dev/")
    return problems
