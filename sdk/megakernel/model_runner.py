"""What every whole-model program shares (sdk/megakernel/dsv4_model.py, plain_model.py): the step
driver that feeds a decode step and launches it, and the `megakernel` backend of build_megakernel.

    runner = Runner(cfg, weights, device)      # the program built, its weights bound, caches empty
    logits = runner.decode(ids)                # [B] -> [B, V] fp32: one launch

A model's runner subclasses `ModelRunner` with `build_program`, `program_weights` (the program's
weights from the model's canonical ones) and `step_inputs` (the host's per-step inputs beside the
ids: positions, RoPE tables, lengths); its backend subclasses `MegakernelModel` with the config
and runner classes.
"""
from __future__ import annotations

import torch

from ..errors import CapacityError, UnsupportedConfigError


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
        inputs = {"ids": ids.to(torch.int32), **self.step_inputs(ids)}
        for name, v in inputs.items():
            self.tensors[name].copy_(v.to(self.tensors[name].device))
        self.tensors["logits"].fill_(float("nan"))
        if self.device.type == "cpu":
            self.vm.step(seed=None if self.seed is None else self.seed + self.steps)
        else:
            self.rt.run()
        self.lengths += 1
        self.steps += 1
        return self.tensors["logits"].clone()


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
    the GPU. A prompt is fed one token per step; ragged prompts are not (yet)."""

    backend = "megakernel"
    Config = None            # the model program's config class: Config(spec, batch=, max_seq_len=, expert_dtype=)
    Runner = ModelRunner

    def __init__(self, entry, spec, *, device="cpu", dtype=torch.float32, max_seq_len=64, max_batch=64,
                 expert_dtype="bf16"):
        from ..reference.model import ReferenceModel
        self.Config(spec, expert_dtype=expert_dtype).layers()      # an unsupported spec fails here, by name
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
        cfg = self.Config(self.spec, batch=batch, max_seq_len=self.max_seq_len, expert_dtype=self.expert_dtype)
        return self.Runner(cfg, self.weights, self.device)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, state: ModelRunner) -> torch.Tensor:
        """[B, T] ids -> logits [B, T, V]: T launches, one token of every sequence each."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.shape[0] != state.cfg.batch:
            raise CapacityError(f"input batch {input_ids.shape[0]} does not match the state's batch {state.cfg.batch}")
        return torch.stack([state.decode(input_ids[:, t].cpu()) for t in range(input_ids.shape[1])], dim=1)

    def generate(self, input_ids, max_new_tokens: int, *, prompt_lens=None, eos_token_id=None, pad_token_id=0):
        """Greedy decoding as the reference backend's (sdk/reference/model.py), prompts of one length."""
        from ..reference.model import ReferenceModel
        if prompt_lens is not None and len(set(int(n) for n in prompt_lens)) > 1:
            raise UnsupportedConfigError("the megakernel backend feeds prompts one token a step for the whole "
                                         "batch: ragged prompt_lens are not supported yet")
        return ReferenceModel.generate(self, input_ids, max_new_tokens, prompt_lens=None,
                                       eos_token_id=eos_token_id, pad_token_id=pad_token_id)
