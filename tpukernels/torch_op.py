"""Register a :class:`TpuKernel` as ``torch.ops.<namespace>.<name>``.

* The schema comes from the launch function's annotations (tensor and static parameters) plus a
  trailing keyword-only ``str? config=None`` (a JSON tuning config; ``None`` lets dispatch choose).
* Kernels: ``cpu`` (Pallas interpret mode) and ``PrivateUse1`` (TorchTPU's ``tpu`` device).
* Fake kernel: output shapes from the launch function (or ``out_shape=``) evaluated on the fake
  tensors' sizes, which may be SymInts, so ``torch.compile(dynamic=True)`` traces one graph for all sizes.
  torch_tpu's ``jax_op`` needs concrete sizes; this does not.
* Autograd: ``register_autograd`` when the kernel has a backward (:meth:`TpuKernel.def_backward`). A backward is
  differentiable once unless declared ``double_backward=True``: differentiating it raises
  :class:`~tpukernels.errors.NotSupportedError` naming the op (:func:`_once_differentiable`).
"""

from __future__ import annotations

import inspect
from typing import Optional

from .dsl import hooks
from .dsl.hooks import KERNEL_CALLS
from .dsl.kernel import BackwardContext, TpuKernel
from .errors import KernelDefinitionError, NotSupportedError

_LIBS: dict = {}


def _op_signature(kernel: TpuKernel) -> inspect.Signature:
    params = []
    for p in kernel.params:
        kind = inspect.Parameter.KEYWORD_ONLY if p.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(p.name, kind, default=p.default, annotation=p.annotation))
    params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[str]))
    return inspect.Signature(params, return_annotation=kernel.return_annotation)


def _split(kernel: TpuKernel, args: tuple, kwargs: dict) -> tuple[list, str | None]:
    """Op call arguments -> (values in kernel.params order, config json)."""
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    values = kernel.bind(args, kwargs)
    return values, config


def register_op(kernel: TpuKernel):
    """Create the custom op for ``kernel`` and register its cpu, PrivateUse1 and fake kernels."""
    import torch

    sig = _op_signature(kernel)

    from .targets.dispatch import run_torch

    kw_only = [p.name for p in kernel.params if p.keyword_only]
    positional = [p for p in kernel.params if not p.keyword_only]
    kw_defaults = {p.name: p.default for p in kernel.params if p.keyword_only}

    def impl(*args, config=None, **kwargs):
        # Hot path: the dispatcher passes positional schema args positionally and keyword-only ones by
        # name, but may drop trailing arguments that equal their defaults; restore those.
        if len(args) < len(positional):
            args = tuple(args) + tuple(p.default for p in positional[len(args):])
        if kw_only:
            return run_torch(kernel, list(args) + [kwargs.get(n, kw_defaults[n]) for n in kw_only], config)
        return run_torch(kernel, args, config)

    impl.__signature__ = sig
    impl.__name__ = kernel.name
    impl.__doc__ = kernel.__doc__
    try:
        op = torch.library.custom_op(kernel.qualname, impl, mutates_args=(), device_types="cpu")
    except RuntimeError as e:
        raise KernelDefinitionError(f"tpu_kernel: cannot register torch op {kernel.qualname}: {e}") from e
    except ValueError as e:
        raise KernelDefinitionError(f"tpu_kernel: schema for {kernel.qualname} is not supported by torch: {e}") from e

    lib = _LIBS.get(kernel.namespace)
    if lib is None:
        lib = _LIBS[kernel.namespace] = torch.library.Library(kernel.namespace, "FRAGMENT")
    lib.impl(kernel.name, impl, "PrivateUse1")

    def fake(*args, **kwargs):
        from .lowering import specs_from_values
        from .dsl.dtypes import to_torch_dtype

        from .dsl.spec import parse_config_json
        from .targets import check_devices

        values, config = _split(kernel, args, kwargs)
        tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        check_devices(kernel, tensors)  # cpu + meta dispatches here: never hand back an empty() result
        specs, statics = specs_from_values(kernel, values)
        calls = KERNEL_CALLS.get()
        if calls is not None:
            calls.append((kernel, values, config))
        device = tensors[0][1].device
        outs = kernel.out_specs_for(specs, statics, parse_config_json(config, f"{kernel.qualname}: config", kernel) if config else None)
        res = [torch.empty(tuple(o.shape), dtype=to_torch_dtype(o.dtype), device=device) for o in outs]
        return tuple(res) if kernel.returns_tuple else res[0]

    fake.__signature__ = sig
    op.register_fake(fake)
    if kernel._backward is not None:
        kernel.op = op
        register_backward(kernel)
    else:  # torch's own message would say "use register_autograd"; def_backward later replaces this
        op.register_autograd(_no_backward(kernel))
    on_op_registered = hooks.implementation("op_registered", required=False)
    if on_op_registered is not None:
        on_op_registered(kernel, op)  # DTensor sharding rule (now, or when torch.distributed.tensor loads)
    return op


def _no_backward(kernel: TpuKernel):
    """The backward of a kernel that has none: a typed error naming the kernel and :meth:`def_backward`."""

    def backward(ctx, *grads):
        raise KernelDefinitionError(
            f"{kernel.qualname}: this kernel has no backward, so gradients cannot flow through it; define one "
            f"with @{kernel.name}.def_backward (fn(ctx, *grad_outputs) -> {{arg_name: grad}}), or call it on "
            f"tensors that do not require grad (torch.no_grad(), .detach())")

    return backward


def register_backward(kernel: TpuKernel) -> None:
    """Wire :meth:`TpuKernel.def_backward` into ``torch.library.register_autograd``."""
    import torch

    names = [p.name for p in kernel.params]
    tensor_names = {p.name for p in kernel.params if p.kind != "static"}

    positional = [p.name for p in kernel.params if not p.keyword_only]

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        kw = {k: v for k, v in (keyword_only_inputs or {}).items() if k != "config"}
        values = kernel.bind(tuple(inputs), kw)
        outs = output if isinstance(output, tuple) else (output,)
        is_tensor = [isinstance(v, torch.Tensor) for v in values]
        ctx.save_for_backward(*[v for v, t in zip(values, is_tensor) if t], *outs)
        ctx.tpk_meta = (is_tensor, [None if t else v for v, t in zip(values, is_tensor)], len(outs))

    def backward(ctx, *grads):
        if kernel._double_backward or not torch.is_grad_enabled():
            return run_backward(ctx, *grads)
        # create_graph=True: run the backward without recording it, then make its results raise if differentiated
        with torch.no_grad():
            res = run_backward(ctx, *grads)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*grads, *ctx.saved_tensors)):
            return res
        return _once_differentiable(kernel, res)

    def run_backward(ctx, *grads):
        is_tensor, plain, n_out = ctx.tpk_meta
        saved = ctx.saved_tensors
        ins, outs = iter(saved[: len(saved) - n_out]), tuple(saved[len(saved) - n_out :])
        args, needs = {}, {}
        for i, n in enumerate(names):
            if is_tensor[i]:
                args[n] = next(ins)
                needs[n] = bool(ctx.needs_input_grad[positional.index(n)]) if n in positional else False
            else:
                args[n] = plain[i]
        # DTensor outputs: autograd materializes the gradient of an unused output as a plain zeros tensor,
        # which cannot meet the DTensor gradients; give it the output's placement.
        grads = tuple(torch.zeros_like(o) if type(g) is torch.Tensor and type(o) is not torch.Tensor
                      and isinstance(o, torch.Tensor) and not bool(g.any()) else g for g, o in zip(grads, outs))
        res = kernel._backward(BackwardContext(args, outs, needs), *grads)
        if not isinstance(res, dict):
            raise KernelDefinitionError(f"{kernel.qualname}: backward must return {{arg_name: grad}}, got {type(res).__name__}")
        unknown = set(res) - tensor_names
        if unknown:
            raise KernelDefinitionError(f"{kernel.qualname}: backward returned grads for non-tensor args {sorted(unknown)}")
        # keyword-only op arguments (config included) are not differentiable in torch.library
        return tuple(res.get(n) for n in positional)

    kernel.op.register_autograd(backward, setup_context=setup_context)


def _once_differentiable(kernel: TpuKernel, grads: tuple) -> tuple:
    """``grads`` (a backward's results, computed without a graph) as tensors whose own backward raises
    :class:`NotSupportedError` naming the op: a double backward through ``kernel`` fails with that error where it
    would otherwise hit an inner kernel without a backward, or silently miss terms (what
    ``torch.autograd.function.once_differentiable`` does, with a typed error instead of a ``RuntimeError``)."""
    import torch

    op = kernel._backward_op or kernel.qualname
    message = (f"{op}: double backward is not supported (the gradient of {op}'s gradient: "
               f"torch.autograd.grad(..., create_graph=True) and then a backward through that gradient); "
               f"{kernel.qualname}'s backward is differentiable once. Compute second derivatives of {op} with a "
               f"torch reference implementation, or do not differentiate its gradient")

    idx = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and g.dtype.is_floating_point]
    if not idx:
        return grads
    leaves = [grads[i].detach().requires_grad_() for i in idx]
    guarded = _double_backward_guard().apply((message, op), *leaves)
    out = list(grads)
    for i, g in zip(idx, guarded):
        out[i] = g
    return tuple(out)


_GUARD = None


def _double_backward_guard():
    """The autograd function of :func:`_once_differentiable` (made once: torch is imported lazily here)."""
    global _GUARD
    if _GUARD is None:
        import torch

        class DoubleBackwardNotSupported(torch.autograd.Function):
            """Identity whose backward raises the :class:`NotSupportedError` it was given."""

            @staticmethod
            def forward(ctx, what, *ts):
                ctx.what = what
                return tuple(t.view_as(t) for t in ts)

            @staticmethod
            def backward(ctx, *gg):
                message, op = ctx.what
                raise NotSupportedError(message, op=op)

        _GUARD = DoubleBackwardNotSupported
    return _GUARD
