"""User-review fixes to the CLI and config errors: ``tpukernels list`` shows static parameters with their
defaults, ``compile --help`` names the statics rule and the default chips, and a bad ``config=`` string's
message gives an example with one of the kernel's own tunables (not ``block_rows`` for every kernel)."""

import json
import re

import pytest
import torch

import tpukernels  # noqa: F401  (registers the library ops)
from tpukernels.cli import build_parser, main
from tpukernels.errors import ConfigError


def test_list_shows_static_defaults_and_required_statics(capsys):
    assert main(["list", "--json"]) == 0
    rows = {r["kernel"]: r for r in json.loads(capsys.readouterr().out)}
    rms = rows["tpukernels::rms_norm_fwd"]
    assert rms["required_statics"] == ["eps", "offset", "casting", "round_f16"]
    fa = rows["tpukernels::flash_attention_fwd"]
    assert "causal:bool=False" in fa["signature"] and "causal_alignment:str='top_left'" in fa["signature"]
    assert fa["statics"]["causal"] is False and "causal" not in fa["required_statics"]
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "causal:bool=False" in out and "--static" in out


def test_compile_help_names_statics_and_default_chips(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps (and splits long words) at the terminal's width
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["compile"].format_help().split())
    assert "(default: v5e,v6e,tpu7x)" in help_text
    assert "eps=1e-6,offset=0.0,casting=llama,round_f16=false" in help_text


def test_compile_rms_norm_fwd_needs_every_static_then_compiles(capsys):
    shapes = ["--shape", "64x256:f32", "--shape", "1x256:f32"]
    assert main(["compile", "rms_norm_fwd", *shapes, "--static", "eps=1e-6", "--chips", "v6e"]) == 2
    assert "offset" in capsys.readouterr().err
    assert main(["compile", "rms_norm_fwd", *shapes, "--static", "eps=1e-6,offset=0.0,casting=llama,round_f16=false",
                 "--chips", "v6e"]) == 0
    out = capsys.readouterr().out  # a table, or one "field value" line per field on a narrow terminal
    assert re.search(r"(^|\s)ok(\s|$)", out, re.M) and "v6e" in out


@pytest.mark.parametrize("bad", ["block_q=128", "[1]"])
def test_bad_config_string_example_uses_the_kernels_own_tunable(bad):
    q = torch.randn(1, 1, 128, 64)
    with pytest.raises(ConfigError) as e:
        torch.ops.tpukernels.flash_attention_fwd(q, q, q, None, None, config=bad)
    assert '{"block_q": ' in str(e.value) and "block_rows" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        torch.ops.tpukernels.rms_norm_fwd(torch.randn(8, 128), None, 1e-6, 0.0, "llama", False, config=bad)
    assert '{"block_rows": ' in str(e.value)  # rms_norm's own tunable


def test_config_example_without_tunables():
    from tpukernels.dsl.spec import config_example

    class NoTunables:
        class space:
            tunables: dict = {}

    assert config_example(NoTunables()) == "{}"
