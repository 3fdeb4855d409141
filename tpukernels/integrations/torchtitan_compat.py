"""Compatibility shims that let torchtitan 0.3.0 run on a CPU-only host (and this project's test machines).

Covers **torchtitan 0.3.0** with **torch 2.13** (CPU build), installed with ``--no-deps`` next to spmd_types
0.2.3, tyro, docstring-parser, typeguard and torchdata (``make torchtitan``). Nothing here is needed for the
kernels themselves (:mod:`tpukernels.integrations.torchtitan`); these shims only work around what torchtitan
0.3.0 assumes about its host. :func:`install` applies them, each only when its cause is present:

========================================  ===========================================================
torchtitan 0.3.0 assumes                  shim
========================================  ===========================================================
``triton`` importable (``minimal_async_ep.kernels`` is imported by ``models.common``)
                                          a placeholder for that one module; its kernels raise if called
``torch.utils.tensorboard`` importable    a placeholder whose ``SummaryWriter`` raises (tensorboard off)
HF ``datasets`` importable                a placeholder ``datasets`` whose loaders raise (use
                                          :class:`SyntheticDataLoader`)
an accelerator (``device_type`` falls back to ``"cuda"``)
                                          ``device_type = "cpu"``, ``device_module = torch.cpu`` and a
                                          CPU memory monitor (host RSS), so gloo is the backend
FSDP2 reduce-scatter with ``PREMUL_SUM``  (on that CPU host) FSDP modules force SUM reductions: gloo has no
(its gradient divide factor 1.0)          ``PREMUL_SUM``; the factor is 1, so the gradients are the same
``torch.distributed.set_timeout``         ``set_pg_timeouts`` becomes a barrier (the timeout stays at
(absent in torch 2.13)                    the init value)
tokenizer / dataset assets on disk        :class:`SyntheticTokenizer`, :class:`SyntheticDataLoader`
(not in the wheel)                        (seeded random documents; positions reset per document)
========================================  ===========================================================

Entry point: ``python -m tpukernels.integrations.torchtitan_compat <torchtitan train args>`` installs the shims,
fills a single-process launch environment (``RANK=0``, ``WORLD_SIZE=1``, a free ``MASTER_PORT``) when none is
set, and runs ``torchtitan.train.main()``. Under ``torchrun`` the launcher's environment is kept.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from dataclasses import dataclass

import torch

__all__ = ["install", "main", "SyntheticTokenizer", "SyntheticDataLoader", "TORCHTITAN_VERSION", "TORCH_VERSIONS"]

#: The torchtitan release these shims are written for.
TORCHTITAN_VERSION = "0.3.0"
#: torch releases they were tested with.
TORCH_VERSIONS = ("2.13",)
_installed: list[str] = []


def _placeholder_module(name: str, why: str, attrs: dict | None = None) -> types.ModuleType:
    """A module object with a real ``__spec__`` (so ``importlib.util.find_spec`` keeps working) whose unknown
    attributes are callables raising ``ImportError(why)``."""
    mod = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, loader=None))
    for k, v in (attrs or {}).items():
        setattr(mod, k, v)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*a, **k):
            raise ImportError(f"{name}.{attr}: {why}")

        unavailable.__name__ = attr
        return unavailable

    mod.__getattr__ = __getattr__
    return mod


def _missing(pkg: str) -> bool:
    try:
        return importlib.util.find_spec(pkg) is None
    except (ImportError, ValueError):
        return True


def install() -> list[str]:
    """Apply the shims whose cause is present (idempotent). Returns the names of the shims applied.

    Must run before ``torchtitan.trainer`` (or ``torchtitan.models``) is imported: several of the causes are
    module-level imports.
    """
    if _installed:
        return list(_installed)
    if _missing("triton"):
        name = "torchtitan.distributed.minimal_async_ep.kernels"
        sys.modules.setdefault(name, _placeholder_module(name, "needs triton (CUDA MoE all-to-all kernels)"))
        _installed.append("triton")
    if _missing("tensorboard"):
        class SummaryWriter:  # noqa: D401 - placeholder
            def __init__(self, *a, **k):
                raise ImportError("tensorboard is not installed: run with --metrics.enable_tensorboard=False")

        sys.modules.setdefault("torch.utils.tensorboard", _placeholder_module(
            "torch.utils.tensorboard", "tensorboard is not installed", {"SummaryWriter": SummaryWriter}))
        _installed.append("tensorboard")
    if _missing("datasets"):
        why = "HF datasets is not installed: use tpukernels.integrations.torchtitan_compat.SyntheticDataLoader"

        class Dataset:  # annotation target only
            pass

        sys.modules.setdefault("datasets", _placeholder_module("datasets", why, {"Dataset": Dataset}))
        sys.modules.setdefault("datasets.distributed", _placeholder_module("datasets.distributed", why))
        _installed.append("datasets")
    from torch._utils import _get_available_device_type

    if _get_available_device_type() is None:  # no accelerator: torchtitan would fall back to "cuda"
        import torchtitan.tools.utils as tt_utils

        tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
        import torchtitan.components.metrics as tt_metrics

        tt_metrics.device_type, tt_metrics.device_module = "cpu", torch.cpu
        tt_metrics.build_device_memory_monitor = _CpuMemoryMonitor
        import torchtitan.distributed.utils as tt_dist_utils

        tt_dist_utils.device_type, tt_dist_utils.device_module = "cpu", torch.cpu
        _installed.append("cpu-device")
        import torchtitan.distributed.fsdp as tt_fsdp

        if not getattr(tt_fsdp.disable_fsdp_gradient_division, "_tpukernels_gloo", False):
            stock = tt_fsdp.disable_fsdp_gradient_division

            def disable_fsdp_gradient_division(model):
                # divide factor 1.0 makes FSDP2 reduce-scatter with PREMUL_SUM(1.0), which gloo lacks; a plain SUM
                # (then a division by 1.0, skipped) gives the same gradients
                stock(model)
                for module in model.modules():
                    if isinstance(module, tt_fsdp.FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)

            disable_fsdp_gradient_division._tpukernels_gloo = True
            tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
            _installed.append("gloo-fsdp-sum")
    if not hasattr(torch.distributed, "set_timeout"):
        import torchtitan.distributed.utils as tt_dist_utils

        def set_pg_timeouts(timeout, parallel_dims):
            # torch.distributed.set_timeout does not exist in this torch: keep the init timeout
            torch.distributed.barrier()

        tt_dist_utils.set_pg_timeouts = set_pg_timeouts
        _installed.append("set_timeout")
    return list(_installed)


class _CpuMemoryMonitor:
    """``DeviceMemoryMonitor`` for a CPU host: peak resident set size of this process (``getrusage``)."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2**30

    def get_peak_stats(self):
        import resource

        from torchtitan.components.metrics import DeviceMemStats

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        gib, pct = peak / 2**30, 100 * peak / self.device_capacity
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self):
        pass


# ------------------------------------------------------------------------------------------ synthetic assets
def _tokenizer_base():
    from torchtitan.components.tokenizer import BaseTokenizer

    return BaseTokenizer


def _dataloader_base():
    from torchtitan.components.dataloader import BaseDataLoader

    return BaseDataLoader


def _define_assets():
    BaseTokenizer, BaseDataLoader = _tokenizer_base(), _dataloader_base()

    class SyntheticTokenizer(BaseTokenizer):
        """Token ids are the text's bytes modulo ``vocab_size`` (no files; for smoke tests and CPU runs)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Config, *, tokenizer_path: str = ""):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, text: str, *a, **k) -> list[int]:
            return [b % self.vocab_size for b in text.encode()]

        def decode(self, ids, *a, **k) -> str:
            return " ".join(str(int(i)) for i in ids)

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticDataLoader(BaseDataLoader):
        """Seeded random token documents packed into ``[local_batch_size, seq_len]`` rows.

        Yields ``({"input": ids, "positions": pos}, labels)`` like torchtitan's text loaders: ``positions``
        restart at 0 at each document start (so document-masking attention configs get their boundaries),
        ``labels`` are the next tokens. Each data-parallel rank draws its own stream (``seed + dp_rank``).
        """

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            seed: int = 0
            vocab_size: int = 2048
            mean_doc_len: int = 0
            """0: one document per row; else documents of random lengths around this mean."""

        def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0, tokenizer=None,
                     seq_len: int = 2048, local_batch_size: int = 8, **_):
            self.config, self.seq_len, self.batch = config, seq_len, local_batch_size
            self.vocab = tokenizer.get_vocab_size() if tokenizer is not None else config.vocab_size
            self.gen = torch.Generator().manual_seed(config.seed + dp_rank)
            self.step = 0

        def __iter__(self):
            while True:
                tok = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=self.gen)
                pos = torch.arange(self.seq_len).repeat(self.batch, 1)
                if self.config.mean_doc_len:
                    for b in range(self.batch):
                        start, p = 0, pos[b]
                        while True:
                            n = int(torch.randint(1, 2 * self.config.mean_doc_len, (1,), generator=self.gen))
                            start += n
                            if start >= self.seq_len:
                                break
                            p[start:] -= p[start].clone()
                self.step += 1
                yield {"input": tok[:, :-1], "positions": pos}, tok[:, 1:]

        def state_dict(self):
            return {"step": self.step, "rng": self.gen.get_state()}

        def load_state_dict(self, state_dict):
            self.step = state_dict["step"]
            self.gen.set_state(state_dict["rng"])

    from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
    from torchtitan.protocols.module import Module

    class EagerDocumentAttention(Module):
        """CPU reference for torchtitan's flex / varlen inner attention (both need CUDA or an inductor build
        here): float32 softmax attention with the same causal x document x window mask, GQA by repeating
        K/V heads. A ``VarlenAttention.Config``, so the trainer hands it the document boundaries."""

        @dataclass(kw_only=True, slots=True)
        class Config(VarlenAttention.Config):
            pass

        def __init__(self, config: Config):
            super().__init__()
            self.window_size = tuple(config.window_size)

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, **kwargs):
            b, seq, hq, d = q_BLNH.shape
            group = hq // k_BLNH.shape[2]
            q = q_BLNH.transpose(1, 2).float()
            k = k_BLNH.transpose(1, 2).float().repeat_interleave(group, 1)
            v = v_BLNH.transpose(1, 2).float().repeat_interleave(group, 1)
            i = torch.arange(seq)[:, None]
            j = torch.arange(seq)[None, :]
            left, right = self.window_size
            vis = torch.ones(seq, seq, dtype=torch.bool)
            if right >= 0:
                vis &= j <= i + right
            if left >= 0:
                vis &= j >= i - left
            vis = vis[None, None]
            if isinstance(attention_masks, VarlenMetadata):
                cu = attention_masks.cu_seq_q.long()
                seg = (torch.searchsorted(cu, torch.arange(b * seq), right=True) - 1).reshape(b, seq)
                vis = vis & (seg[:, None, :, None] == seg[:, None, None, :])
            s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else d**-0.5)
            p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
            return (p @ v).transpose(1, 2).to(q_BLNH.dtype)

    return SyntheticTokenizer, SyntheticDataLoader, EagerDocumentAttention


_LAZY = ("SyntheticTokenizer", "SyntheticDataLoader", "EagerDocumentAttention")


def __getattr__(name):  # these subclass torchtitan's classes: defined on first use, after install()
    if name in _LAZY:
        install()
        globals().update(zip(_LAZY, _define_assets()))
        return globals()[name]
    raise AttributeError(name)


# ------------------------------------------------------------------------------------------ CPU configs
def llama3_debugmodel_cpu():
    """torchtitan's ``llama3_debugmodel`` runnable on a CPU host without assets: synthetic tokenizer and
    documents (mean length 24), :class:`EagerDocumentAttention` for the CUDA/inductor-only inner attention,
    no CUDA graphs. The reference for :func:`tpukernels.integrations.torchtitan.llama3_debugmodel_cpu_tpukernels`."""
    import sys as _sys

    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    this = _sys.modules[__name__] if __name__ != "__main__" else _sys.modules["__main__"]
    tok, dl, eager = (getattr(this, n) for n in _LAZY)
    config = llama3_debugmodel()
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    inner = (FlexAttention.Config, VarlenAttention.Config)
    for fqn, node, parent, attr in list(config.model_spec.model.traverse(inner)):
        new = eager.Config(window_size=tuple(getattr(node, "window_size", (-1, 0))))
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    vocab = config.model_spec.model.vocab_size
    config.tokenizer = tok.Config(vocab_size=vocab)
    config.dataloader = dl.Config(vocab_size=vocab, mean_doc_len=24)
    config.training.disable_cuda_graphs = True
    config.debug.seed = 0  # model init and data are the same in every run (the parity tests compare runs)
    return config


def llama3_debugmodel_cpu_sdpa():
    """:func:`llama3_debugmodel_cpu` with torchtitan's ``ScaledDotProductAttention`` (plain causal attention, no
    document masks; one document per row): the inner attention torchtitan's context parallelism supports with
    plain (non-block-mask) attention, so the reference for context-parallel runs
    (``--parallelism.context_parallel_degree``)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenAttention

    config = llama3_debugmodel_cpu()
    for _, _, parent, attr in list(config.model_spec.model.traverse(VarlenAttention.Config)):
        new = ScaledDotProductAttention.Config()
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    config.dataloader.mean_doc_len = 0
    return config


# ------------------------------------------------------------------------------------------ entry point
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_env() -> None:
    """Fill a single-process launch environment unless a launcher (torchrun) set one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def main(argv: list[str] | None = None) -> None:
    """``python -m tpukernels.integrations.torchtitan_compat <torchtitan.train args>``."""
    main_env()
    install()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import torchtitan.train

    torchtitan.train.main()


if __name__ == "__main__":
    main()
