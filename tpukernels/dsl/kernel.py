"""The ``@tpu_kernel`` decorator and the kernel object it makes.

A kernel is two Python functions:

* the **body**: a Pallas kernel on refs, ``body(x_ref, y_ref, o_ref, *scratch_refs, **static)``;
* the **launch function**, decorated with ``@tpu_kernel(body, ...)``: called with :class:`TensorSpec`
  stand-ins for the tensor arguments (shape + dtype, no data), the static arguments and the chosen
  config, it returns a :class:`Launch` (grid, BlockSpecs, out shapes, scratch, ...). Its annotated
  signature *is* the torch op schema: ``torch.Tensor`` / ``Optional[torch.Tensor]`` parameters are tensor
  inputs, ``int``/``float``/``bool``/``str`` parameters are static arguments (baked into the compiled
  kernel), and keyword-only parameters named like a tunable receive the config value.

Data flows one way: definition (this module) -> lowering (:mod:`tpukernels.lowering`) -> target
(:mod:`tpukernels.targets`: cpu interpret, tpu via torch_tpu, compile-only chip) -> torch op
(:mod:`tpukernels.torch_op`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ..errors import ArgumentError, ConfigError, KernelBodyError, KernelDefinitionError, TpuKernelError
from . import hooks
from .spec import Config, Launch, OutSpec, TensorSpec, Tunable, TunableSpace, config_example

log = logging.getLogger("tpukernels.dispatch")

DEFAULT_NAMESPACE = "tpukernels_user"

#: Every kernel defined in this process, by ``"namespace::name"`` (what ``tpukernels list`` shows).
REGISTRY: dict[str, "TpuKernel"] = {}

#: Config resolvers consulted (in order) when a call gives no explicit config. Each is
#: ``fn(kernel, specs, statics, chip) -> (Config-like, source) | None`` (``chip``: the compile target, or
#: None for "where this process runs"); the autotuner's database registers one.
CONFIG_RESOLVERS: list[Callable] = []

_STATIC_TYPES = (int, float, bool, str)


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a kernel's op signature."""

    name: str
    kind: str  # "tensor" | "opt_tensor" | "static"
    annotation: Any
    default: Any = inspect.Parameter.empty
    keyword_only: bool = False
    static_type: Any = None  # static params: int / float / bool / str
    optional: bool = False  # static params: Optional[...] (None allowed)


def _classify(name: str, ann: Any) -> str:
    import torch

    if ann is torch.Tensor:
        return "tensor"
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if rest == [torch.Tensor]:
            return "opt_tensor"
        if len(rest) == 1 and rest[0] in _STATIC_TYPES:
            return "static"
    if ann in _STATIC_TYPES:
        return "static"
    raise KernelDefinitionError(
        f"parameter {name!r}: annotation {ann!r} is not supported; use torch.Tensor, Optional[torch.Tensor], "
        f"int, float, bool or str"
    )


def _split_name(name: str, namespace: str) -> tuple[str, str]:
    """``name`` or ``"ns::name"`` (+ ``namespace``) -> (name, namespace), both valid torch identifiers.

    Raises:
        KernelDefinitionError: more than one ``::``, a namespace that contradicts ``namespace=``, or a
            name that is not an identifier.
    """
    if "::" in name:
        parts = name.split("::")
        if len(parts) != 2:
            raise KernelDefinitionError(f"tpu_kernel: name {name!r} must be 'op' or 'namespace::op'")
        ns, name = parts
        if namespace not in (DEFAULT_NAMESPACE, ns):
            raise KernelDefinitionError(
                f"tpu_kernel: name {ns + '::' + name!r} contradicts namespace={namespace!r}; give one of them")
        namespace = ns
    for what, v in (("name", name), ("namespace", namespace)):
        if not v.isidentifier():
            raise KernelDefinitionError(
                f"tpu_kernel: {what} {v!r} is not a valid op identifier (letters, digits, _; e.g. name='my_add' "
                f"or name='my_ns::my_add')")
    return name, namespace


def _parse_shapes(qualname: str, shapes: Mapping[str, str], tensor_names: set) -> dict:
    """``{"x": "M K", "w": "K N"}`` -> ``{"x": ("M", "K"), "w": ("K", "N")}`` (ints stay ints)."""
    out = {}
    for arg, text in shapes.items():
        if arg not in tensor_names:
            raise KernelDefinitionError(f"{qualname}: shapes= names {arg!r}, which is not a tensor parameter")
        if not isinstance(text, str):
            raise KernelDefinitionError(f"{qualname}: shapes[{arg!r}] must be a string of dim names like 'M K', got {text!r}")
        dims = tuple(int(d) if d.isdigit() else d for d in text.split())
        for d in dims:
            if isinstance(d, str) and not d.isidentifier():
                raise KernelDefinitionError(f"{qualname}: shapes[{arg!r}] = {text!r}: dim {d!r} is not a name or an int")
        out[arg] = dims
    return out


def check_int(where: str, name: str, v: Any, *, optional: bool = False) -> Optional[int]:
    """``v`` as a Python ``int`` if it is an integer (``int`` or a numpy integer, not ``bool``), else ArgumentError
    naming ``where`` and the argument: the rule of :func:`check_static` for ``int`` statics, for public wrappers
    that take an integer before a kernel or a torch op schema sees it (``int(64.9)`` would silently run as 64;
    a float reaching a schema ``int`` is torch's untyped RuntimeError). ``optional``: None passes through.

    Raises:
        ArgumentError: a float (``64.0`` included: statics are ints, as for the kernels), bool, str or other value.
    """
    if v is None and optional:
        return None
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    raise ArgumentError(f"{where}: static argument {name!r} must be int, got {v!r} ({type(v).__name__})")


def check_static(qualname: str, p: "Param", v: Any) -> Any:
    """Check a static argument against its annotation; returns the value (ints widened for float params).

    Raises:
        ArgumentError: naming the kernel, the argument, the expected type and the value given (e.g. the
            string ``"false"`` for a ``bool``, which Python would treat as true).
    """
    typ, optional = p.static_type, p.optional
    if v is None:
        if optional or p.default is None:
            return v
        raise ArgumentError(f"{qualname}: static argument {p.name!r} must be {typ.__name__}, got None")
    is_bool = isinstance(v, (bool, np.bool_))
    if typ is bool:
        if is_bool:
            return bool(v)
    elif typ is int:
        if isinstance(v, (int, np.integer)) and not is_bool:
            return int(v)
    elif typ is float:
        if isinstance(v, (int, float, np.integer, np.floating)) and not is_bool:
            return float(v)
    elif typ is str:
        if isinstance(v, str):
            return v
    else:
        return v
    raise ArgumentError(f"{qualname}: static argument {p.name!r} must be {typ.__name__}, got {v!r} ({type(v).__name__})")


def dtype_default(static: str = "out_dtype", tensor: int = 0) -> Callable:
    """A ``canonicalize=`` hook for the common case "``static=None`` means the dtype of tensor argument
    number ``tensor``": an explicit value naming that dtype is keyed as ``None`` (the default).

    Example: ``@tpu_kernel(body, canonicalize=dtype_default("out_dtype"))`` makes ``out_dtype="bfloat16"``
    on bfloat16 inputs find the tuning entries recorded for ``out_dtype=None``.
    """

    def canonicalize(*specs, **statics):
        value, s = statics.get(static), specs[tensor] if tensor < len(specs) else None
        if value is None or s is None:
            return statics
        try:
            name = value if isinstance(value, str) else np.dtype(value).name
            same = np.dtype(s.dtype).name == name
        except TypeError:
            same = str(value).replace("torch.", "") == str(s.dtype).replace("torch.", "")
        return {**statics, static: None} if same else statics

    canonicalize.__qualname__ = f"dtype_default({static!r}, {tensor})"
    return canonicalize


def bucket(n: int) -> int:
    """Row bucket for ``n`` rows: n rounded up to a multiple of ``max(8, 2**(bit_length(n-1) - 2))``.

    Four buckets per power of two, so padding wastes at most 25% (e.g. 1025..1280 -> 1280). A torch SymInt
    ``n`` (``torch.compile(dynamic=True)`` tracing a library wrapper that pads, e.g. attention and matmul) gives
    a symbolic bucket built with ``torch.sym_ite`` (no guard on ``n``, so one graph serves every size).
    """
    if not isinstance(n, (int, np.integer)):
        import torch

        step = n * 0 + 8  # a SymInt: sym_ite needs both branches of one type
        for b in range(6, 48):  # n in (2**b, 2**(b+1)]: bit_length(n - 1) = b + 1, step 2**(b - 2)
            step = torch.sym_ite(n > (1 << b), n * 0 + (1 << (b - 2)), step)
        return torch.sym_max(((n + step - 1) // step) * step, n * 0 + 8)
    if n <= 8:
        return 8
    step = max(8, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step) * step


class BackwardContext:
    """What a backward function receives: the forward's arguments and outputs.

    Attributes:
        args: ``{name: value}`` of every op argument (tensors, None, static values).
        outputs: tuple of the forward outputs (tensors).
        needs_input_grad: ``{name: bool}`` for tensor arguments.
    """

    def __init__(self, args: dict, outputs: tuple, needs_input_grad: dict):
        self.args = args
        self.outputs = outputs
        self.needs_input_grad = needs_input_grad

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["args"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass
class Resolved:
    """A call's resolved configuration and launch (what a lowering is built from)."""

    specs: tuple  # TensorSpec | None per tensor param
    statics: tuple  # (name, value) pairs
    config: Config
    source: str
    launch: Launch


class TpuKernel:
    """A Pallas TPU kernel with its launch description, tunable space and torch op.

    Call it with torch tensors (goes through ``torch.ops.<namespace>.<name>``, so autograd and
    ``torch.compile`` see one op) or with jax arrays (runs the jax function directly).

    Attributes:
        name, namespace: the op is ``torch.ops.<namespace>.<name>``.
        space: the :class:`TunableSpace` (introspectable by the autotuner).
        params: the op signature as :class:`Param` objects.
    """

    #: Pallas front-end: tunables are keyword-only launch parameters (Helion: config keys, not parameters).
    tunables_are_params = True
    #: ``fn(*tensor_specs, **statics) -> {name: value}``: statics in canonical form for tuning keys (a
    #: default and the explicit value it stands for, e.g. ``out_dtype=None`` and ``out_dtype=a.dtype``).
    canonicalize: Callable | None = None

    def __init__(
        self,
        body: Callable,
        launch_fn: Callable,
        *,
        name: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        tunables: Mapping[str, Tunable] | None = None,
        constraints: Sequence[Callable] = (),
        heuristic: Callable | None = None,
        rows: Sequence[str] = (),
        shapes: Mapping[str, str] | None = None,
        out_shape: Callable | None = None,
        reference: Callable | None = None,
        register: bool = True,
        sharding: Sequence | Callable | None = None,
        canonicalize: Callable | None = None,
    ):
        if not callable(body):
            raise KernelDefinitionError(f"tpu_kernel: body must be a callable kernel on refs, got {body!r}")
        self.body = body
        self.launch_fn = launch_fn
        name, namespace = _split_name(name or launch_fn.__name__, namespace)
        self.name = name
        self.namespace = namespace
        self.qualname = f"{namespace}::{self.name}"
        self.space = TunableSpace(tunables or {}, constraints)
        self.heuristic = heuristic
        self.out_shape_fn = out_shape
        self.reference = reference
        self.__doc__ = launch_fn.__doc__
        self.__wrapped__ = launch_fn
        self._backward: Callable | None = None
        self._backward_op: str | None = None  # the public op named by a double-backward error (def_backward)
        self._double_backward = False  # is the backward itself differentiable? (def_backward)
        self._entries: dict = {}  # lowering cache (tpukernels.lowering.lower)
        self._plans: dict = {}  # per-call plans of the torch targets
        self._lock = threading.Lock()
        self.params, self.return_annotation = self._parse_signature(launch_fn)
        self.tensor_params = tuple(p for p in self.params if p.kind != "static")
        self.has_statics = any(p.kind == "static" for p in self.params)
        self.has_keyword_only = any(p.keyword_only for p in self.params)
        self.rows = tuple(rows)
        self.sharding = sharding  # DTensor rule (tpukernels.distributed.sharding); None: derived from rows
        if canonicalize is not None and not callable(canonicalize):
            raise KernelDefinitionError(f"{self.qualname}: canonicalize= must be a callable "
                                        f"fn(*tensor_specs, **statics) -> statics dict, got {canonicalize!r}")
        self.canonicalize = canonicalize
        for r in self.rows:
            if r not in {p.name for p in self.tensor_params}:
                raise KernelDefinitionError(f"{self.qualname}: rows names {r!r}, which is not a tensor parameter")
        self.shapes = _parse_shapes(self.qualname, shapes or {}, {p.name for p in self.tensor_params})
        body_sig = inspect.signature(body)
        self._body_kw = {
            n for n, p in body_sig.parameters.items() if p.kind in (p.KEYWORD_ONLY,) or p.kind == p.VAR_KEYWORD
        }
        self._body_var_kw = any(p.kind == p.VAR_KEYWORD for p in body_sig.parameters.values())
        self.op = None
        if register:
            if self.qualname in REGISTRY:
                raise KernelDefinitionError(
                    f"tpu_kernel: {self.qualname} is already defined in this process; choose another name= or namespace="
                )
            self.op = hooks.implementation("register_op")(self)
            REGISTRY[self.qualname] = self

    # ------------------------------------------------------------------ signature
    def _parse_signature(self, fn: Callable):
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # unresolved forward references
            raise KernelDefinitionError(f"tpu_kernel {fn.__name__}: cannot resolve annotations: {e}") from e
        params = []
        tunable_names = set(self.space.names)
        seen_tunables = set()
        for pname, p in sig.parameters.items():
            if pname in tunable_names:
                if p.kind != p.KEYWORD_ONLY:
                    raise KernelDefinitionError(
                        f"tpu_kernel {fn.__name__}: tunable {pname!r} must be a keyword-only parameter (after *)"
                    )
                seen_tunables.add(pname)
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise KernelDefinitionError(f"tpu_kernel {fn.__name__}: *args/**kwargs are not allowed ({pname})")
            if pname == "config":
                raise KernelDefinitionError(f"tpu_kernel {fn.__name__}: 'config' is reserved for the tuning config")
            if pname not in hints:
                raise KernelDefinitionError(
                    f"tpu_kernel {fn.__name__}: parameter {pname!r} needs a type annotation (torch.Tensor, int, ...)"
                )
            kind = _classify(pname, hints[pname])
            ann = hints[pname]
            args = typing.get_args(ann)
            optional = kind == "static" and type(None) in args
            static_type = (next(a for a in args if a is not type(None)) if optional else ann) if kind == "static" else None
            params.append(Param(pname, kind, ann, p.default, p.kind == p.KEYWORD_ONLY, static_type, optional))
        missing = tunable_names - seen_tunables
        if missing and self.tunables_are_params:
            raise KernelDefinitionError(
                f"tpu_kernel {fn.__name__}: tunables {sorted(missing)} must appear as keyword-only parameters"
            )
        ret = hints.get("return", inspect.Parameter.empty)
        if ret is inspect.Parameter.empty:
            raise KernelDefinitionError(
                f"tpu_kernel {fn.__name__}: annotate the return type (torch.Tensor or tuple[torch.Tensor, ...])"
            )
        return tuple(params), ret

    @property
    def returns_tuple(self) -> bool:
        """The op returns ``tuple[Tensor, ...]`` (from the return annotation)."""
        return typing.get_origin(self.return_annotation) in (tuple, typing.Tuple)

    def bind(self, args: Sequence, kwargs: Mapping) -> list:
        """Map a call's ``args``/``kwargs`` to the op's parameters in order (defaults applied).

        Raises:
            ArgumentError: wrong count, unknown or missing arguments.
        """
        values = []
        args = list(args)
        kwargs = dict(kwargs)
        missing = []
        for p in self.params:
            if args and not p.keyword_only:
                values.append(args.pop(0))
                if p.name in kwargs:
                    raise ArgumentError(f"{self.qualname}: got multiple values for argument {p.name!r}")
            elif p.name in kwargs:
                values.append(kwargs.pop(p.name))
            elif p.default is not inspect.Parameter.empty:
                values.append(p.default)
            else:
                missing.append(p.name)
                values.append(None)
        if missing:
            raise ArgumentError(f"{self.qualname}: missing required argument(s) {', '.join(map(repr, missing))}")
        if args:
            raise ArgumentError(f"{self.qualname}: takes {len(self.params)} arguments but {len(self.params) + len(args)} were given")
        if kwargs:
            raise ArgumentError(f"{self.qualname}: unexpected keyword argument(s) {sorted(kwargs)}")
        return values

    def check_shapes(self, specs: Sequence) -> None:
        """Check the tensor shapes against ``shapes=`` (once per signature, before the launch function).

        Raises:
            ArgumentError: a rank differs from the declaration, a named dim disagrees between arguments, or
                a fixed dim differs; the message names both arguments and the dim.
        """
        if not self.shapes:
            return
        seen: dict = {}
        by_name = {s.name: s for s in specs if s is not None}
        for arg, dims in self.shapes.items():
            s = by_name.get(arg)
            if s is None:
                continue  # an absent optional tensor
            shape = tuple(s.shape)
            decl = " ".join(map(str, dims))
            if len(shape) != len(dims):
                raise ArgumentError(f"{self.qualname}: {arg} has shape {shape}, but shapes= declares {arg}: '{decl}' "
                                    f"(rank {len(dims)})")
            for d, n in zip(dims, shape):
                if isinstance(d, int):
                    if int(n) != d:
                        raise ArgumentError(f"{self.qualname}: {arg} has shape {shape}, but shapes= declares '{decl}' "
                                            f"(a dim of {d})")
                elif d in seen and seen[d][1] != int(n):
                    other, size = seen[d]
                    hint, rows = "", set(self.rows or ())
                    if dims.index(d) == 0 and (other in rows) != (arg in rows):
                        padded, plain = (other, arg) if other in rows else (arg, other)
                        hint = (f" ({padded} is in rows=, so its rows were padded up to a bucket size before this "
                                f"check, while {plain}'s were not: add {plain!r} to rows= so both are padded alike)")
                    raise ArgumentError(f"{self.qualname}: {arg} has shape {shape}, but shapes= declares {arg}: '{decl}' "
                                        f"and {d}={size} from {other}{hint}")
                else:
                    seen.setdefault(d, (arg, int(n)))

    def check_statics(self, values: list) -> list:
        """Type-check (in place) the static values of bound ``values``; see :func:`check_static`."""
        for i, p in enumerate(self.params):
            if p.kind == "static":
                values[i] = check_static(self.qualname, p, values[i])
        return values

    def canonical_statics(self, specs: Sequence, statics: Sequence) -> tuple:
        """``statics`` (``(name, value)`` pairs) in canonical form: the key a tuning table is looked up and
        recorded under, so a call that spells a default out (``out_dtype="bfloat16"`` for bfloat16 operands)
        finds the entry tuned for the default (``out_dtype=None``). Uses the kernel's ``canonicalize=`` hook;
        without one, ``statics`` unchanged. Names and order are kept.

        Raises:
            KernelDefinitionError: the hook raised or returned something other than a mapping.
        """
        statics = tuple(statics)
        if self.canonicalize is None or not statics:
            return statics
        try:
            got = self.canonicalize(*specs, **dict(statics))
        except TpuKernelError:
            raise
        except Exception as e:
            raise KernelDefinitionError(f"{self.qualname}: canonicalize= raised {type(e).__name__}: {e}") from e
        if not isinstance(got, Mapping):
            raise KernelDefinitionError(f"{self.qualname}: canonicalize= must return a dict of statics, got {got!r}")
        return tuple((k, got.get(k, v)) for k, v in statics)

    # ------------------------------------------------------------------ config + launch
    def resolve_config(self, specs: tuple, statics: tuple, config: Mapping | None, chip=None,
                       resolvers: bool = True) -> tuple[Config, str]:
        """Pick the config: explicit -> registered resolvers (tuning DB) -> heuristic -> defaults.

        ``chip`` (a :class:`tpukernels.chips.Chip`) selects whose tuning data applies (compile-only
        targets); None means the chip this process runs on (see ``tpukernels.autotune.db.dispatch_chip``).

        Returns:
            ``(config, source)`` with source one of ``"explicit"``, the resolver's label, ``"heuristic"``,
            ``"default"``.

        Raises:
            ConfigError: an explicit config names unknown tunables or violates a constraint.
        """
        if config:
            if not isinstance(config, Mapping):
                raise ConfigError(f"{self.qualname}: config must be a dict such as {config_example(self, False)}, got "
                                  f"{config!r}")
            try:
                return self.space.complete(config), "explicit"
            except ConfigError as e:
                raise ConfigError(f"{self.qualname}: {e}") from None
        if not self.space.names:
            return Config(), "default"
        for resolver in CONFIG_RESOLVERS if resolvers else ():
            got = resolver(self, specs, statics, chip)
            if got is not None:
                cfg, source = got
                try:
                    return self.space.complete(cfg), source
                except ConfigError as e:  # stale or hand-edited DB entry: never fatal
                    import warnings

                    warnings.warn(f"tpukernels: {self.qualname}: ignoring the {source} config {cfg}: {e}",
                                  RuntimeWarning, stacklevel=3)
        if self.heuristic is not None:
            return self.space.complete(self.heuristic(*specs, **dict(statics))), "heuristic"
        return self.space.default(), "default"

    def make_launch(self, specs: tuple, statics: tuple, config: Config) -> Launch:
        """Call the launch function; errors it raises become :class:`KernelBodyError` (typed ones pass)."""
        try:
            launch = self.launch_fn(*specs, **dict(statics), **dict(config))
        except TpuKernelError:
            raise
        except Exception as e:
            raise KernelBodyError(
                f"{self.qualname}: launch function raised {type(e).__name__}: {e} "
                f"(inputs {[None if s is None else (tuple(s.shape), np.dtype(s.dtype).name) for s in specs]}, config {config})"
            ) from e
        if not isinstance(launch, Launch):
            raise KernelBodyError(f"{self.qualname}: launch function must return tpukernels.Launch, got {type(launch).__name__}")
        return launch

    def out_specs_for(self, specs: tuple, statics: tuple, config: Mapping | None = None) -> tuple:
        """Output shapes/dtypes (used by the fake kernel; works with symbolic sizes)."""
        cfg = self.space.complete(config) if config else self.space.default()
        if self.out_shape_fn is not None:
            out = self.out_shape_fn(*specs, **dict(statics))
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return self.make_launch(specs, statics, cfg).out_shapes

    def body_for(self, statics: tuple, config: Config, launch: Launch) -> Callable:
        """The body with its static keyword arguments bound, raising :class:`KernelBodyError` on errors."""
        available = {**dict(statics), **dict(config), **dict(launch.body_kwargs)}
        kw = available if self._body_var_kw else {k: v for k, v in available.items() if k in self._body_kw}
        body, qualname = self.body, self.qualname

        @functools.wraps(body)
        def wrapped(*refs):
            try:
                return body(*refs, **kw)
            except TpuKernelError:
                raise
            except Exception as e:
                raise KernelBodyError(
                    f"{qualname}: kernel body {getattr(body, '__name__', body)!r} raised {type(e).__name__}: {e}"
                ) from e

        return wrapped

    # ------------------------------------------------------------------ entry points
    def def_backward(self, fn: Callable | None = None, *, op: str | None = None, double_backward: bool = False):
        """Attach a backward: ``fn(ctx: BackwardContext, *grad_outputs) -> {arg_name: grad}``.

        The backward may call other tpukernels ops (or itself); the op becomes differentiable through
        ``torch.library.register_autograd``. Returns ``fn`` so it can be used as a decorator, bare
        (``@k.def_backward``) or with options (``@k.def_backward(op="rms_norm")``).

        Args:
            op: the public op this kernel implements (``"rms_norm"``), named by the error below; default the
                kernel's qualified name.
            double_backward: True when ``fn`` is itself differentiable and its derivative is right: it is
                built only from differentiable ops (tpukernels ops with a backward, torch ops) and uses every
                incoming gradient and output it reads (e.g. a bilinear op's backward made of the same
                kernels). False (default): the backward is differentiable once; it runs without recording a
                graph, and differentiating its result (``torch.autograd.grad(..., create_graph=True)`` then
                a backward through the gradient) raises :class:`~tpukernels.errors.NotSupportedError` naming
                ``op``, where it would otherwise reach an inner kernel without a backward, or silently drop a
                term (an output such as a saved statistic whose gradient the backward ignores).
        """
        if fn is None:
            return lambda f: self.def_backward(f, op=op, double_backward=double_backward)
        self._backward = fn
        self._backward_op = op
        self._double_backward = bool(double_backward)
        if self.op is not None:
            hooks.implementation("register_backward")(self)
        return fn

    def __call__(self, *args, config: Mapping | None = None, interpret: str | None = None, **kwargs):
        """Run the kernel on torch tensors (via the torch op) or on jax arrays (directly).

        Args:
            config: tunable values for this call (partial is fine; the rest come from defaults).
            interpret: ``"fast"`` or ``"tpu"`` for cpu runs of this call (see :mod:`tpukernels.dsl.modes`).
        """
        run_call = _RUN_CALL or _load_run_call()
        return run_call(self, args, kwargs, config=config, interpret=interpret)

    def __repr__(self) -> str:
        return f"<tpu_kernel {self.qualname} tunables={list(self.space.names)}>"


_RUN_CALL = None


def _load_run_call():
    global _RUN_CALL
    run_call = hooks.implementation("run_call")

    _RUN_CALL = run_call
    return run_call


def tpu_kernel(
    body: Callable | None = None,
    *,
    backend: str = "pallas",
    name: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    tunables: Mapping[str, Tunable] | None = None,
    constraints: Sequence[Callable] = (),
    heuristic: Callable | None = None,
    rows: Sequence[str] = (),
    shapes: Mapping[str, str] | None = None,
    out_shape: Callable | None = None,
    reference: Callable | None = None,
    config: Mapping | None = None,
    sharding: Sequence | Callable | None = None,
    canonicalize: Callable | None = None,
) -> Callable[[Callable], TpuKernel]:
    """Decorate a launch function (Pallas) or a tile program (Helion) to make a :class:`TpuKernel`.

    Args:
        body: Pallas front-end: the kernel on refs, ``body(*in_refs, *out_refs, *scratch_refs, **static)``;
            keyword-only parameters of the body receive static arguments and config values of the same
            name. Must be None for ``backend="helion"`` (the decorated function is the program).
        backend: ``"pallas"`` (a body plus a launch function returning :class:`Launch`) or ``"helion"``
            (a Helion tile program; see :mod:`tpukernels.frontends.helion`).
        name: op name (default: the decorated function's name); the op is ``torch.ops.<namespace>.<name>``.
        namespace: torch library namespace (default ``"tpukernels_user"``; the shipped library uses
            ``"tpukernels"``).
        tunables: ``{name: Tunable(values, default)}``. Pallas: each is also a keyword-only launch
            parameter. Helion: names are Helion config keys (``block_sizes``, ...).
        constraints: callables ``fn(config) -> bool | str`` restricting the tunable space.
        heuristic: ``fn(*tensor_specs, **statics) -> dict`` shape-dependent default config.
        rows: names of tensor parameters whose dim 0 is an independent row axis shared with every
            output's dim 0. The row count is then padded (zeros) to :func:`bucket` sizes, so one compiled
            kernel serves every row count of its bucket (``torch.compile(dynamic=True)`` and changing
            batch sizes do not recompile); outputs are sliced back, except those declared
            ``OutSpec(..., rows=False)`` (reductions over rows, which the zero rows must not change).
        shapes: ``{arg: "dim names"}`` declaring how the tensor shapes agree, e.g. ``{"a": "M K", "b": "K N",
            "bias": "N"}`` (names are shared between arguments, ints are fixed sizes). Checked once per input
            signature, before the launch function runs: a mismatch is an :class:`ArgumentError` naming both
            arguments, never an out-of-bounds read.
        out_shape: optional ``fn(*tensor_specs, **statics) -> OutSpec | tuple`` for the fake kernel, when
            the launch function does shape-dependent Python control flow.
        reference: optional plain implementation for the autotuner's correctness check (``--evaluator
            measure``): called with the kernel's arguments as torch tensors, returns torch tensors; wrap a
            function of jax arrays with :func:`tpukernels.dsl.jax_reference`.
        config: Helion only: a pinned Helion config (``{"block_sizes": [64]}``).
        sharding: Pallas: how DTensor inputs run on their shards, a list of
            :class:`tpukernels.distributed.Split` or ``fn(**args) -> [Split]``
            (see :mod:`tpukernels.distributed.sharding`); default: derived from ``rows=``, else replicate.
        canonicalize: optional ``fn(*tensor_specs, **statics) -> {name: value}`` giving the statics' canonical
            form for tuning-table keys: a default and the explicit value it stands for must be one key (e.g.
            map ``out_dtype`` equal to the input dtype to ``None``). Must not change what the kernel computes.

    Raises:
        KernelDefinitionError: unannotated parameters, tunables that are not keyword-only, a name
            already defined in this process, a missing body (Pallas) or an unknown backend.
    """
    if backend == "helion":
        if body is not None:
            raise KernelDefinitionError("tpu_kernel(backend='helion'): decorate the Helion program itself; pass no body")
        helion_kernel = hooks.implementation("frontend:helion")

        return helion_kernel(
            name=name, namespace=namespace, tunables=tunables, config=config, constraints=constraints,
            heuristic=heuristic, rows=rows, shapes=shapes, out_shape=out_shape, reference=reference,
        )
    if backend != "pallas":
        raise KernelDefinitionError(f"tpu_kernel: backend must be 'pallas' or 'helion', got {backend!r}")
    if body is None:
        raise KernelDefinitionError("tpu_kernel: the Pallas front-end needs the kernel body: @tpu_kernel(body, ...)")
    if config is not None:
        raise KernelDefinitionError("tpu_kernel: config= pins Helion configs; Pallas kernels pin defaults with Tunable(default=)")

    def deco(launch_fn: Callable) -> TpuKernel:
        return TpuKernel(
            body,
            launch_fn,
            name=name,
            namespace=namespace,
            tunables=tunables,
            constraints=constraints,
            heuristic=heuristic,
            rows=rows,
            shapes=shapes,
            out_shape=out_shape,
            reference=reference,
            sharding=sharding,
            canonicalize=canonicalize,
        )

    return deco
