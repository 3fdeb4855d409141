"""Tensor-parallel styles whose linears run collective matmuls: the sequence-parallel pair of TorchTitan's plans
(``ColwiseParallel(input_layouts=Shard(1))`` after a sequence-parallel norm, ``RowwiseParallel(output_layouts=
Shard(1))`` before the next one) with the all-gather and the reduce-scatter inside the matmul.

Public API (``torch.distributed.tensor.parallel.ParallelStyle`` s for ``parallelize_module`` plans)::

    CollectiveColwiseParallel(*, sequence_dim=1, output_layouts=None, use_local_output=True, check_ranks=True)
    CollectiveRowwiseParallel(*, sequence_dim=1, output_layouts=None, use_local_output=True, check_ranks=True)
    CollectiveColwiseGroup(linears, *, sequence_dim=1, check_ranks=True)   # on the module owning wq / wk / wv

What changes against torch's styles. ``ColwiseParallel(input_layouts=Shard(1))`` redistributes its input to
``Replicate()`` (a whole all-gather, waited on) and then runs ``nn.Linear`` on the gathered activation;
``CollectiveColwiseParallel`` passes the local shard to
:func:`~tpukernels.distributed.collective_matmul.all_gather_matmul_torch`, which multiplies each arrived shard while
the next one travels. ``RowwiseParallel(output_layouts=Shard(1))`` computes a partial sum ``[B, S, N]`` on every
rank and reduce-scatters it; ``CollectiveRowwiseParallel`` runs
:func:`~tpukernels.distributed.collective_matmul.matmul_reduce_scatter_torch`, whose float32 partial sums travel
while the next chunk is multiplied. Only where the plan gathers (or scatters) the sequence does a collective matmul
apply, which is why these are styles of a plan: a DTensor sharding rule (:mod:`.sharding`) runs an op on shards
after DTensor has redistributed them, so the gather has already happened when a rule is consulted. (PyTorch's own
answer, async TP, is a compiler pass over the same plans that needs CUDA symmetric memory.)

TorchTitan-style plans gather once per block for several linears (``PrepareModuleInput`` on ``attention`` ahead
of ``ColwiseParallel`` wq / wk / wv, and on ``feed_forward`` ahead of w1 / w3). ``CollectiveColwiseGroup`` replaces
that pair: applied to the block, it runs one ring whose every arrived shard is multiplied by all the listed weights
(``fused_all_gather_matmul``'s list of ``Bs``), and hands the block the gathered input its code expects.

The parameters are sharded exactly as torch's styles shard them (colwise: weight and bias ``Shard(0)``; rowwise:
weight ``Shard(1)``, bias ``Replicate()``), so checkpoints, optimizers and FSDP see the same DTensors; only the
module's forward differs (an instance attribute set by ``_apply``). The bias is added as a DTensor op, so its
gradient is reduced as in torch's styles.

Autocast: under ``torch.autocast`` the matmuls run in its dtype, as ``F.linear`` does under torch's styles (the
weights are cast per call; ``CollectiveColwiseGroup`` still hands its module the input in the input's dtype).

Errors (typed): a module other than ``nn.Linear`` or a listed linear that does not exist (checked before any
parameter is distributed), a mesh with more than one dim; then, per call, the ring ops' checks, which compare the
ranks first (shapes, dtypes, dims), so that every rank raises or none does: ranks that disagree never leave one
waiting in the ring. A DTensor input is first redistributed to the style's input placement, as torch's styles do.
"""

from __future__ import annotations

import inspect
import types

from ..errors import ArgumentError
from .collective_matmul import all_gather_matmul_torch, matmul_reduce_scatter_torch

__all__ = ["CollectiveColwiseParallel", "CollectiveRowwiseParallel", "CollectiveColwiseGroup"]


def _styles():
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def local_input(x, mesh, placement):
        """The local shard of ``x`` laid out as ``placement`` (a DTensor is redistributed first)."""
        if isinstance(x, DTensor):
            if tuple(x.placements) != (placement,):
                x = x.redistribute(mesh, [placement])
            return x.to_local()
        return x

    def autocast_operands(x, ws):
        """``x`` and the weights in autocast's dtype where autocast is on for x's device (``F.linear`` under
        autocast runs in that dtype; the kernels take one dtype for both operands)."""
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            return x.to(dt), [w.to(dt) for w in ws]
        return x, ws

    def call(style, fn, *args, **kw):
        """``fn(*args, **kw)``, its ArgumentError naming the style (the ring ops check after the ranks agree, so
        every rank raises or none does)."""
        try:
            return fn(*args, **kw)
        except ArgumentError as e:
            raise ArgumentError(f"{type(style).__name__}(sequence_dim={style.sequence_dim}): {e}") from e

    def finish(out, mesh, style):
        """``out`` (a DTensor) in the style's output placement, local or not."""
        want = style.output_layouts[0]
        if isinstance(want, Shard) and want.dim < 0:
            want = Shard(want.dim + out.dim())
        if tuple(out.placements) != (want,):
            out = out.redistribute(mesh, [want])
        return out.to_local() if style.use_local_output else out

    class _Collective(ParallelStyle):
        """What the colwise and rowwise styles share: arguments, parameter sharding, the forward's installation."""

        def __init__(self, *, sequence_dim: int = 1, output_layouts=None, use_local_output: bool = True,
                     check_ranks: bool = True):
            super().__init__()
            if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
                raise ArgumentError(f"{type(self).__name__}: sequence_dim must be an int (the dim of the input's rows "
                                    f"that the plan shards; negative counts from the end), got {sequence_dim!r}")
            self.sequence_dim = sequence_dim
            self.output_layouts = (output_layouts or self.default_output(sequence_dim),)
            self.use_local_output = use_local_output
            self.check_ranks = check_ranks

        def _apply(self, module, device_mesh):
            name = type(self).__name__
            if not isinstance(module, torch.nn.Linear):
                raise ArgumentError(f"{name}: applies to nn.Linear modules, got {type(module).__name__}")
            if device_mesh.ndim != 1:
                raise ArgumentError(f"{name}: needs a 1-D device mesh (the tensor-parallel dim), got "
                                    f"{device_mesh.ndim} dims {tuple(device_mesh.shape)}")
            for pname, placement in self.param_placements(module):
                param = getattr(module, pname)
                dist_param = torch.nn.Parameter(distribute_tensor(param, device_mesh, [placement],
                                                                  src_data_rank=self.src_data_rank),
                                                requires_grad=param.requires_grad)
                module.register_parameter(pname, dist_param)
            module.forward = types.MethodType(self.forward_fn(device_mesh), module)
            return module

        def __repr__(self) -> str:
            return (f"{type(self).__name__}(sequence_dim={self.sequence_dim}, output_layouts={self.output_layouts}, "
                    f"use_local_output={self.use_local_output})")

    class CollectiveColwiseParallel(_Collective):
        """``ColwiseParallel(input_layouts=Shard(sequence_dim))`` for ``nn.Linear`` with the all-gather of the
        sequence-sharded input overlapped inside the matmul (module docstring).

        Args:
            sequence_dim: the input's sharded row dim (1 for TorchTitan's ``[B, S, D]`` activations).
            output_layouts: the output's placement (default ``Shard(-1)``: the local columns, as ColwiseParallel).
            use_local_output: return the local tensor (default) instead of a DTensor.
            check_ranks: compare the ranks' shapes before the ring (one all-gather of a few int64 per call).
        """

        @staticmethod
        def default_output(sequence_dim):
            return Shard(-1)

        @staticmethod
        def param_placements(module):
            return [(n, Shard(0)) for n in ("weight", "bias") if getattr(module, n, None) is not None]

        def forward_fn(self, mesh):
            style, group = self, mesh.get_group()

            def forward(mod, x):
                seq = style.sequence_dim % max(x.dim(), 1)
                x, (w,) = autocast_operands(local_input(x, mesh, Shard(seq)), [mod.weight.to_local()])
                out = call(style, all_gather_matmul_torch, x, w, group, gather_dim=seq,
                           rhs_transpose=True, check_ranks=style.check_ranks)
                out = DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
                if mod.bias is not None:
                    out = out + mod.bias.to(out.dtype)  # Shard(0) bias on the Shard(-1) columns
                return finish(out, mesh, style)

            return forward

    class CollectiveRowwiseParallel(_Collective):
        """``RowwiseParallel(output_layouts=Shard(sequence_dim))`` for ``nn.Linear`` with the reduce-scatter of the
        partial sums overlapped inside the matmul (module docstring). The input is feature-sharded (``Shard(-1)``,
        a colwise output); the output is sequence-sharded.

        Args:
            sequence_dim: the output's sharded row dim; the input's size there must divide by the mesh size.
            output_layouts: the output's placement (default ``Shard(sequence_dim)``; another placement costs a
                redistribution after the ring).
            use_local_output, check_ranks: as :class:`CollectiveColwiseParallel`.
        """

        @staticmethod
        def default_output(sequence_dim):
            return Shard(sequence_dim)

        @staticmethod
        def param_placements(module):
            out = [("weight", Shard(1))]
            return out + ([("bias", Replicate())] if getattr(module, "bias", None) is not None else [])

        def forward_fn(self, mesh):
            style, group = self, mesh.get_group()

            def forward(mod, x):
                x, (w,) = autocast_operands(local_input(x, mesh, Shard(x.dim() - 1)), [mod.weight.to_local()])
                seq = style.sequence_dim % max(x.dim(), 1)
                out = call(style, matmul_reduce_scatter_torch, x, w, group, scatter_dim=seq,
                           rhs_transpose=True, check_ranks=style.check_ranks)
                out = DTensor.from_local(out, mesh, [Shard(seq)], run_check=False)
                if mod.bias is not None:
                    out = out + mod.bias.to(out.dtype)  # Replicate bias on the Shard(sequence_dim) rows
                return finish(out, mesh, style)

            return forward

    class CollectiveColwiseGroup(ParallelStyle):
        """``PrepareModuleInput(input_layouts=Shard(sequence_dim), desired_input_layouts=Replicate())`` on a module
        plus ``ColwiseParallel()`` on its linears ``linears`` (attention's wq / wk / wv, a gated MLP's w1 / w3), with
        one all-gather for all of them inside the matmuls (module docstring).

        The module's forward receives the gathered input, as under torch's plan (a local tensor: the full
        sequence), while its linears' outputs are already computed by one ring (one transfer per shard for every
        weight). A listed linear called with that gathered tensor returns its output from the ring; called with
        anything else (the module transformed its input first) it computes ``F.linear`` on what it gets, as
        ``ColwiseParallel`` with a replicated input would. The gathered input's gradient is reduce-scattered with
        the linears' dx.

        Args:
            linears: the submodule names (``nn.Linear``) that read the module's first input.
            sequence_dim: the input's sharded row dim (1 for ``[B, S, D]``).
            check_ranks: as :class:`CollectiveColwiseParallel`.

        Outputs of the listed linears: local tensors (their columns), as ``ColwiseParallel()``'s.
        """

        def __init__(self, linears, *, sequence_dim: int = 1, check_ranks: bool = True):
            super().__init__()
            if isinstance(linears, str) or not linears or not all(isinstance(n, str) for n in linears):
                raise ArgumentError(f"CollectiveColwiseGroup: linears must be a non-empty list of submodule names, "
                                    f"got {linears!r}")
            if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
                raise ArgumentError(f"CollectiveColwiseGroup: sequence_dim must be an int, got {sequence_dim!r}")
            self.linears, self.sequence_dim, self.check_ranks = tuple(linears), sequence_dim, check_ranks

        def _apply(self, module, device_mesh):
            if device_mesh.ndim != 1:
                raise ArgumentError(f"CollectiveColwiseGroup: needs a 1-D device mesh, got {device_mesh.ndim} dims")
            children = []
            for name in self.linears:  # every name checked before any parameter is distributed
                try:
                    child = module.get_submodule(name)
                except AttributeError:
                    child = None
                if not isinstance(child, torch.nn.Linear):
                    raise ArgumentError(f"CollectiveColwiseGroup: {type(module).__name__} has no nn.Linear {name!r} "
                                        f"(got {type(child).__name__})")
                children.append(child)
            for child in children:
                for pname in ("weight", "bias"):
                    param = getattr(child, pname, None)
                    if param is not None:
                        child.register_parameter(pname, torch.nn.Parameter(
                            distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                            requires_grad=param.requires_grad))
            style, group, state = self, device_mesh.get_group(), {}

            first = next(iter(inspect.signature(module.forward).parameters), None)  # the input's name

            def pre_hook(mod, args, kwargs):
                by_name = not args and first in kwargs  # the block called as block(x=...)
                if not args and not by_name:
                    raise ArgumentError(f"CollectiveColwiseGroup: {type(mod).__name__} was called without its input "
                                        f"(pass it first, or as {first}=...)")
                x = kwargs[first] if by_name else args[0]
                seq = style.sequence_dim % max(x.dim(), 1)
                x = local_input(x, device_mesh, Shard(seq))
                dev = x.device.type  # under autocast the matmuls run in its dtype; the block still gets x's dtype
                dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
                gathered, outs = call(style, all_gather_matmul_torch, x, [c.weight.to_local() for c in children],
                                      group, gather_dim=seq, rhs_transpose=True, return_gathered=True,
                                      compute_dtype=dt, check_ranks=style.check_ranks)
                state.update(x=gathered, outs={id(c): o for c, o in zip(children, outs)})
                if by_name:
                    return args, {**kwargs, first: gathered}
                return (gathered, *args[1:]), kwargs

            def post_hook(mod, args, out):
                state.clear()

            def child_forward(child, inp):
                out = state.get("outs", {}).pop(id(child), None)
                if out is None or inp is not state.get("x"):  # not the gathered input: a colwise linear on it
                    inp = inp.redistribute(device_mesh, [Replicate()]).to_local() if isinstance(inp, DTensor) else inp
                    out = torch.nn.functional.linear(inp, child.weight.to_local())
                return out if child.bias is None else out + child.bias.to_local().to(out.dtype)

            module.register_forward_pre_hook(pre_hook, with_kwargs=True)
            module.register_forward_hook(post_hook)
            for child in children:
                child.forward = types.MethodType(child_forward, child)
            return module

        def __repr__(self) -> str:
            return f"CollectiveColwiseGroup(linears={list(self.linears)}, sequence_dim={self.sequence_dim})"

    return CollectiveColwiseParallel, CollectiveRowwiseParallel, CollectiveColwiseGroup


_CLASSES: dict = {}


def __getattr__(name: str):
    """The styles subclass torch's ``ParallelStyle``, so ``torch.distributed.tensor`` (~1 s to import) loads on
    first use of a style, not on ``import tpukernels``."""
    if name in __all__:
        if not _CLASSES:
            for cls in _styles():
                cls.__module__ = __name__
                _CLASSES[cls.__name__] = cls
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
