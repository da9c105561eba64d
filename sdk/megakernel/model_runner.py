"""What every whole-model program shares (sdk/megakernel/mhc_model.py, plain_model.py): the step
driver that feeds a decode step and launches it, and the `megakernel` backend of build_megakernel.

    runner = Runner(cfg, weights, device)      # the program built, its weights bound, caches empty
    logits = runner.decode(ids)                # [B] -> [B, V] fp32: one launch

A model's program config subclasses `ModelConfig` (what the program is built for) with `layers()`
(each sublayer's config from the spec); its runner subclasses `ModelRunner` with `build_program`,
`program_weights` (the program's weights from the model's canonical ones) and `step_inputs` (the
host's per-step inputs beside the ids: positions, RoPE tables); its backend subclasses
`MegakernelModel` with the config and runner classes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CapacityError, UnsupportedConfigError
from ..spec import ModelSpec

PAGE_SIZE = 64              # the paged latent caches' pages (tokens): MLA and DSA layers


@dataclass(frozen=True)
class ModelConfig:
    """What a whole-model program is built for."""
    spec: ModelSpec
    batch: int = 1
    max_seq_len: int = 64
    expert_dtype: str = "bf16"           # the routed experts' format ("bf16" = the model's weights)
    num_sms: int = 132

    @property
    def vocab_rows(self) -> int:
        """The lm_head rows the program computes (all; a tensor-parallel rank's slice: tp_model.py)."""
        return self.spec.vocab_size

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / PAGE_SIZE)

    def paged_attention(self, a, rope: int):
        """The MLAAttentionConfig of an MLA / DSA layer (spec a: MLASpec) with its cache paged: each
        sequence's pages in a row of the pool (ModelRunner sets the block tables)."""
        from .mla_attention import MLAAttentionConfig
        return MLAAttentionConfig(heads=a.num_heads, kv_lora=a.kv_lora_rank, nope=a.qk_nope_head_dim, rope=rope,
                                  v=a.v_head_dim, softmax_scale=a.softmax_scale or a.qk_nope_head_dim ** -0.5,
                                  batch=self.batch, page_size=PAGE_SIZE, num_pages=self.batch * self.pages_per_seq,
                                  max_seq_len=self.pages_per_seq * PAGE_SIZE, num_sms=self.num_sms)

    def prefixes(self) -> list[str]:
        """The sublayer programs' prefixes in the chained program."""
        return [f"l{i}.{site}." for i in range(len(self.spec.layers)) for site in ("attn", "mlp")]


class ModelRunner:
    """Decode steps of a whole-model program: `decode(ids [B])` -> logits [B, V] fp32, one launch a
    step (the caches are the program's buffers, starting empty). device "cpu": the PyVM (the
    blocks' torch twins, in a random valid order per step; `seed` None: the encoded order)."""

    name = "model program"

    def __init__(self, cfg, weights: dict, device="cpu", seed: int | None = 0):
        from .pyvm import PyVM
        self.cfg, self.device, self.seed = cfg, torch.device(device), seed
        self.prog = self.build_program(cfg)
        w = self.program_weights(cfg, weights, device, self.prog)
        if self.device.type == "cpu":
            self.vm, _ = PyVM.from_program(self.prog, 8, w)
            self.tensors = self.vm.tensors
        else:
            from .runtime import program_runtime
            self.rt = program_runtime(self.prog, w)
            self.tensors = self.rt.tensors
        self.lengths = torch.zeros(cfg.batch, dtype=torch.long)
        self.steps = 0
        self.paged = []                      # the paged layers' prefixes (set_paged)
        self.init_model(cfg)

    def init_model(self, cfg) -> None:
        """The model's own setup of the program's tensors (every rank's: rank_tensors), once."""

    def set_paged(self, prefixes: list[str]) -> None:
        """The paged attention layers (their program prefixes): their block tables - each
        sequence's pages in a row - set once, their lengths fed each step."""
        self.paged = prefixes
        n = self.cfg.pages_per_seq
        table = torch.arange(self.cfg.batch * n, dtype=torch.int32).view(self.cfg.batch, n)
        for t in self.rank_tensors():
            for p in prefixes:
                bt = t[p + "block_table"]
                bt.fill_(2 ** 30)                # past a sequence's pages: never read
                bt[:, :n] = table.to(bt.device)

    def rank_tensors(self) -> list[dict]:
        """The program's tensors of every rank this runner drives (one: the whole model on one GPU)."""
        return [self.tensors]

    # the model's parts ---------------------------------------------------------------------------
    @staticmethod
    def build_program(cfg):
        raise NotImplementedError

    @staticmethod
    def program_weights(cfg, weights: dict, device, prog) -> dict:
        raise NotImplementedError

    def step_inputs(self, ids: torch.Tensor) -> dict:
        """The host's inputs of the step about to run, beside the ids (self.lengths: the tokens
        each sequence holds before it)."""
        return {}

    # the step ----------------------------------------------------------------------------------
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ids = ids.reshape(-1)
        if ids.numel() != cfg.batch:
            raise CapacityError(f"{self.name}: {ids.numel()} ids for the built batch {cfg.batch}")
        vocab = cfg.spec.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"{self.name}: token ids outside the vocabulary [0, {vocab})")
        if int(self.lengths.max()) + 1 > cfg.max_seq_len:
            raise CapacityError(f"{self.name}: sequence length over the built max_seq_len {cfg.max_seq_len}")
        lens = (self.lengths + 1).to(torch.int32)          # the new token included
        inputs = {"ids": ids.to(torch.int32), **{p + "seq_lens": lens for p in self.paged}, **self.step_inputs(ids)}
        for t in self.rank_tensors():
            for name, v in inputs.items():
                t[name].copy_(v.to(t[name].device))
            t["logits"].fill_(float("nan"))
        self.launch()
        self.lengths += 1
        self.steps += 1
        return self.logits()

    def launch(self) -> None:
        """Run the step's launch (the inputs are in place)."""
        if self.device.type == "cpu":
            self.vm.step(seed=None if self.seed is None else self.seed + self.steps)
        else:
            self.rt.run()

    def logits(self) -> torch.Tensor:
        return self.tensors["logits"].clone()


ONE_GPU_BYTES = 141e9        # the largest GPU the programs target (H200; B200 / GB300 hold more)


def check_fits_one_gpu(spec) -> None:
    """The whole-model program holds every weight on one GPU (the spec as it is: no TP / EP split):
    a model whose bf16 weights exceed one GPU's memory is refused here, by its size, before any
    block says why in its own terms."""
    from ..reference.weights import expected_weights
    n = sum(math.prod(shape) for shape in expected_weights(spec).values())
    if 2 * n > ONE_GPU_BYTES:
        raise UnsupportedConfigError(
            f"the megakernel backend runs the whole model on one GPU: {spec.name}'s bf16 weights are "
            f"{2 * n / 1e9:.0f} GB, over one GPU's {ONE_GPU_BYTES / 1e9:.0f} GB. Its configs in the device blocks' "
            f"shapes ('small') fit. The tensor-parallel program (kimi_k3, tp=N: sdk/megakernel/tp_model.py) "
            f"drives every rank from this process, all on this GPU; one process per GPU is not written yet")


def head_source(spec, weights: dict) -> str:
    """The model weight the lm_head program buffer comes from: a tied model's embedding, unless the
    weights hold the head apart (a tensor-parallel rank's vocabulary slice: tp_model.py)."""
    return "embed.weight" if spec.tie_word_embeddings and "lm_head.weight" not in weights else "lm_head.weight"


def getter(weights: dict, under: str, what: str):
    """get(name, required=True): the model's weight `under + name`; a missing one raises naming
    it, or (required=False) is None."""
    def get(name, required=True):
        if under + name not in weights:
            if not required:
                return None
            raise UnsupportedConfigError(f"{what}: the model's weight {under + name!r} is missing")
        return weights[under + name]
    return get


def mlp_sources(mlp, weights: dict, layer: str, what: str) -> dict:
    """The MLP sublayer program's weights (unprefixed; but its norm and site) <- the model's
    under `layer` ("layers.{i}."): canonical names, or the routed experts in the program's format
    (moe_layer.experts_from_model: quantised there when the program's are)."""
    from . import dense_layer, moe_layer
    under = layer + "mlp."
    if isinstance(mlp, dense_layer.DenseLayerConfig):
        return {n: under + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")}
    out = {k: under + v for k, v in moe_layer.MODEL_WEIGHTS.items()}
    out.update(moe_layer.experts_from_model(mlp, getter(weights, under, what)))
    return out


def weights_from(src: dict, weights: dict, prog, device, what: str) -> dict:
    """The program's weight buffers, each from `src[name]`: the model's weight of that canonical
    name, or a tensor derived from the model's; cast to the buffer's dtype and shape."""
    from ..blocks.base import DTYPES
    out = {}
    for name, b in prog.buffers.items():
        if b.role != "weight":
            continue
        s = src.get(name)
        if s is None or (isinstance(s, str) and s not in weights):
            raise UnsupportedConfigError(f"{what}: no model weight for the program's {name!r}"
                                         + (f" (wants {s!r})" if s else ""))
        t = weights[s] if isinstance(s, str) else s
        out[name] = t.to(device=device, dtype=DTYPES[b.dtype]).reshape(b.shape).contiguous()
    return out


class MegakernelModel:
    """The "megakernel" backend of build_megakernel (the reference backend's interface:
    load_weights / load_hf_state_dict, new_state, decode, generate, last_logits): one launch of the
    whole-model program per decode step. device "cpu" runs the PyVM (slow: for checking), "cuda"
    the GPU. A prompt is fed one token per step (ragged prompts: `generate`)."""

    backend = "megakernel"
    Config = None            # the model program's config class: Config(spec, batch=, max_seq_len=, expert_dtype=)
    Runner = ModelRunner

    def __init__(self, entry, spec, *, device="cpu", dtype=torch.float32, max_seq_len=64, max_batch=64,
                 expert_dtype="bf16", **config_fields):
        from ..reference.model import ReferenceModel
        check_fits_one_gpu(spec)
        self.config_fields = config_fields          # the Config's own fields (TPModelConfig: ranks)
        # an unsupported spec or shape fails here, by name (the program at batch 1: ~0.1 s)
        self.Runner.build_program(self.Config(spec, max_seq_len=max_seq_len, expert_dtype=expert_dtype, **config_fields))
        self._ref = ReferenceModel(entry, spec, device="cpu", dtype=dtype, max_seq_len=max_seq_len,
                                   max_batch=max_batch)
        self._ref._build = lambda: None           # the weights only: the program runs the model
        self.entry, self.spec, self.device = entry, spec, torch.device(device)
        self.max_seq_len, self.max_batch, self.expert_dtype = max_seq_len, max_batch, expert_dtype
        self.last_logits = None

    @property
    def weights(self):
        return self._ref.weights

    def load_hf_state_dict(self, state_dict) -> "MegakernelModel":
        self._ref.load_hf_state_dict(state_dict)
        return self

    def load_weights(self, weights: dict) -> "MegakernelModel":
        self._ref.load_weights(weights)
        return self

    def new_state(self, batch: int) -> ModelRunner:
        if batch > self.max_batch:
            raise CapacityError(f"batch {batch} is over the built max_batch {self.max_batch}")
        self._ref._need_weights()
        cfg = self.Config(self.spec, batch=batch, max_seq_len=self.max_seq_len, expert_dtype=self.expert_dtype,
                          **self.config_fields)
        return self.Runner(cfg, self.weights, self.device)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, state: ModelRunner) -> torch.Tensor:
        """[B, T] ids -> logits [B, T, V]: T launches, one token of every sequence each."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.shape[0] != state.cfg.batch:
            raise CapacityError(f"input batch {input_ids.shape[0]} does not match the state's batch {state.cfg.batch}")
        return torch.stack([state.decode(input_ids[:, t].cpu()) for t in range(input_ids.shape[1])], dim=1)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, *, prompt_lens=None, eos_token_id=None, pad_token_id=0):
        """Greedy decoding with the reference backend's contract (sdk/reference/model.py): [B, S] ->
        [B, S + N], row r's new tokens right after its prompt (`prompt_lens[r]` tokens; ragged
        prompts allowed), the row right-padded; `last_logits` [B, N, V]. One launch a step, every
        row one token: a row feeds its prompt, then its own new tokens, so a short prompt starts
        generating while a longer one is still being read (the rows are independent)."""
        ids = torch.as_tensor(input_ids).to(torch.long).cpu()
        b, s = ids.shape
        lens = [s] * b if prompt_lens is None else [int(n) for n in prompt_lens]
        if len(lens) != b or min(lens) < 1 or max(lens) > s:
            raise CapacityError(f"prompt_lens {lens} must give each of the {b} rows a length in 1..{s}")
        if max(lens) + max_new_tokens > self.max_seq_len:
            raise CapacityError(f"prompt ({max(lens)}) + new tokens ({max_new_tokens}) = "
                                f"{max(lens) + max_new_tokens} is over the built max_seq_len {self.max_seq_len}")
        out = torch.full((b, s + max_new_tokens), pad_token_id, dtype=torch.long)
        out[:, :s] = ids
        if max_new_tokens <= 0:
            self.last_logits = None
            return out
        state = self.new_state(b)
        logits = [[None] * max_new_tokens for _ in range(b)]
        done = [False] * b
        for t in range(max(lens) + max_new_tokens - 1):
            # row r reads its prompt up to step lens[r] - 1, then its new tokens (pad once finished)
            feed = torch.tensor([int(out[r, t]) if t < lens[r] + max_new_tokens else pad_token_id for r in range(b)])
            step = state.decode(feed)
            for r in range(b):
                j = t - (lens[r] - 1)                   # the new token this step's logits choose
                if not 0 <= j < max_new_tokens:
                    continue
                logits[r][j] = step[r]
                token = pad_token_id if done[r] else int(step[r].argmax())
                done[r] = done[r] or (eos_token_id is not None and token == eos_token_id)
                out[r, lens[r] + j] = token
        self.last_logits = torch.stack([torch.stack(row) for row in logits])
        return out
