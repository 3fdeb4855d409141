"""The README's first three python blocks (the 20-line kernel, its backward, the Helion kernel) run as
written, in a fresh process (they register ops)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.aot
def test_readme_python_blocks_run(tmp_path):
    blocks = _python_blocks()
    assert len(blocks) >= 3
    # the backward snippet continues the 20-line example; the Helion block needs torch/tk from it
    script = "\n".join(blocks[:3]) + "\nimport torch\nx = torch.randn(64, 256, requires_grad=True)\n" \
        "softmax(x).pow(2).sum().backward()\nref = x.detach().double().requires_grad_()\n" \
        "torch.softmax(ref, -1).pow(2).sum().backward()\n" \
        "assert torch.allclose(x.grad.double(), ref.grad, atol=1e-6), (x.grad - ref.grad).abs().max()\n" \
        "w = torch.randn(1024); xx = torch.randn(32, 1024)\n" \
        "want = xx.double() * torch.rsqrt((xx.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()\n" \
        "assert torch.allclose(rms_scale(xx, w).double(), want, atol=1e-5)\nprint('README OK')\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    path = tmp_path / "readme_example.py"  # a file, not -c: Helion reads kernel source with inspect
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "README OK" in proc.stdout
    assert proc.stdout.count(": ok, VMEM") == 3
