"""README.md, the landing page (of the repository and of the docs site, which includes it): at most ~200 lines,
the guides it links exist, its code runs (in tests/test_docs.py, with the guides'), and the benchmark summary that
`tpukernels bench --readme README.md` rewrites sits between the markers the site's benchmarks guide includes."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    return open(os.path.join(ROOT, "README.md")).read()


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", _readme(), flags=re.S)


def test_readme_is_a_landing_page():
    text = _readme()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text and "make docs" in text
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?\)", text)
    assert sum(link.startswith("docs/guides/") for link in links) >= 10
    missing = [link for link in links if not os.path.isfile(os.path.join(ROOT, link))]
    assert not missing, missing


def test_bench_summary_markers():
    from tpukernels.bench import report

    text = _readme()
    start, begin, end, stop = (text.index(m) for m in ("<!-- --8<-- [start:bench-summary] -->", report.README_BEGIN,
                                                        report.README_END, "<!-- --8<-- [end:bench-summary] -->"))
    assert start < begin < end < stop
    assert "vs xla" in text[begin:end]


def test_readme_code_runs_as_the_sites_landing_page():
    """docs/index.md is README.md, included: tests/test_docs.py::test_guide_code_runs runs its python blocks (the
    20-line kernel, then the quick starts that continue it) with the guides'."""
    assert open(os.path.join(ROOT, "docs", "index.md")).read().strip() == '--8<-- "README.md"'
    blocks = _python_blocks()
    assert len(blocks) >= 3 and "tk.tpu_kernel" in blocks[0] and "compile_for" in blocks[0]
