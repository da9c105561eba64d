"""The reference decode of each in-tree model against transformers (the oracle), on tiny random configs.

For each model and seed: the transformers model with router biases, norm weights, gates and other
small parameters set to non-trivial random values; its state dict loaded into the SDK's reference
backend; greedy tokens identical for 32 new tokens, per-step logits within 1e-4 (fp32)."""
import pytest
import torch

from sdk import build_megakernel, plugins
from conftest import IN_TREE_MODELS, import_dotted, transformers_or_skip

NEW_TOKENS = 32
SEEDS = [0, 1, 2]
LOGIT_TOL = 1e-4
# Parameters that default to constants (ones, zeros) in a fresh transformers model: give them
# non-trivial values so the comparison exercises them.
PERTURB_KEYS = ("norm", "bias", "A_log", "dt_bias", "sink", "hc", "kpool")


def perturb_(model, seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    for name, t in model.state_dict().items():
        if name.endswith("tid2eid"):  # hash-routing table: distinct valid experts per token
            v, k = t.shape
            text = model.config.get_text_config()
            n_exp = getattr(text, "n_routed_experts", None) or getattr(text, "num_local_experts")
            t.copy_(torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(v)]))
        elif t.is_floating_point() and any(key in ".".join(name.split(".")[-2:]) for key in PERTURB_KEYS):
            t.add_(0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype))


def hf_model(entry, seed: int):
    transformers_or_skip()
    config = entry.hf_config(entry.config("tiny"))
    torch.manual_seed(seed)
    model = import_dotted(entry.hf_causal_lm)(config).eval().to(torch.float32)
    with torch.no_grad():
        perturb_(model, seed)
    model.generation_config.eos_token_id = None
    return config, model


def prompt(entry, seed, batch=2, length=7):
    g = torch.Generator().manual_seed(seed)
    vocab = entry.spec("tiny").vocab_size
    return torch.randint(1, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model_id", IN_TREE_MODELS)
def test_greedy_tokens_and_logits_match_transformers(model_id, seed):
    entry = plugins.get_model(model_id)
    config, model = hf_model(entry, seed)
    ids = prompt(entry, seed)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=0)
    mk = build_megakernel(model_id, config=config, backend="reference", dtype=torch.float32)
    mk.load_hf_state_dict(model.state_dict())
    out = mk.generate(ids, NEW_TOKENS)
    hf_logits = torch.stack(hf.logits, dim=1).float()
    assert out.dtype == torch.int64 and out.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS)
    assert mk.last_logits.shape == hf_logits.shape
    diff = (mk.last_logits - hf_logits).abs().max().item()
    assert diff <= LOGIT_TOL, f"{model_id} seed {seed}: logits max-abs-diff {diff:.3e}"
    assert torch.equal(out, hf.sequences), f"{model_id} seed {seed}: greedy tokens differ"


@pytest.mark.parametrize("model_id", IN_TREE_MODELS)
def test_multi_token_decode_equals_single_steps(model_id):
    """A T-token decode (speculative verify) equals T single-token steps."""
    from sdk.reference.model import random_weights
    entry = plugins.get_model(model_id)
    mk = build_megakernel(model_id, config="tiny", backend="reference", max_seq_len=64)
    mk.load_weights(random_weights(mk.spec, seed=3))
    ids = prompt(entry, 3, batch=2, length=12)
    state_a, state_b = mk.new_state(2), mk.new_state(2)
    prefix = 5
    mk.decode(ids[:, :prefix], state_a)
    mk.decode(ids[:, :prefix], state_b)
    together = mk.decode(ids[:, prefix:], state_a)
    single = torch.cat([mk.decode(ids[:, t:t + 1], state_b) for t in range(prefix, ids.shape[1])], dim=1)
    diff = (together - single).abs().max().item()
    assert diff <= 1e-5, f"T-token decode differs from single steps by {diff:.3e}"
    assert torch.equal(state_a.lengths, state_b.lengths)


@pytest.mark.parametrize("model_id", IN_TREE_MODELS)
def test_ragged_batch_equals_each_sequence_alone(model_id):
    from sdk.reference.model import random_weights
    entry = plugins.get_model(model_id)
    mk = build_megakernel(model_id, config="tiny", backend="reference", max_seq_len=64)
    mk.load_weights(random_weights(mk.spec, seed=4))
    ids = prompt(entry, 4, batch=3, length=9)
    lens = [9, 4, 6]
    batched = mk.generate(ids, 10, prompt_lens=lens)
    batched_logits = mk.last_logits
    for r, n in enumerate(lens):
        alone = mk.generate(ids[r:r + 1, :n], 10)
        assert torch.equal(batched[r, :n + 10], alone[0]), f"row {r} tokens differ"
        diff = (batched_logits[r] - mk.last_logits[0]).abs().max().item()
        assert diff <= 1e-5, f"row {r} logits differ by {diff:.3e}"
