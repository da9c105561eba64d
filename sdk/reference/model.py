"""The reference decode of a whole model, driven by its ModelSpec.

One decoder for every model: embed -> per layer [residual(attn), residual(mlp)] -> final norm ->
lm_head. The attention kind, the MLP kind and the residual kind (plain or mHC) select modules from
`ATTENTION`, `MLP` and `RESIDUAL`; each module follows one contract:

    cls.expected_weights(model_spec, layer_spec) -> {local name: shape}
    cls(model_spec, layer_spec, weights)        weights: a `Prefixed` view, local names
    module.new_cache(batch, max_seq_len, device, dtype) -> {name: tensor, batch first}   (attention)
    module.forward(x [B, T, D], cache, step: StepInfo) -> [B, T, D]

Caches are updated in place (index assignment or copy_, never by rebinding a dict entry), so a
slice `cache[b:b+1]` of a batch's caches is a valid cache of one sequence: ragged prompts are
prefilled one sequence at a time into the batch's caches, then decoded together.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import CapacityError, SdkError, UnsupportedConfigError
from ..spec import LayerSpec, ModelSpec
from .common import StepInfo, rms_norm
from .weights import Prefixed

ATTENTION = {
    "kda": "sdk.reference.kda:KDAReference",
    "mla": "sdk.reference.mla:MLAReference",
    "dsa_mla": "sdk.reference.dsa:DSAMLAReference",
    "dsv4": "sdk.reference.dsv4_attention:DSV4AttentionReference",
    "gqa": "sdk.reference.gqa:GQAReference",
}
MLP = {
    "dense": "sdk.reference.moe:DenseMLPReference",
    "moe": "sdk.reference.moe:MoEReference",
}
RESIDUAL = {
    "plain": "sdk.reference.model:PlainResidual",
    "mhc": "sdk.reference.mhc:MHCResidual",
}


def _resolve(table: dict, kind: str, what: str):
    if kind not in table:
        raise UnsupportedConfigError(f"unsupported {what} kind {kind!r}; supported: {sorted(table)}")
    module, name = table[kind].split(":")
    return getattr(importlib.import_module(module), name)


def attention_class(layer: LayerSpec):
    return _resolve(ATTENTION, layer.attention.kind, "attention")


def mlp_class(layer: LayerSpec):
    return _resolve(MLP, layer.mlp.kind, "mlp")


def residual_class(spec: ModelSpec):
    return _resolve(RESIDUAL, spec.residual.kind, "residual")


class PlainResidual:
    """x + f(x): the stream is the hidden state itself."""

    def __init__(self, model: ModelSpec, weights):
        pass

    @staticmethod
    def expected_weights(model: ModelSpec) -> dict:
        return {}

    def embed(self, x):
        return x

    def around(self, layer: int, site: str, stream, fn):
        return stream + fn(stream)

    def head(self, stream):
        return stream


@dataclass
class DecodeState:
    """Caches of one batch of sequences: per-layer cache dicts and each sequence's length."""
    caches: list[dict]
    lengths: torch.Tensor            # LongTensor [B], on the model's device
    max_seq_len: int

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def select(self, rows: slice) -> "DecodeState":
        """A view of some sequences (their caches alias this state's)."""
        return DecodeState([{k: v[rows] for k, v in c.items()} for c in self.caches],
                           self.lengths[rows], self.max_seq_len)


class ReferenceModel:
    """The `"reference"` backend: plain PyTorch, CPU or GPU, any dtype."""

    backend = "reference"

    def __init__(self, entry, spec: ModelSpec, *, device="cpu", dtype=torch.float32,
                 max_seq_len: int = 4096, max_batch: int = 64):
        self.entry, self.spec = entry, spec
        self.device, self.dtype = torch.device(device), dtype
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.weights: dict | None = None
        self.last_logits: torch.Tensor | None = None
        self._capturable = False

    # ------------------------------------------------------------------ weights
    def load_hf_state_dict(self, state_dict) -> "ReferenceModel":
        """Load the matching transformers model's state dict (checked key by key)."""
        self.weights = self.entry.load_weights(self.spec, state_dict, dtype=self.dtype, device=self.device)
        self._build()
        return self

    def load_weights(self, weights: dict) -> "ReferenceModel":
        """Load canonical weights directly (e.g. random ones from `random_weights`)."""
        self.weights = {k: v.to(self.device) for k, v in weights.items()}
        self._build()
        return self

    def _build(self):
        w, spec = self.weights, self.spec
        self.attn = [attention_class(l)(spec, l, Prefixed(w, f"layers.{l.index}.attn.")) for l in spec.layers]
        self.mlp = [mlp_class(l)(spec, l, Prefixed(w, f"layers.{l.index}.mlp.")) for l in spec.layers]
        self.residual = residual_class(spec)(spec, w)

    # ------------------------------------------------------------------ decode
    @property
    def capturable(self) -> bool:
        """The decode step without host syncs, every shape static, so that a CUDA graph can
        capture it (the benchmarks' PyTorch step): attention reads the whole built cache with
        the positions past each sequence masked, the compressors compute every sequence's entry
        and keep it where a window closes, the experts run as grouped GEMMs. The same logits in
        fp32; in bf16 the grouped GEMMs round differently (~1e-2 of the logits), enough to flip
        a router's near-tie now and then. The caller checks the capacity: `decode` cannot read
        the lengths."""
        return self._capturable

    @capturable.setter
    def capturable(self, on: bool) -> None:
        self._need_weights()
        self._capturable = bool(on)
        for m in [*self.attn, *self.mlp]:
            if hasattr(type(m), "capturable"):                      # MoE
                m.capturable = self._capturable
            for comp in (getattr(m, "compressor", None), getattr(m, "indexer", None)):
                if hasattr(type(comp), "capturable"):               # DeepSeek-V4's compressors
                    comp.capturable = self._capturable

    def new_state(self, batch: int) -> DecodeState:
        if batch > self.max_batch:
            raise CapacityError(f"batch {batch} is over the built max_batch {self.max_batch}")
        self._need_weights()
        caches = [a.new_cache(batch, self.max_seq_len, self.device, self.dtype) for a in self.attn]
        return DecodeState(caches, torch.zeros(batch, dtype=torch.long, device=self.device), self.max_seq_len)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Append T tokens per sequence ([B, T]) and return their logits [B, T, V].

        T > 1 is the verify step of speculative decoding (or a prefill); it equals T single steps."""
        self._need_weights()
        input_ids = input_ids.to(self.device)
        b, t = input_ids.shape
        if b != state.batch:
            raise CapacityError(f"input batch {b} does not match the state's batch {state.batch}")
        if not self._capturable:
            over = int(state.lengths.max()) + t if b else t
            if over > state.max_seq_len:
                raise CapacityError(f"sequence length {over} is over the built max_seq_len {state.max_seq_len}")
        positions = state.lengths[:, None] + torch.arange(t, device=self.device)
        step = StepInfo(start=state.lengths.clone(), positions=positions, input_ids=input_ids,
                        extent=state.max_seq_len if self._capturable else None)
        spec, w = self.spec, self.weights
        x = F.embedding(input_ids, w["embed.weight"])
        h = self.residual.embed(x)
        for l in spec.layers:
            i = l.index
            attn, mlp, cache = self.attn[i], self.mlp[i], state.caches[i]
            h = self.residual.around(i, "attn", h, lambda y: attn.forward(
                rms_norm(y, w[f"layers.{i}.attn_norm.weight"], spec.norm_eps), cache, step))
            h = self.residual.around(i, "mlp", h, lambda y: mlp.forward(
                rms_norm(y, w[f"layers.{i}.mlp_norm.weight"], spec.norm_eps), step))
        h = rms_norm(self.residual.head(h), w["norm.weight"], spec.norm_eps)
        head = w["embed.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
        state.lengths += t
        return F.linear(h, head)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, prompt_lens=None,
                 eos_token_id: int | None = None, pad_token_id: int = 0) -> torch.Tensor:
        """Greedy decoding: LongTensor [B, S] -> [B, S + N], always N new tokens unless
        `eos_token_id` is given (then a finished sequence is padded with `pad_token_id`).

        Ragged prompts: `prompt_lens[b]` tokens of row b are its prompt; its new tokens follow
        them directly and the row is right-padded. `self.last_logits` holds the logits [B, N, V]
        each new token was chosen from."""
        input_ids = torch.as_tensor(input_ids).to(self.device, torch.long)
        b, s = input_ids.shape
        lens = [s] * b if prompt_lens is None else [int(n) for n in prompt_lens]
        if max(lens) + max_new_tokens > self.max_seq_len:
            raise CapacityError(f"prompt ({max(lens)}) + new tokens ({max_new_tokens}) = "
                                f"{max(lens) + max_new_tokens} is over the built max_seq_len {self.max_seq_len}")
        if min(lens) < 1 or max(lens) > s:
            raise CapacityError(f"prompt_lens {lens} must lie in 1..{s}")
        state = self.new_state(b)
        out = torch.full((b, s + max_new_tokens), pad_token_id, dtype=torch.long, device=self.device)
        out[:, :s] = input_ids
        logits = []
        if len(set(lens)) == 1:
            last = self.decode(input_ids[:, :lens[0]], state)[:, -1]
        else:  # prefill each sequence into its own rows of the batch's caches
            last = torch.cat([self.decode(input_ids[r:r + 1, :lens[r]], state.select(slice(r, r + 1)))[:, -1]
                              for r in range(b)])
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        rows = torch.arange(b, device=self.device)
        for n in range(max_new_tokens):
            logits.append(last)
            token = last.argmax(-1)
            if eos_token_id is not None:
                token = torch.where(done, torch.full_like(token, pad_token_id), token)
                done |= token == eos_token_id
            out[rows, torch.tensor(lens, device=self.device) + n] = token
            if n + 1 < max_new_tokens:
                last = self.decode(token[:, None], state)[:, -1]
        self.last_logits = torch.stack(logits, dim=1) if logits else None
        return out

    def _need_weights(self):
        if self.weights is None:
            raise SdkError("no weights loaded: call load_hf_state_dict(...) or load_weights(...) first")


def random_weights(spec: ModelSpec, *, seed: int = 0, dtype=torch.float32, std: float = 0.02,
                   device="cpu") -> dict:
    """Random canonical weights for `spec` (norm weights near 1, hash tables valid), drawn on
    `device` (a GPU's generator draws other values than the CPU's) and each cast to `dtype` as it
    is drawn: a model of 19 GB in bf16 never holds its 38 GB in fp32."""
    from .weights import expected_weights
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in expected_weights(spec).items():
        if name.endswith("tid2eid"):
            v, k = shape
            num_experts = spec.layers[int(name.split(".")[1])].mlp.num_experts
            out[name] = torch.stack([torch.randperm(num_experts, generator=g, device=device)[:k] for _ in range(v)])
            continue
        if "norm" in name.split(".")[-2] if "." in name else False:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float32, device=device)
        else:
            t = std * torch.randn(shape, generator=g, dtype=torch.float32, device=device)
        out[name] = t.to(dtype)
    return out
