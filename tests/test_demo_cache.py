"""``make demo``'s chip table reuses cached libtpu estimates: a second run makes no new estimate."""

import pytest
import numpy as np


@pytest.mark.slow
@pytest.mark.aot
def test_second_chip_table_uses_cached_estimates(tmp_path, monkeypatch, capsys):
    from tpukernels import demo
    from tpukernels.dsl.spec import TensorSpec
    from tpukernels.library.norms import rms_norm_fwd

    sig = (rms_norm_fwd, (TensorSpec((8, 128), np.dtype("float32"), "x"), None),
           (("eps", 1e-6), ("offset", 0.0), ("casting", "llama"), ("round_f16", False)))
    monkeypatch.setattr(demo, "used_signatures", lambda: [sig])
    monkeypatch.setattr(demo, "CHIPS", ("v6e",))
    lines = []
    first = demo.chip_table_part(lines.append, cache_path=str(tmp_path / "est.json"))
    second = demo.chip_table_part(lines.append, cache_path=str(tmp_path / "est.json"))
    assert first["ok"] and second["ok"]
    assert first["rows"][0]["cycles"] == second["rows"][0]["cycles"] > 0
    progress = [ln for ln in lines if ln.strip().startswith("(1/1)")]
    assert "new estimate" in progress[0] and "cached estimate" in progress[1]
