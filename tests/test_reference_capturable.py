"""The reference backend's capturable decode (ReferenceModel.capturable: the benchmarks' PyTorch
step under a CUDA graph) - the same logits as its ordinary decode, step after step, with no host
sync left (tests/host_syncs.py: what a capture cannot hold, found on the CPU)."""
import pytest
import torch

from host_syncs import HostSyncError, no_host_syncs
from sdk import build_megakernel
from sdk.reference.model import random_weights

MODELS = [("kimi_k3", "small"), ("glm_53", "small"), ("deepseek_v41_flash", "small_v41")]


def pair(model, config):
    """(ordinary, capturable) reference models on the same random weights."""
    out = []
    w = None
    for capturable in (False, True):
        m = build_megakernel(model, config, dtype=torch.float32, max_seq_len=64, max_batch=2)
        w = w or random_weights(m.spec, seed=0)
        m.load_weights(w)
        m.capturable = capturable
        out.append(m)
    return out


@pytest.mark.parametrize("model,config", MODELS)
def test_capturable_decode_equals_decode(model, config):
    """24 steps: GLM-5.3's indexers select pools from step 19 on, V4.1's compressors close windows
    every 4 / 8 tokens, the MoE routes every step; ragged lengths (row 1 starts 3 tokens later)."""
    plain, cap = pair(model, config)
    assert cap.capturable and not plain.capturable
    sp, sc = plain.new_state(2), cap.new_state(2)
    g = torch.Generator().manual_seed(1)
    pre = torch.randint(0, plain.spec.vocab_size, (1, 3), generator=g)
    plain.decode(pre, sp.select(slice(0, 1)))
    cap.decode(pre, sc.select(slice(0, 1)))
    errs = []
    for _ in range(24):
        ids = torch.randint(0, plain.spec.vocab_size, (2, 1), generator=g)
        want = plain.decode(ids, sp)
        with no_host_syncs():
            got = cap.decode(ids, sc)
        errs.append(((got - want).norm() / want.norm()).item())
    print(model, "capturable vs ordinary, max rel err", f"{max(errs):.1e}")
    assert max(errs) < 1e-5, errs
    assert torch.equal(sp.lengths, sc.lengths)


@pytest.mark.parametrize("model,config", MODELS)
def test_the_ordinary_decode_syncs(model, config):
    """The detector's power: the ordinary decode reads the lengths (the capacity check), and with
    the capacity check out of the way, the MoE's hit-experts loop (torch.unique) is caught next."""
    plain, cap = pair(model, config)
    ids = torch.randint(0, plain.spec.vocab_size, (2, 1))
    with pytest.raises(HostSyncError, match="__int__"), no_host_syncs():
        plain.decode(ids, plain.new_state(2))
    for m in cap.mlp:
        if hasattr(type(m), "capturable"):
            m.capturable = False
    with pytest.raises(HostSyncError, match="unique"), no_host_syncs():
        cap.decode(ids, cap.new_state(2))
