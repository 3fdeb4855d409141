"""What each rank of tests/test_distributed.py runs (a real gloo process group on loopback, cpu DeviceMesh).

Every check computes the op twice in the rank: on DTensors (sharded as named) and on the plain full tensors
(the single-process result); rank 0 writes the differences, placements and forward collective counts as JSON
for the test process to assert on. No tests here: pytest collects nothing from this module.
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
import os
import time
import traceback

import torch


def _err(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(name, fn, inputs: dict, placements: dict, mesh):
    """fn(**tensors) -> output (or tuple); inputs: full tensors (float ones get gradients)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    g = torch.Generator().manual_seed(7)
    plain = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    dist_in = {k: distribute_tensor(v.detach().clone(), mesh, placements[k]).requires_grad_(v.is_floating_point())
               for k, v in inputs.items()}
    want = fn(**plain)
    want = want if isinstance(want, tuple) else (want,)
    cotangents = [torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.dtype) for w in want]
    sum(((w * c).sum() for w, c in zip(want, cotangents)), torch.zeros(())).backward()
    with CommDebugMode() as comm:
        got = fn(**dist_in)
    got = got if isinstance(got, tuple) else (got,)
    fwd_comms = int(comm.get_total_counts())
    terms = [(o * distribute_tensor(c, mesh, o.placements)).sum() for o, c in zip(got, cotangents)]
    functools.reduce(operator.add, terms).backward()
    return {
        "name": name,
        "out_placements": [str(o.placements) for o in got],
        "out_err": max(_err(_full(o), w) for o, w in zip(got, want)),
        "grad_err": {k: _err(_full(dist_in[k].grad), plain[k].grad) for k in inputs if plain[k].grad is not None},
        "fwd_collectives": fwd_comms,
    }


def _errors(*cases) -> dict:
    """``{name: the ArgumentError's message, or "no error"}`` of each ``(name, call)``."""
    from tpukernels.errors import ArgumentError

    out = {}
    for name, call in cases:
        try:
            call()
            out[name] = "no error"
        except ArgumentError as exc:
            out[name] = str(exc)
    return out


def dtensor_checks(mesh) -> list[dict]:
    from torch.distributed.tensor import Replicate, Shard

    import tpukernels.library as L

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    R, S0, S1 = [Replicate()], [Shard(0)], [Shard(1)]
    out = []
    x, w, b = r(4, 8, 256), r(256), r(256)
    out.append(_compare("rms_norm rows", lambda x, w: L.rms_norm(x, w), {"x": x, "w": w}, {"x": S0, "w": R}, mesh))
    out.append(_compare("layer_norm rows", lambda x, w, b: L.layer_norm(x, w, b), {"x": x, "w": w, "b": b},
                        {"x": S0, "w": R, "b": R}, mesh))
    res = r(4, 8, 256)
    out.append(_compare("fused_add_rms_norm rows", lambda x, res, w: L.fused_add_rms_norm(x, res, w),
                        {"x": x, "res": res, "w": w}, {"x": S0, "res": S0, "w": R}, mesh))
    q, k, v = r(2, 4, 128, 64), r(2, 2, 128, 64), r(2, 2, 128, 64)
    fa = lambda q, k, v: L.flash_attention(q, k, v, causal=True)  # noqa: E731
    out.append(_compare("flash_attention batch", fa, {"q": q, "k": k, "v": v}, {"q": S0, "k": S0, "v": S0}, mesh))
    out.append(_compare("flash_attention heads", fa, {"q": q, "k": k, "v": v}, {"q": S1, "k": S1, "v": S1}, mesh))
    a, wt, bias = r(64, 128), r(128, 256), r(256)
    mm = lambda a, wt, bias: L.matmul(a, wt, bias=bias)  # noqa: E731
    out.append(_compare("matmul rows (M)", mm, {"a": a, "wt": wt, "bias": bias}, {"a": S0, "wt": R, "bias": R}, mesh))
    out.append(_compare("matmul column-parallel (N)", mm, {"a": a, "wt": wt, "bias": bias},
                        {"a": R, "wt": S1, "bias": S0}, mesh))
    if hasattr(L, "linear_cross_entropy"):  # per-row losses: rows of h and labels split, W replicated
        h, W, labels = r(64, 128), r(512, 128), torch.randint(0, 512, (64,), generator=g)
        out.append(_compare("linear_cross_entropy rows",
                            lambda h, W, labels: L.linear_cross_entropy(h, W, labels, reduction="none"),
                            {"h": h, "W": W, "labels": labels}, {"h": S0, "W": R, "labels": S0}, mesh))
    return out


def fsdp2_llama(mesh, steps: int = 3) -> dict:
    """A tiny Llama (from a config) under FSDP2 ``fully_shard``, stock vs ``apply_tpukernels``: per-step losses
    (each rank its own batch; the loss is averaged over the ranks)."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard

    from tpukernels.integrations.transformers import apply_tpukernels

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(100 + dist.get_rank()))
    out = {}
    for patched in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        model.set_attn_implementation("eager")
        counts = apply_tpukernels(model) if patched else None
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / dist.get_world_size())
        w = model.model.norm.weight
        out["tpukernels" if patched else "stock"] = {
            "losses": losses, "counts": counts, "param_placements": str(getattr(w, "placements", None)),
            "norm_module": type(model.model.norm).__name__,
        }
    return out


def expert_parallel(mesh) -> dict:
    """Expert-parallel dispatch -> local experts -> combine over the group (E = 4 experts, 2 per rank, top-2,
    a different token count per rank), against a float64 reference of single-device top-k MoE: the output, the
    gradients of x, the router weights and this rank's expert weights (which collect every rank's tokens);
    a skewed routing where rank 1 receives nothing; and the typed errors, raised on every rank (none hangs)."""
    import torch.distributed as dist

    from tpukernels.distributed.expert_parallel import ep_combine, ep_dispatch

    rank, n = dist.get_rank(), dist.get_world_size()
    E, D, O, k = 4, 128, 128, 2
    el = E // n
    W = torch.randn(E, D, O, generator=torch.Generator().manual_seed(1)) / D ** 0.5  # the same on every rank
    res = {}
    for case in ("random", "skew"):
        gen = torch.Generator().manual_seed(10 * rank + (case == "skew"))
        T = 5 + rank
        x = torch.randn(T, D, generator=gen)
        hi = el if case == "skew" else E  # skew: every copy to rank 0's experts
        ids = torch.randint(0, hi, (T, k), generator=gen)
        w = torch.rand(T, k, generator=gen)
        g = torch.randn(T, O, generator=gen)
        x_ = x.clone().requires_grad_()
        w_ = w.clone().requires_grad_()
        W_local = W[rank * el:(rank + 1) * el].clone().requires_grad_()
        xs, sizes, h = ep_dispatch(x_, ids, E, mesh)
        e = torch.repeat_interleave(torch.arange(el), sizes.long())  # local expert of each received row
        y = torch.einsum("rd,rdo->ro", xs, W_local[e])
        out = ep_combine(y, w_, h)
        (out * g).sum().backward()
        # float64 reference; dW needs every rank's tokens: gather them
        per = torch.einsum("td,tjdo->tjo", x.double(), W.double()[ids])
        ref = (per * w.double()[..., None]).sum(1)
        ref_dx = torch.einsum("tj,tjdo,to->td", w.double(), W.double()[ids], g.double())
        ref_dw = torch.einsum("tjo,to->tj", per, g.double())
        allx, allids, allw, allg = ([None] * n for _ in range(4))
        for buf, t in ((allx, x), (allids, ids), (allw, w), (allg, g)):
            dist.all_gather_object(buf, t)
        X, I, Wt, G = (torch.cat(b) for b in (allx, allids, allw, allg))
        dW = torch.zeros(E, D, O, dtype=torch.float64)
        for j in range(k):  # dW[e] += sum over copies routed to e of w * x^T g
            dW.index_add_(0, I[:, j], torch.einsum("td,to->tdo", X.double() * Wt.double()[:, j, None], G.double()))
        counts = torch.bincount(I.reshape(-1), minlength=E)[rank * el:(rank + 1) * el]
        res[case] = {"out": _err(out, ref), "dx": _err(x_.grad, ref_dx), "dw": _err(w_.grad, ref_dw),
                     "dW": _err(W_local.grad, dW[rank * el:(rank + 1) * el]), "rows": int(xs.shape[0]),
                     "sizes": sizes.tolist(), "want_sizes": counts.tolist()}
    res["torchtitan"] = _torchtitan_dispatcher_parity(mesh, W, E, D, k, el, rank)
    res["errors"] = _errors(
        ("indivisible", lambda: ep_dispatch(torch.randn(3, D), torch.zeros(3, k, dtype=torch.long), 3, mesh)),
        ("hidden_mismatch", lambda: ep_dispatch(torch.randn(3, D * (1 + rank)), torch.zeros(3, k, dtype=torch.long),
                                                E, mesh)),
        # failures only one rank's own checks would see (its x 3-D, its ids out of range): every rank raises
        ("x_3d_on_one_rank", lambda: ep_dispatch(torch.randn(*((3, D) if rank == 0 else (1, 3, D))),
                                                 torch.zeros(3, k, dtype=torch.long), E, mesh)),
        ("ids_out_of_range_on_one_rank", lambda: ep_dispatch(torch.randn(3, D),
                                                             torch.full((3, k), E * rank, dtype=torch.long), E, mesh)))
    return res


def _torchtitan_dispatcher_parity(mesh, W, E, D, k, el, rank) -> dict:
    """tpukernels' TorchTitan token dispatcher vs TorchTitan's AllToAllTokenDispatcher (dtensor backend) on the
    same tokens, scores and expert weights: outputs and gradients (tokens, scores, this rank's experts)."""
    from tpukernels.integrations.torchtitan_ep import token_dispatcher_class

    ours = token_dispatcher_class()  # first: it installs the CPU placeholders torchtitan's MoE modules import
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    set_spmd_backend("dtensor")
    gen = torch.Generator().manual_seed(20 + rank)
    T = 6 + rank
    x = torch.randn(T, D, generator=gen)
    ids = torch.randint(0, E, (T, k), generator=gen)
    scores = torch.rand(T, k, generator=gen)
    g = torch.randn(T, W.shape[2], generator=gen)
    got = {}
    for name, cls in (("ours", ours), ("torchtitan", AllToAllTokenDispatcher)):
        d = cls(cls.Config(num_experts=E, top_k=k))
        d.wire_meshes(ep_mesh=mesh)
        x_, s_ = x.clone().requires_grad_(), scores.clone().requires_grad_()
        W_local = W[rank * el:(rank + 1) * el].clone().requires_grad_()
        routed, sizes, meta = d.dispatch(x_, s_, ids, torch.bincount(ids.reshape(-1), minlength=E))
        e = torch.repeat_interleave(torch.arange(el), sizes.long())
        out = d.combine(torch.einsum("rd,rdo->ro", routed, W_local[e]), meta, x_)
        (out * g).sum().backward()
        got[name] = (out.detach(), x_.grad, s_.grad, W_local.grad, sizes.tolist())
    a, b = got["ours"], got["torchtitan"]
    return {"out": _err(a[0], b[0]), "dx": _err(a[1], b[1]), "dscores": _err(a[2], b[2]), "dW": _err(a[3], b[3]),
            "sizes_equal": a[4] == b[4]}


def ring_attention_torch(mesh) -> dict:
    """Ring attention from torch over the group (each rank its sequence shard): output and dq/dk/dv against a
    float64 dense attention of the global tensors, causal with the zigzag load balance (GQA 2:1) and
    non-causal (f32)."""
    import torch.distributed as dist

    from tpukernels.distributed.ring_attention import ring_attention_torch as ring, zigzag_permute

    rank, n = dist.get_rank(), dist.get_world_size()
    res = {}
    for name, causal, hq, hkv in (("causal_zigzag_gqa", True, 4, 2), ("non_causal", False, 2, 2)):
        g = torch.Generator().manual_seed(3)
        B, S, D = 1, 64, 128
        q, k, v, do = (torch.randn(B, h, S, D, generator=g) for h in (hq, hkv, hkv, hq))
        # float64 reference in the natural order
        qq, kk, vv = q.double().requires_grad_(), k.double().requires_grad_(), v.double().requires_grad_()
        rep = hq // hkv
        s = torch.einsum("bhqd,bhkd->bhqk", qq, kk.repeat_interleave(rep, 1)) / D ** 0.5
        if causal:
            s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -float("inf"))
        ref = torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), vv.repeat_interleave(rep, 1))
        (ref * do.double()).sum().backward()
        order = (lambda x: zigzag_permute(x, n, 2)) if causal else (lambda x: x)
        shard = lambda x: order(x).chunk(n, 2)[rank].contiguous()  # noqa: E731
        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        out = ring(ql, kl, vl, mesh, causal=causal)
        (out * shard(do)).sum().backward()
        res[name] = {"out": _err(out, shard(ref.detach())), "dq": _err(ql.grad, shard(qq.grad)),
                     "dk": _err(kl.grad, shard(kk.grad)), "dv": _err(vl.grad, shard(vv.grad))}
    return res


def tensor_parallel(mesh) -> dict:
    """The sequence-parallel MLP ``w2(gelu(w1(x)))`` (x ``[B, S, D]`` sharded on S) under tpukernels'
    CollectiveColwiseParallel / CollectiveRowwiseParallel against torch's ColwiseParallel(input_layouts=Shard(1)) /
    RowwiseParallel(output_layouts=Shard(1)) on the same weights, and both against a float64 reference: the local
    output, dx and every parameter's full gradient; the forward's collectives by kind; the functional ops in bf16
    with gather / scatter on dim 0; and typed errors on every rank."""
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tpukernels.distributed.collective_matmul import all_gather_matmul_torch, matmul_reduce_scatter_torch
    from tpukernels.distributed.tensor_parallel import CollectiveColwiseParallel, CollectiveRowwiseParallel

    rank, n = dist.get_rank(), dist.get_world_size()
    B, S, D, H = 2, 16, 128, 256
    torch.manual_seed(0)  # the same weights and data on every rank
    base = torch.nn.Sequential()
    base.add_module("w1", torch.nn.Linear(D, H))
    base.add_module("act", torch.nn.GELU(approximate="tanh"))
    base.add_module("w2", torch.nn.Linear(H, D))
    x, dout = torch.randn(B, S, D), torch.randn(B, S, D)
    # float64 reference of the whole sequence
    ref = copy.deepcopy(base).double()
    xr = x.double().requires_grad_()
    yr = ref(xr)
    (yr * dout.double()).sum().backward()
    rows = slice(rank * S // n, (rank + 1) * S // n)
    res = {}
    for name, plan in (("tpukernels", {"w1": CollectiveColwiseParallel(), "w2": CollectiveRowwiseParallel()}),
                       ("torch", {"w1": ColwiseParallel(input_layouts=Shard(1)),
                                  "w2": RowwiseParallel(output_layouts=Shard(1))})):
        model = parallelize_module(copy.deepcopy(base), mesh, plan)
        xl = x[:, rows].clone().requires_grad_()
        with CommDebugMode() as comm:
            y = model(xl)
        counts = {str(k): int(v) for k, v in comm.get_comm_counts().items()}
        (y * dout[:, rows]).sum().backward()
        grads = {pn: _err(p.grad.full_tensor(), dict(ref.named_parameters())[pn].grad)
                 for pn, p in model.named_parameters()}
        res[name] = {"out": _err(y, yr[:, rows]), "dx": _err(xl.grad, xr.grad[:, rows]), "grads": grads,
                     "fwd_comms": counts, "out_shape": list(y.shape),
                     "placements": {pn: str(p.placements) for pn, p in model.named_parameters()}}
    # a block whose three linears read one gathered input (attention's wq / wk / wv): CollectiveColwiseGroup vs
    # torch's PrepareModuleInput + ColwiseParallel; wv reads a transformed input (the local fallback)
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from tpukernels.distributed.tensor_parallel import CollectiveColwiseGroup

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = torch.nn.Linear(D, H), torch.nn.Linear(D, H), torch.nn.Linear(D, H, bias=False)
            self.wo = torch.nn.Linear(H, D)

        def forward(self, x):
            b, s, _ = x.shape  # the full sequence, as under torch's plan
            return self.wo((self.wq(x) * torch.sigmoid(self.wk(x)) + self.wv(x * 0.5)).reshape(b, s, -1))

    torch.manual_seed(1)
    mixer = torch.nn.Sequential()
    mixer.add_module("mix", Mixer())
    ref = copy.deepcopy(mixer).double()
    xr = x.double().requires_grad_()
    yr = ref(xr)
    (yr * dout.double()).sum().backward()
    def block_plans(prefix):  # (name, plan) for tpukernels' styles and torch's on the block; fresh styles per call
        return ((prefix, {"mix": CollectiveColwiseGroup(["wq", "wk", "wv"]), "mix.wo": CollectiveRowwiseParallel()}),
                (prefix + "_torch", {"mix": PrepareModuleInput(input_layouts=(Shard(1),),
                                                               desired_input_layouts=(Replicate(),)),
                                     "mix.wq": ColwiseParallel(), "mix.wk": ColwiseParallel(),
                                     "mix.wv": ColwiseParallel(), "mix.wo": RowwiseParallel(output_layouts=Shard(1))}))

    for name, plan in block_plans("group"):
        model = parallelize_module(copy.deepcopy(mixer), mesh, plan)
        xl = x[:, rows].clone().requires_grad_()
        with CommDebugMode() as comm:
            y = model(xl)
        (y * dout[:, rows]).sum().backward()
        grads = {pn: _err(p.grad.full_tensor(), dict(ref.named_parameters())[pn].grad)
                 for pn, p in model.named_parameters()}
        res[name] = {"out": _err(y, yr[:, rows]), "dx": _err(xl.grad, xr.grad[:, rows]), "grads": grads,
                     "fwd_comms": {str(k): int(v) for k, v in comm.get_comm_counts().items()}}
    # under torch.autocast (bf16): both plans run their matmuls in bf16 (bf16 outputs), gradients reach the float32
    # weights; against torch's styles under the same autocast. The block is also called by keyword.
    for name, plan in block_plans("autocast"):
        model = parallelize_module(copy.deepcopy(mixer), mesh, plan)
        xl = x[:, rows].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model.mix(x=xl) if name == "autocast" else model.mix(xl)  # torch's PrepareModuleInput: positional
        y.float().mul(dout[:, rows]).sum().backward()
        res[name] = {"dtype": str(y.dtype), "y": y.detach().float(), "dx": xl.grad.clone(),
                     "grads": {pn: p.grad.full_tensor() for pn, p in model.named_parameters()}}
    a, b = res.pop("autocast"), res.pop("autocast_torch")
    res["autocast"] = {"dtypes": [a["dtype"], b["dtype"]], "out": _err(a["y"], b["y"]), "dx": _err(a["dx"], b["dx"]),
                       "grads": {pn: _err(a["grads"][pn], b["grads"][pn]) for pn in a["grads"]},
                       "ref_out": _err(a["y"], yr[:, rows])}
    # the functional ops: bf16, rows gathered / scattered on dim 0, [K, N] weights (rhs_transpose=False)
    g = torch.Generator().manual_seed(5)
    xa, wa = torch.randn(8 * n, D, generator=g), torch.randn(D, 2 * H, generator=g) / D ** 0.5
    xs = xa.chunk(n)[rank].bfloat16().requires_grad_()
    ws = wa.chunk(n, 1)[rank].bfloat16().requires_grad_()
    out = all_gather_matmul_torch(xs, ws, mesh, gather_dim=0)
    da = torch.randn(8 * n, 2 * H, generator=g)
    (out.float() * da.chunk(n, 1)[rank]).sum().backward()
    xa64, wa64 = xa.bfloat16().double(), wa.bfloat16().double()  # float64 from the bf16 inputs
    res["ag_bf16"] = {"out": _err(out, (xa64 @ wa64).chunk(n, 1)[rank]),
                      "dx": _err(xs.grad, (da.double() @ wa64.T).chunk(n)[rank]),
                      "dw": _err(ws.grad, (xa64.T @ da.double()).chunk(n, 1)[rank])}
    xk = xa64.chunk(n, 1)  # row-parallel: x split on K, w on K
    xs2 = xa.bfloat16().chunk(n, 1)[rank].contiguous().requires_grad_()
    wk = torch.randn(D, H, generator=g).bfloat16()
    ws2 = wk.chunk(n)[rank].contiguous().requires_grad_()
    out2 = matmul_reduce_scatter_torch(xs2, ws2, mesh, scatter_dim=0)
    db = torch.randn(8 * n, H, generator=g)
    (out2.float() * db.chunk(n)[rank]).sum().backward()
    full = xa64 @ wk.double()
    res["rs_bf16"] = {"out": _err(out2, full.chunk(n)[rank]),
                      "dx": _err(xs2.grad, (db.double() @ wk.double().T).chunk(n, 1)[rank]),
                      "dw": _err(ws2.grad, (xk[rank].T @ db.double()))}
    half, dtypes = Mixer(), (torch.float32, torch.bfloat16)
    res["errors"] = _errors(
        ("indivisible", lambda: matmul_reduce_scatter_torch(torch.randn(3, D), torch.randn(D, H), mesh)),
        ("contraction", lambda: all_gather_matmul_torch(torch.randn(4, D), torch.randn(D + 1, H), mesh)),
        ("last_dim", lambda: all_gather_matmul_torch(torch.randn(4, D), torch.randn(D, H), mesh, gather_dim=-1)),
        ("rank_mismatch", lambda: all_gather_matmul_torch(torch.randn(4 + rank, D), torch.randn(D, H), mesh)),
        ("not_linear", lambda: parallelize_module(torch.nn.GELU(), mesh, CollectiveColwiseParallel())),
        ("group_missing", lambda: parallelize_module(half, mesh, CollectiveColwiseGroup(["wq", "w_nope"]))),
        # ranks that disagree in ways each rank's own checks would catch differently: all raise together
        ("ndim_mismatch", lambda: all_gather_matmul_torch(torch.randn(*((4, D) if rank == 0 else (1, 4, D))),
                                                          torch.randn(D, H), mesh)),
        ("rank_indivisible", lambda: matmul_reduce_scatter_torch(torch.randn(4 - rank, D), torch.randn(D, H), mesh)),
        ("dtype_mismatch", lambda: all_gather_matmul_torch(torch.randn(4, D).to(dtypes[rank]),
                                                           torch.randn(D, H).to(dtypes[rank]), mesh)))
    res["group_missing_left_plain"] = not any(isinstance(p, DTensor) for p in half.parameters())
    return res


_SHIMS: list = []  # torch.library registrations the checks make for this worker process (kept alive)


def async_tp(mesh) -> dict:
    """PyTorch's async-TP ops (``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``,
    registered for cpu by ``register_symm_mem_ops``) against float64 from the same inputs, and TorchTitan's fused
    TP linears over them: its ``AllGatherFusedFeedForward`` SwiGLU (``AllGatherLinearMulti`` for w1 / w3,
    ``LinearReduceScatter`` for w2), forward and backward, against float64 autograd on the unsharded problem."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchtitan.distributed.linear import AllGatherLinearMulti, LinearReduceScatter

    from tpukernels.distributed.async_tp import register_symm_mem_ops

    import torch.distributed._symmetric_memory  # noqa: F401  (defines the ops: torch implements them for CUDA only)

    x0 = torch.ones(2, 4)
    try:
        torch.ops.symm_mem.fused_all_gather_matmul(x0, [x0.T], 0, mesh.get_group().group_name)
        res = {"cpu_kernel_before": True}
    except NotImplementedError:  # expected: torch has no cpu kernel for the op (asserted in test_distributed.py)
        res = {"cpu_kernel_before": False}
    res.update(registered=register_symm_mem_ops(("CPU",)), registered_again=register_symm_mem_ops("CPU"))
    try:  # TorchTitan's wgrad calls torch.mm(..., out_dtype=f32): aten::mm.dtype has no CPU kernel in torch 2.13
        torch.mm(torch.ones(1, 1), torch.ones(1, 1), out_dtype=torch.float32)
    except NotImplementedError:  # a test-process shim (this worker only): the product in out_dtype
        _SHIMS.append(torch.library.Library("aten", "IMPL"))
        _SHIMS[-1].impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.to(out_dtype), b.to(out_dtype)), "CPU")
    group = mesh.get_group()
    name, rank, n = group.group_name, dist.get_rank(), dist.get_world_size()
    ops = torch.ops.symm_mem
    g = torch.Generator().manual_seed(3)  # the same full tensors on every rank; each takes its shards
    T, D, H = 8, 16, 24  # tokens per rank, hidden, ffn
    x = torch.randn(n * T, D, generator=g)
    w1, w3 = torch.randn(H, D, generator=g) * 0.3, torch.randn(H, D, generator=g) * 0.3
    w2 = torch.randn(D, H, generator=g) * 0.3
    rows, cols = slice(rank * T, (rank + 1) * T), slice(rank * H // n, (rank + 1) * H // n)
    d = lambda t: t.double()  # noqa: E731
    # all-gather matmul: a transposed [N, K] weight view (read in place) and a [K, N] operand (made contiguous)
    A, outs = ops.fused_all_gather_matmul(x[rows], [w1[cols].T, w3[cols].T.contiguous()], 0, name)
    res["ag_A"] = _err(A, d(x))
    res["ag_outs"] = max(_err(outs[0], d(x) @ d(w1[cols]).T), _err(outs[1], d(x) @ d(w3[cols]).T))
    none, (o,) = ops.fused_all_gather_matmul(x[rows], [w1[cols].T], 0, name, return_A=False)
    res["ag_no_A"] = none is None and _err(o, d(x) @ d(w1[cols]).T) < 1e-5
    kcols = slice(rank * D // n, (rank + 1) * D // n)  # gathering the contraction dim (torch's reference semantics)
    A, (o,) = ops.fused_all_gather_matmul(x[:, kcols], [w1.T], -1, name)
    res["ag_last_dim"] = max(_err(A, d(x)), _err(o, d(x) @ d(w1).T))
    # matmul reduce-scatter: each rank holds H / n of the contraction dim
    h = torch.randn(n * T, H, generator=g)
    want = d(h) @ d(w2).T
    res["rs_sum"] = _err(ops.fused_matmul_reduce_scatter(h[:, cols], w2[:, cols].T, "sum", 0, name), want[rows])
    res["rs_avg"] = _err(ops.fused_matmul_reduce_scatter(h[:, cols], w2[:, cols].T, "avg", 0, name), want[rows] / n)
    res["rs_last_dim"] = _err(ops.fused_matmul_reduce_scatter(h[:, cols], w2[:, cols].T, "sum", 1, name),
                              want[:, kcols])
    res["errors"] = _errors(
        ("reduce_op", lambda: ops.fused_matmul_reduce_scatter(h[:, cols], w2[:, cols].T, "max", 0, name)),
        # one rank's bad reduce_op, and ranks with different ones: compared first, so every rank raises
        ("reduce_op_one_rank", lambda: ops.fused_matmul_reduce_scatter(h[:, cols], w2[:, cols].T,
                                                                       ("max", "sum")[rank], 0, name)),
        ("reduce_op_differs", lambda: ops.fused_matmul_reduce_scatter(h[:, cols], w2[:, cols].T,
                                                                      ("sum", "avg")[rank], 0, name)),
        ("rank_mismatch", lambda: ops.fused_all_gather_matmul(x[: T - rank], [w1[cols].T], 0, name)),
        # the unfused last-dim paths refuse what the rings refuse, with the same typed error
        ("last_dim_dtype", lambda: ops.fused_all_gather_matmul(x[:, kcols], [w1.T.double()], -1, name)),
        ("last_dim_k", lambda: ops.fused_matmul_reduce_scatter(h[:, cols], w2.T, "sum", 1, name)))
    # TorchTitan's fused SwiGLU FFN (AllGatherFusedFeedForward.forward) on these ops
    xs, w1s, w3s, w2s = (t.clone().requires_grad_() for t in (x[rows], w1[cols], w3[cols], w2[:, cols]))
    h1, h3 = AllGatherLinearMulti.apply(xs, w1s, w3s, group, name)
    y = LinearReduceScatter.apply(F.silu(h1) * h3, w2s, None, group, name)
    dy = torch.randn(n * T, D, generator=g)
    y.backward(dy[rows])
    ref = [d(t).requires_grad_() for t in (x, w1, w3, w2)]
    yr = (F.silu(ref[0] @ ref[1].T) * (ref[0] @ ref[2].T)) @ ref[3].T
    yr.backward(d(dy))
    res["titan_ffn"] = {"y": _err(y, yr[rows]), "dx": _err(xs.grad, ref[0].grad[rows]),
                        "dw1": _err(w1s.grad, ref[1].grad[cols]), "dw3": _err(w3s.grad, ref[2].grad[cols]),
                        "dw2": _err(w2s.grad, ref[3].grad[:, cols])}
    res["titan_modules"] = _titan_dist_gemm_modules(rank, n)  # last: it switches TorchTitan's spmd backend
    return res


def _titan_dist_gemm_modules(rank: int, n: int) -> dict:
    """TorchTitan's dist_gemm modules themselves (``AllGatherFusedFeedForward``; ``RowParallelLinear`` with a
    bias), built from their configs under its ``spmd_types`` backend on a 1-D "tp" mesh, on [B, S, *] inputs
    sharded on S: forward and backward against float64 autograd on the unsharded problem."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from tpukernels.integrations import torchtitan_compat

    torchtitan_compat.install()  # torchtitan.models.common imports its triton MoE kernels
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.dist_gemm import AllGatherFusedFeedForward, RowParallelLinear
    from torchtitan.models.common.linear import Linear

    set_spmd_backend("spmd_types")
    tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(11)
    B, S, D, H = 2, 8, 16, 24
    seq, hid = slice(rank * S // n, (rank + 1) * S // n), slice(rank * H // n, (rank + 1) * H // n)
    x, h, dy = torch.randn(B, S, D, generator=g), torch.randn(B, S, H, generator=g), torch.randn(B, S, D, generator=g)
    w1, w3, w2 = (torch.randn(*shape, generator=g) * 0.3 for shape in ((H, D), (H, D), (D, H)))
    b2 = torch.randn(D, generator=g)
    ffn = AllGatherFusedFeedForward.Config(w1=Linear.Config(in_features=D, out_features=H // n),
                                           w2=Linear.Config(in_features=H // n, out_features=D),
                                           w3=Linear.Config(in_features=D, out_features=H // n)).build()
    row = RowParallelLinear.Config(in_features=H // n, out_features=D, bias=True).build()
    with torch.no_grad():
        for p_, full in ((ffn.w1.weight, w1[hid]), (ffn.w3.weight, w3[hid]), (ffn.w2.weight, w2[:, hid]),
                         (row.weight, w2[:, hid]), (row.bias, b2)):
            p_.copy_(full)
    xs, hs = x[:, seq].clone().requires_grad_(), h[:, :, hid].clone().requires_grad_()
    with set_current_spmd_mesh(tp):
        y, z = ffn(xs), row(hs)
    y.backward(dy[:, seq])
    z.backward(dy[:, seq])
    f = [t.double().requires_grad_() for t in (x, w1, w3, w2)]  # float64 references from the same values
    yr = (F.silu(f[0] @ f[1].T) * (f[0] @ f[2].T)) @ f[3].T
    yr.backward(dy.double())
    r = [t.double().requires_grad_() for t in (h, w2, b2)]
    zr = r[0] @ r[1].T + r[2]
    zr.backward(dy.double())
    return {"ffn": {"y": _err(y, yr[:, seq]), "dx": _err(xs.grad, f[0].grad[:, seq]),
                    "dw1": _err(ffn.w1.weight.grad, f[1].grad[hid]), "dw3": _err(ffn.w3.weight.grad, f[2].grad[hid]),
                    "dw2": _err(ffn.w2.weight.grad, f[3].grad[:, hid])},
            "row_parallel": {"y": _err(z, zr[:, seq]), "dx": _err(hs.grad, r[0].grad[:, :, hid]),
                             "dw": _err(row.weight.grad, r[1].grad[:, hid]), "db": _err(row.bias.grad, r[2].grad)}}


def worker(rank: int, world: int, port: int, outdir: str, checks: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    results: dict = {"rank": rank, "seconds": {}}
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (world,))
        for name in checks:
            t = time.monotonic()
            results[name] = globals()[name](mesh)
            results["seconds"][name] = round(time.monotonic() - t, 1)
    except BaseException:
        results["error"] = traceback.format_exc()
    finally:
        results["seconds"]["total"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()
