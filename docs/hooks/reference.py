"""mkdocs hook: the API reference and the command-line page, generated at build time.

* ``reference/tpukernels.md`` and ``reference/library/<module>.md``: one mkdocstrings entry (``::: path``) per
  name ``tpukernels`` and ``tpukernels.library`` export, grouped by the module each name is imported from. The
  names are read from the packages' ``__init__.py`` files with :mod:`ast` (``__all__`` where a package defines
  it, else every public name its ``from .module import ...`` lines bind), so a new export gets its entry with
  no edit here; mkdocstrings' griffe then reads the docstrings from source (nothing is imported).
* ``reference/cli.md``: ``tpukernels.cli.build_parser()`` walked subcommand by subcommand (its usage, every
  argument with its help and default). argparse has no mkdocs plugin as maintained as mkdocs-click is for
  Click (mkdocs-argparse is a 0.0.1 release), and this is 40 lines of the standard library: the page is the
  parser, so it cannot drift from ``tpukernels --help``. Building the parser imports neither torch nor jax.
* ``benchmarks/results/*.png``: BENCHMARKS.md (included as a page) links its plots by their repository path.
* Links to the repository's top-level documents (``[BENCHMARKS.md](BENCHMARKS.md)``, as README, the bench report
  and the included files write them) point at the pages that include those documents, and README's links into
  ``docs/`` at those pages (README is the landing page: docs/index.md includes it).

``tests/test_docs.py`` checks the result: every exported name has its entry in the built site.
"""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import posixpath
import re
import sys

from markdown.extensions import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "tpukernels"

# Section titles for the façade's source modules (a module not listed here gets its dotted name).
FACADE_SECTIONS = {
    "dsl": "The DSL: kernels, launches, tunables",
    "": "Compile, run on JAX arrays, lower",
    "chips": "Chips",
    "errors": "Errors and warnings",
}


def _module_file(package_dir: pathlib.Path, dotted: str) -> pathlib.Path:
    path = package_dir.joinpath(*dotted.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _first_line(path: pathlib.Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def exports(package_dir: pathlib.Path) -> dict[str, list[str]]:
    """``{source module ('' = the package itself): [exported names, in source order]}`` for a package."""
    tree = ast.parse((package_dir / "__init__.py").read_text())
    source: dict[str, str] = {}
    declared = None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for a in node.names:
                source[a.asname or a.name] = node.module
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            source[node.name] = ""
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == "__all__":
                    declared = [ast.literal_eval(e) for e in node.value.elts]
                elif isinstance(t, ast.Name):
                    source.setdefault(t.id, "")
    names = declared if declared is not None else [n for n in source if not n.startswith("_")]
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(source.get(n, ""), []).append(n)
    return groups


def _entries(prefix: str, names: list[str], level: int) -> str:
    return "".join(f"::: {prefix}.{n}\n    options:\n      heading_level: {level}\n\n" for n in names)


def facade_page() -> str:
    groups = exports(PKG)
    order = [m for m in FACADE_SECTIONS if m in groups] + [m for m in groups if m not in FACADE_SECTIONS]
    out = ["# `tpukernels`\n\n", "Every name in `tpukernels.__all__`, by the module it comes from "
           "(`import tpukernels as tk`). Generated from the docstrings at build time.\n\n"]
    for mod in order:
        title = FACADE_SECTIONS.get(mod, f"`tpukernels.{mod}`")
        where = f" (`tpukernels.{mod}`)" if mod else ""
        out.append(f"## {title}{where}\n\n")
        out.append(_entries("tpukernels", groups[mod], 3))
    return "".join(out)


def library_pages() -> dict[str, tuple[str, str]]:
    """``{page path: (nav title, markdown)}``, one page per library module names are imported from."""
    lib = PKG / "library"
    pages = {}
    for mod, names in exports(lib).items():
        title = mod or "library"
        path = f"reference/library/{mod or 'index'}.md"
        dotted = f"tpukernels.library{'.' + mod if mod else ''}"
        summary = _first_line(_module_file(lib, mod)) if mod else _first_line(lib / "__init__.py")
        md = (f"# `{dotted}`\n\n{summary}\n\n"
              f"Exported as `tpukernels.library.<name>`; the module `{dotted}` holds the kernels, tunables and "
              "references behind them.\n\n" + _entries("tpukernels.library", names, 2))
        pages[path] = (title, md)
    return pages


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | meaning | default |", "|---|---|---|"]
    for a in parser._actions:  # argparse has no public accessor for its actions
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(a.option_strings) or a.dest
        if a.metavar and a.option_strings:
            name += f" {a.metavar}"
        elif a.option_strings and a.nargs != 0:
            name += f" {a.dest.upper()}"
        default = "" if a.default in (None, False, [], argparse.SUPPRESS) else f"`{a.default}`"
        flags = " (required)" if a.required and a.option_strings else ""
        text = parser._get_formatter()._expand_help(a) if a.help else ""  # %(default)s as --help prints it
        text = text.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}`{flags} | {text} | {default} |")
    return rows


def cli_page() -> str:
    sys.path.insert(0, str(ROOT))
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps help to the terminal: a fixed width for a stable page
    try:
        from tpukernels.cli import build_parser

        parser = build_parser()
        out = ["# Command line\n\n",
               "Generated from `tpukernels.cli.build_parser()` at build time: the same text as `tpukernels "
               "--help`. How to use each command: the [guides](../guides/compile-check.md).\n\n",
               "## `tpukernels`\n\n", f"```text\n{parser.format_help()}```\n\n"]
        out += ["\n".join(_argument_rows(parser)), "\n\n"]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {c.dest: c.help for c in sub._choices_actions}
        for name, p in sub.choices.items():
            out += [f"## `tpukernels {name}`\n\n", f"{helps.get(name) or ''}\n\n",
                    f"```text\n{p.format_help()}```\n\n", "\n".join(_argument_rows(p)), "\n\n"]
        return "".join(out)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
        sys.path.remove(str(ROOT))


def generated_pages() -> dict[str, tuple[str, str]]:
    pages = {"reference/tpukernels.md": ("tpukernels", facade_page())}
    pages.update(library_pages())
    pages["reference/cli.md"] = ("Command line", cli_page())
    return pages


_PAGES: dict[str, tuple[str, str]] = {}


def on_config(config):
    """Build the pages once per build and list them under the nav's "API reference" section."""
    _PAGES.clear()
    _PAGES.update(generated_pages())
    for section in config["nav"] or []:
        if isinstance(section, dict) and "API reference" in section:
            lib = [{title: path} for path, (title, _) in _PAGES.items() if path.startswith("reference/library/")]
            section["API reference"] += [{"tpukernels": "reference/tpukernels.md"}, {"tpukernels.library": lib},
                                         {"Command line": "reference/cli.md"}]
    config["markdown_extensions"].append(_RepoLinksExtension())
    return config


def on_files(files, config):
    for path, (_, content) in _PAGES.items():
        files.append(File.generated(config, path, content=content))
    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        rel = png.relative_to(ROOT).as_posix()
        files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


# Top-level documents of the repository and the pages that include them.
INCLUDED = {"ARCHITECTURE.md": "architecture.md", "BENCHMARKS.md": "benchmarks.md",
            "ARCHITECTURES.md": "architectures.md", "README.md": "index.md"}
_LINK = re.compile(r"\]\((" + "|".join(re.escape(k) for k in INCLUDED) + r")(#[^)]*)?\)")
_ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|exc|obj|const):`~?")
_DOCS_LINK = re.compile(r"\]\(docs/([^)#]+)")
_PAGE_DIR = {"dir": ""}  # the folder of the page being rendered (pages render one at a time)


class _RepoLinks(Preprocessor):
    """Rewrites the links after pymdownx.snippets (priority 32) has included its files, so included text is
    rewritten too (on_page_markdown sees the page before the include); mkdocstrings renders docstrings with the
    same extensions, so their Sphinx roles are rewritten here too."""

    def run(self, lines):
        here = _PAGE_DIR["dir"] or "."
        text = _LINK.sub(lambda m: f"]({posixpath.relpath(INCLUDED[m[1]], here)}{m[2] or ''})", "\n".join(lines))
        # README's links into docs/ (it is the landing page, included by docs/index.md)
        text = _DOCS_LINK.sub(lambda m: f"]({posixpath.relpath(m[1], here)}", text)
        # docstrings cross-reference in Sphinx's roles (:func:`x`); Markdown shows the name as code
        text = _ROLE.sub("`", text)
        return text.split("\n")


class _RepoLinksExtension(Extension):
    def extendMarkdown(self, md):
        md.preprocessors.register(_RepoLinks(md), "tpukernels_repo_links", 31)


def on_page_markdown(markdown, page, config, files):
    _PAGE_DIR["dir"] = posixpath.dirname(page.file.src_uri)
    return markdown
