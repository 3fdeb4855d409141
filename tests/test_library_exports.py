"""Every name the Library page's table lists as public API imports from ``tpukernels.library``.

The table's "public API" column is parsed from docs/library.md (each backticked ``name(...)`` or ``Name``), so a
name added to the table without its export (or an export renamed) fails here. (The reverse, every export with
an API entry in the built site: tests/test_docs.py.)
"""

import os
import re

import tpukernels.library as library

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_library_names() -> list[str]:
    text = open(os.path.join(ROOT, "docs", "library.md")).read()
    section = text.split("# Library", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| family")]
    names = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        if len(cells) < 2:
            continue
        for code in re.findall(r"`([^`]+)`", cells[1]):
            m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(\(|$)", code)
            if m:
                names.append(m.group(1))
    return names


def test_readme_table_is_parsed():
    names = readme_library_names()
    # one name per family at least, and the ones a user reported missing
    for expected in ("rms_norm", "flash_attention", "matmul", "quantized_matmul_blockwise", "pack_int4",
                     "TPUBlockQuantLinear", "gated_activation", "ragged_paged_attention_jax", "apply_rope"):
        assert expected in names, (expected, names)


def test_every_readme_library_name_imports_from_tpukernels_library():
    missing = [n for n in readme_library_names() if not hasattr(library, n)]
    assert not missing, f"docs/library.md's table lists names tpukernels.library does not export: {missing}"
    ns: dict = {}
    exec(f"from tpukernels.library import {', '.join(sorted(set(readme_library_names())))}", ns)
    assert callable(ns["quantized_matmul_blockwise"]) and isinstance(ns["TPUBlockQuantLinear"], type)
