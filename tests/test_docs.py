"""The documentation site (docs/, mkdocs.yml): it builds in strict mode, every public name has an API entry, the
guides' code runs, and the built pages render in a real browser.

* ``site``: ``mkdocs build --strict`` once per session into a temporary folder (about 5 s); skipped, with the
  reason, only where mkdocs is not installed (``make test`` installs the ``docs`` extra).
* ``test_every_public_name_has_an_api_entry``: each name in ``tpukernels.__all__`` and each public export of
  ``tpukernels.library`` (``__all__`` where it defines one, else every public non-module attribute) has its
  mkdocstrings anchor (``id="tpukernels.<name>"`` / ``id="tpukernels.library.<name>"``) in the built reference,
  and each ``tpukernels`` subcommand its section of the command-line page.
* ``test_guide_code_runs``: every ```` ```python ```` block of a page, in order, as one script (``--8<--``
  includes expanded as mkdocs expands them): the guides, and the landing page (docs/index.md includes README.md). Shell blocks (``bash``, ``console``) are not
  run: they install packages, need a TPU host, or are the CLI, which tests/test_cli.py runs.
* ``test_site_renders_in_chromium``: headless Chromium (Debian's ``chromium``) loads the landing page, a guide and
  an API page from a local HTTP server, and the test checks what it rendered (navigation, search box, code
  blocks, a function's heading), that the search index was fetched, and that the console logged no error.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"\s*$', re.M)
PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```\s*$", re.S | re.M)


def _include(m: re.Match) -> str:
    text = (ROOT / m["path"]).read_text()
    if m["section"]:  # the lines between "--8<-- [start:NAME]" and "--8<-- [end:NAME]", as pymdownx.snippets does
        text = text.split(f"--8<-- [start:{m['section']}]", 1)[1].split("\n", 1)[1]
        text = text.split(f"--8<-- [end:{m['section']}]", 1)[0].rsplit("\n", 1)[0]
    return text


def page_source(path: Path) -> str:
    """A page's markdown with its ``--8<-- "path"`` / ``"path:section"`` includes expanded (paths from the
    repository root, as mkdocs.yml's snippets base_path)."""
    return SNIPPET.sub(_include, path.read_text())


def python_blocks(path: Path) -> list[str]:
    return PYTHON_BLOCK.findall(page_source(path))


def pages_with_code() -> list[Path]:
    return [p for p in sorted(DOCS.rglob("*.md")) if "hooks" not in p.parts and python_blocks(p)]


def test_guides_have_code():
    """Each guide shows code that runs (the test below would pass vacuously on a page with none)."""
    guides = sorted((DOCS / "guides").glob("*.md"))
    assert len(guides) >= 10, guides
    runnable = set(pages_with_code())
    assert [g.name for g in guides if g not in runnable] == []


# Runs each page's script in one process, one after another, each in fresh globals (runpy): the pages share the
# imports of torch, jax and tpukernels (about 5 s each on 2 busy cores), not each other's names.
_DRIVER = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    print("=== " + path, flush=True)
    try:
        runpy.run_path(path, run_name="__main__")
        print("PAGE OK " + path, flush=True)
    except BaseException:
        traceback.print_exc()
        print("PAGE FAILED " + path, flush=True)
"""


@pytest.mark.aot
def test_guide_code_runs(tmp_path):
    pages = pages_with_code()
    scripts = []
    for page in pages:  # files: Helion reads kernel source with inspect; "docs_" keeps `helion.py` from shadowing
        script = tmp_path / ("docs_" + "_".join(page.relative_to(DOCS).with_suffix("").parts).replace("-", "_") + ".py")
        script.write_text("\n\n".join(python_blocks(page)))
        scripts.append(str(script))
    driver = tmp_path / "run_pages.py"
    driver.write_text(_DRIVER)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", HF_HUB_OFFLINE="1",
               TPUKERNELS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(driver), *scripts], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1200)  # cwd: the pages read repository files by relative path
    out = proc.stdout + proc.stderr
    failed = [str(page.relative_to(ROOT)) for page, s in zip(pages, scripts) if f"PAGE OK {s}" not in proc.stdout]
    assert proc.returncode == 0 and not failed, f"pages whose code failed: {failed}\n{out[-6000:]}"


# ---- the built site ----

@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.skip("mkdocs / mkdocstrings not installed: `make docs` or `pip install -e '.[docs]'`")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out


def public_library_names() -> list[str]:
    import tpukernels.library as lib

    if hasattr(lib, "__all__"):
        return list(lib.__all__)
    return [n for n, v in vars(lib).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)]


def _anchors(site: Path) -> set[str]:
    ids = set()
    for html in (site / "reference").rglob("*.html"):
        ids.update(re.findall(r'id="(tpukernels\.[^"]+)"', html.read_text()))
    return ids


def test_every_public_name_has_an_api_entry(site):
    import tpukernels

    ids = _anchors(site)
    missing = [f"tpukernels.{n}" for n in tpukernels.__all__ if f"tpukernels.{n}" not in ids]
    missing += [f"tpukernels.library.{n}" for n in public_library_names() if f"tpukernels.library.{n}" not in ids]
    assert not missing, f"public names without an API entry in the site: {missing}"
    assert {"tpukernels.TpuKernel.def_backward", "tpukernels.Config.from_json"} <= ids  # documented members too


def test_cli_page_has_every_subcommand(site):
    import argparse

    from tpukernels.cli import build_parser

    page = (site / "reference" / "cli.html").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) >= 5
    for name, parser in sub.choices.items():
        assert f"tpukernels {name}</code>" in page, name
        for action in parser._actions:  # every option of the subcommand is in its table
            for opt in action.option_strings:
                assert opt in page, (name, opt)


def test_included_pages_follow_their_sources(site):
    """ARCHITECTURE.md and BENCHMARKS.md are included, not copied: a line of each is on its page, and the
    benchmark plots the page links resolve to files of the site."""
    arch = (site / "architecture.html").read_text()
    assert "tests/test_architecture.py" in arch and "<table>" in arch
    bench = (site / "benchmarks.html").read_text()
    first_table_row = next(l for l in (ROOT / "BENCHMARKS.md").read_text().splitlines() if l.startswith("| norms"))
    assert first_table_row.split("|")[3].strip() in bench
    pngs = re.findall(r'<img [^>]*src="([^"]+\.png)"', bench)
    assert pngs and all((site / p).is_file() for p in pngs), pngs


# ---- the site in a browser ----

def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class _Handler(http.server.SimpleHTTPRequestHandler):
    requested: list[tuple[str, int]] = []  # (path, HTTP status) of every request the browser made

    def log_request(self, code="-", size="-"):
        _Handler.requested.append((self.path.split("?")[0], int(getattr(code, "value", code))))

    def log_message(self, fmt, *args):  # keep the test's output clean
        pass


@pytest.fixture(scope="module")
def served(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _render(url: str, tmp_path: Path, name: str) -> tuple[str, str]:
    """(the DOM after scripts ran, chromium's log) for ``url``; a screenshot lands in tmp_path/<name>.png."""
    browser = _chromium()
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--no-first-run", "--disable-extensions", f"--user-data-dir={tmp_path / ('profile-' + name)}",
              "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--window-size=1280,900"]
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    subprocess.run(common + [f"--screenshot={tmp_path / (name + '.png')}", url], capture_output=True, timeout=120)
    return dom.stdout, dom.stderr


def test_site_renders_in_chromium(served, tmp_path):
    if _chromium() is None:
        pytest.skip("no chromium: `apt-get install -y chromium` (make test installs it where it runs as root)")
    _Handler.requested.clear()
    js = ["js-focus-visible", "md-nav", "md-search__input"]  # the theme's script ran; navigation; search box
    code = ['data-md-type="copy"', '<span class="kn">import</span>']  # highlighted python, copy button (script)
    checks = {
        "index.html": js + code + ['id="two-commands"', 'href="guides/write-a-kernel.html"'],
        "guides/write-a-kernel.html": js + code + ['<span class="nd">@tk</span>', "Scalar prefetch"],
        "reference/library/norms.html": js + ['id="tpukernels.library.rms_norm"', "RMSNorm over the last dim"],
    }
    for page, needles in checks.items():
        dom, log = _render(f"{served}/{page}", tmp_path, page.replace("/", "_"))
        assert "<article" in dom, (page, log[-2000:])  # the page's content rendered into the DOM
        missing = [n for n in needles if n not in dom]
        assert not missing, (page, missing)
        console = [l for l in log.splitlines() if ":CONSOLE" in l]  # chromium logs every console message so
        assert not console, (page, console)                        # (the theme writes none on a healthy page)
        assert (tmp_path / (page.replace("/", "_") + ".png")).stat().st_size > 10_000
    assert ("/search/search_index.json", 200) in _Handler.requested, _Handler.requested  # the search worker's index
    failed = [(path, code) for path, code in _Handler.requested if code >= 400]
    assert not failed, failed  # no missing stylesheet, script, image or page
