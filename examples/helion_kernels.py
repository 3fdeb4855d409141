"""The same kernels written as Helion tile programs (``@tk.tpu_kernel(backend="helion")``).

Helion writes the loops over tiles and lets the compiler derive BlockSpecs, grids and the accumulator;
the Pallas front-end (examples/vector_add.py, softmax.py, matmul.py) spells those out. Both give a
torch op, compile-only checks and a tunable space. ``rms_scale`` is a fused elementwise + reduction that
is 6 lines here and ~25 as a Pallas body + launch.

Helion 1.5.1's Pallas backend needs shapes that are multiples of the tile sizes; tpukernels pads other
shapes to whole tiles and slices the outputs back (see tpukernels/frontends/helion.py); the Pallas
front-end masks tails.

    python examples/helion_kernels.py
"""

import helion.language as hl
import torch

import tpukernels as tk


@tk.tpu_kernel(backend="helion", namespace="examples_helion",
               tunables={"block_sizes": tk.Tunable([(1024,), (2048,), (8192,)])})
def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y. x, y: [N]."""
    out = torch.empty_like(x)
    for tile in hl.tile(out.size(0)):
        out[tile] = x[tile] + y[tile]
    return out


@tk.tpu_kernel(backend="helion", namespace="examples_helion",
               tunables={"block_sizes": tk.Tunable([(32,), (8,), (16,), (64,), (128,)])})
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, f32 inside. x: [R, C]."""
    n, _ = x.size()
    out = torch.empty_like(x)
    for tile_n in hl.tile(n):
        out[tile_n, :] = torch.softmax(x[tile_n, :].to(torch.float32), dim=1).to(x.dtype)
    return out


@tk.tpu_kernel(backend="helion", namespace="examples_helion",
               tunables={"block_sizes": tk.Tunable([(128, 128, 128), (256, 256, 256), (512, 512, 512)])})
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an f32 accumulator. a: [M, K], b: [K, N]."""
    m, k = a.size()
    _, n = b.size()
    out = torch.empty([m, n], dtype=a.dtype, device=a.device)
    for tile_m, tile_n in hl.tile([m, n]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            acc = torch.addmm(acc, a[tile_m, tile_k], b[tile_k, tile_n])
        out[tile_m, tile_n] = acc.to(a.dtype)
    return out


@tk.tpu_kernel(backend="helion", namespace="examples_helion",
               tunables={"block_sizes": tk.Tunable([(16,), (8,), (32,), (64,)])})
def rms_scale(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * w, f32 inside. x: [R, H], w: [H]."""
    out = torch.empty_like(x)
    for tile in hl.tile(x.size(0)):
        row = x[tile, :].to(torch.float32)
        inv = torch.rsqrt(torch.mean(row * row, dim=-1, keepdim=True) + eps)
        out[tile, :] = (row * inv * w[None, :].to(torch.float32)).to(x.dtype)
    return out


def rms_scale_reference(x, w, eps=1e-6):
    x64 = x.double()
    return x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double()


def main():
    from _check import check, exit_with

    g = torch.Generator().manual_seed(0)
    f32, bf16 = torch.float32, torch.bfloat16
    atol = {f32: 1e-5, bf16: 1e-2}
    rtol = {f32: 1e-5, bf16: 8e-3}
    failures = 0
    failures += check("helion vector_add", vector_add, lambda x, y: x + y,
                      [(torch.randn(8192, generator=g), torch.randn(8192, generator=g))],
                      [(vector_add, ("1048576:f32", "1048576:f32"), {})], atol, rtol)
    failures += check("helion softmax", softmax, lambda x: torch.softmax(x, -1),
                      [(torch.randn(128, 256, generator=g),), (torch.randn(64, 512, generator=g).to(bf16),)],
                      [(softmax, ("8192x4096:bf16",), {})], atol, rtol)
    failures += check("helion matmul", matmul, lambda a, b: a @ b,
                      [(torch.randn(256, 384, generator=g), torch.randn(384, 128, generator=g))],
                      [(matmul, ("1024x1024:bf16", "1024x1024:bf16"), {})], {f32: 1e-3}, {f32: 1e-4})
    failures += check("helion rms_scale", rms_scale, rms_scale_reference,
                      [(torch.randn(64, 1024, generator=g), torch.randn(1024, generator=g))],
                      [(rms_scale, ("8192x4096:bf16", "4096:bf16"), {})], atol, rtol)
    exit_with(failures)


if __name__ == "__main__":
    main()
