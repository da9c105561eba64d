"""Loading a transformers state dict into the reference's canonical weight names.

Canonical names (what every backend reads):
  embed.weight [V, D]; norm.weight [D]; lm_head.weight [V, D] (absent when tied)
  layers.{i}.attn_norm.weight, layers.{i}.mlp_norm.weight           (per-layer norms)
  layers.{i}.attn.<local>   the attention module's own names (its `expected_weights`)
  layers.{i}.mlp.<local>    the MLP / MoE module's own names
  layers.{i}.hc_attn.<local>, layers.{i}.hc_mlp.<local>, hc_head.<local>   (mHC residual only)

A model package supplies `to_hf(canonical) -> hf key` (its weight map) and `ignore(hf key)` (keys
that exist in the checkpoint but the decode does not use, e.g. vision towers, MTP layers).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..errors import WeightsMismatchError
from ..spec import ModelSpec


def expected_weights(spec: ModelSpec) -> dict[str, tuple]:
    """Every canonical weight the reference decode of `spec` reads, with its shape."""
    from .model import attention_class, mlp_class, residual_class
    d, v = spec.hidden_size, spec.vocab_size
    out: dict[str, tuple] = {"embed.weight": (v, d), "norm.weight": (d,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for layer in spec.layers:
        i = layer.index
        out[f"layers.{i}.attn_norm.weight"] = (d,)
        out[f"layers.{i}.mlp_norm.weight"] = (d,)
        for name, shape in attention_class(layer).expected_weights(spec, layer).items():
            out[f"layers.{i}.attn.{name}"] = tuple(shape)
        for name, shape in mlp_class(layer).expected_weights(spec, layer).items():
            out[f"layers.{i}.mlp.{name}"] = tuple(shape)
    out.update({k: tuple(s) for k, s in residual_class(spec).expected_weights(spec).items()})
    return out


def load_state_dict(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor], to_hf: Callable[[str], str],
                    ignore: Callable[[str], bool] = lambda key: False, *, dtype=torch.float32,
                    device="cpu", keep_dtype: Callable[[str], bool] = lambda name: False) -> dict:
    """Check `state_dict` against the spec and return {canonical name: tensor on device}.

    Floating tensors are cast to `dtype` unless `keep_dtype(canonical)` (e.g. fp32 router or gate
    parameters); integer tensors (hash tables) keep theirs. Any missing, unexpected or mis-shaped
    key raises one `WeightsMismatchError` that lists them all."""
    expected = expected_weights(spec)
    hf_names = {name: to_hf(name) for name in expected}
    used = set(hf_names.values())
    missing, misshaped = [], []
    for name, key in hf_names.items():
        if key not in state_dict:
            missing.append(key)
        elif tuple(state_dict[key].shape) != expected[name]:
            misshaped.append((key, expected[name], tuple(state_dict[key].shape)))
    unexpected = [k for k in state_dict if k not in used and not ignore(k)]
    if missing or unexpected or misshaped:
        raise WeightsMismatchError(missing, unexpected, misshaped, model=spec.name)
    out = {}
    for name, key in hf_names.items():
        t = state_dict[key]
        if t.is_floating_point() and not keep_dtype(name):
            t = t.to(dtype)
        out[name] = t.to(device)
    return out


class Prefixed(Mapping):
    """A read-only view of the weights dict under one prefix: view['q_proj.weight']."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str):
        self._w, self._p = weights, prefix

    def __getitem__(self, key):
        return self._w[self._p + key]

    def __iter__(self):
        return (k[len(self._p):] for k in self._w if k.startswith(self._p))

    def __len__(self):
        return sum(1 for _ in self)

    def get(self, key, default=None):
        return self._w.get(self._p + key, default)
