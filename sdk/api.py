"""`build_megakernel`: from a model id (and optionally its transformers config) to a runnable decoder."""
from __future__ import annotations

from typing import Any

import torch

from . import plugins
from .errors import UnsupportedConfigError


def build_megakernel(model: str, config: Any = "tiny", *, backend: str = "reference", device="cpu",
                     dtype=torch.float32, tp: int = 1, ep: int = 1, rank: int = 0,
                     max_seq_len: int = 4096, max_batch: int = 64, **options):
    """Build a decoder for `model`.

    model     a registered model id (`megakernel models` lists them).
    config    the model's top-level transformers config (object or dict), or the name of one of
              the package's configs ("tiny", "full", ...).
    backend   a registered backend: the SDK registers "reference" (plain PyTorch) and "megakernel"
              (the whole-model program, one launch a decode step: device "cpu" runs it on the
              PyVM, "cuda" on the GPU; docs/megakernel.md); plugins may register others
              (`register_backends`).
    tp, ep, rank   tensor / expert parallel degrees and this GPU's rank. The megakernel backend:
              tp=N for Kimi K3 runs N tensor-parallel ranks, all driven from this process (the
              CPU, or N virtual ranks on one GPU).
    max_seq_len, max_batch   the built limits; work over them raises `CapacityError` up front.

    Returns an object with `load_hf_state_dict`, `new_state`, `decode`, `generate`, `last_logits`.
    """
    entry = plugins.get_model(model)
    spec = entry.spec(config)
    factories = plugins.backends()
    if backend not in factories:
        raise UnsupportedConfigError(f"unknown backend {backend!r}; available: {', '.join(sorted(factories))}")
    return factories[backend](entry, spec, device=device, dtype=dtype, tp=tp, ep=ep, rank=rank,
                              max_seq_len=max_seq_len, max_batch=max_batch, **options)
