"""The documentation check (tests/_doccheck.py) on README.md and docs/, and checks that it can fail.

Each check reads the live CLI (the Typer app's command tree, what ``--help`` renders) and the files
as they are, so a new option, a renamed file or a moved page shows here, one line per problem.
"""

from __future__ import annotations

import pytest
import typer
import typer.main
from _doccheck import (
    ROOT,
    Command,
    cli_commands,
    dead_references,
    dev_records,
    parse_problem,
    undocumented_options,
    unparsable_commands,
    user_pages,
)


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


CHECKS = {
    "every-help-option-is-on-its-commands-page": undocumented_options,
    "every-link-and-file-reference-resolves": dead_references,
    "every-deltazip-command-in-a-code-block-parses": unparsable_commands,
    "user-pages-hold-no-development-records": dev_records,
}


@pytest.mark.parametrize("check", list(CHECKS))
def test_documentation(check):
    problems = CHECKS[check]()
    assert not problems, _report(problems)


def test_user_pages_are_the_readme_and_docs_pages_but_architecture():
    names = {p.relative_to(ROOT).as_posix() for p in user_pages()}
    assert "README.md" in names and "docs/compress.md" in names and "docs/serve.md" in names
    assert "docs/architecture.md" not in names and not any(n.startswith("docs/dev/") for n in names)


# --- the checks fail when they should ----------------------------------------------------------


def test_an_option_added_to_a_command_without_a_page_entry_is_reported():
    app = typer.Typer()

    @app.command()
    def compress(bits: int = typer.Option(4, "--bits"), brand_new: int = typer.Option(1, "--brand-new-option")):
        """A stand-in for `deltazip compress` with one option its page does not describe."""

    @app.command()
    def nopage():
        """A command no docs page is titled after."""

    commands = dict(typer.main.get_command(app).commands)
    problems = undocumented_options(commands, ROOT)
    assert problems == ["deltazip compress --brand-new-option: in --help but not in docs/compress.md",
                        "deltazip nopage: no docs/*.md page (or more than one) has a title naming it"]


def test_a_broken_link_anchor_or_file_reference_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "real.py").write_text("def real_function(): pass\n")
    (tmp_path / "README.md").write_text("# Top\n\n[ok](docs/a.md) [gone](docs/gone.md) [anchor](docs/a.md#nope)\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Real heading\n\n[self](#real-heading) [up](../README.md#top) [out](../../x.md)\n"
        "See bench/real.py, bench/missing.py, bench/real.real_function and `deltazip.bench.x`.\n"
        "```\nbench/ignored_in_code.py\n```\n")
    problems = dead_references(root=tmp_path)
    assert problems == [
        "README.md:3: link docs/gone.md does not resolve inside the repository",
        "README.md:3: link docs/a.md#nope: docs/a.md has no heading #nope",
        "docs/a.md:5: link ../../x.md does not resolve inside the repository",
        "docs/a.md:6: bench/missing.py does not exist in the repository",
    ]


def test_a_command_that_does_not_parse_is_reported():
    commands = cli_commands()
    page = ROOT / "README.md"

    def why(text: str) -> str | None:
        return parse_problem(Command(page, 1, text), commands)

    assert why("deltazip compress --base b --finetuned f --out o --bitz 4") == "deltazip compress has no option --bitz"
    assert "not a valid value of --level" in why("deltazip pack art/ --level 99")
    assert "not a valid value of --bits" in why("deltazip compress --base b --finetuned f --out o --bits four")
    assert why("deltazip frobnicate x").startswith("deltazip has no command 'frobnicate'")
    assert why("deltazip merge art/") == "deltazip merge needs --out"
    assert why("deltazip verify a b") == "deltazip verify takes 1 argument(s), the line gives 2: ['a', 'b']"
    assert why("deltazip pack art/ --level") == "--level needs a value"
    # synopses, variables, comments and pipes are understood
    assert why("deltazip compress --base BASE --finetuned FT --out ART [--sparsity 2:4|none] [--sym/--asym]") is None
    assert why('deltazip serve arts/ --api-key "$KEY" --port 8123   # comment') is None
    assert why("deltazip inspect art/ --json | jq .ratio") is None
    assert why("deltazip eval art/ ft/ base --tasks deltazip_shift [--output results.json [--overwrite]]") is None


def test_development_records_in_a_user_page_are_reported(tmp_path):
    page = tmp_path / "serve.md"
    page.write_text("# serve\n\nFixed in issue 23.\nMeasured at the commit before (15ef44b).\n"
                    "No GPU was lent to this work.\nArtifacts of 26684784 bytes (26684784) are fine.\n")
    problems = dev_records([page], root=tmp_path)
    assert [p.split(":")[1] for p in problems] == ["3", "4", "5"], problems
