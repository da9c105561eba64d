"""DeepSeek-V4 KV compression blocks on the GPU (V4.1-Flash: HCA ratio 128 and CSA ratio 4 at 512
channels, the CSA indexer's compressor at 128): the pooling (channel-sliced tiles) then the entry
norm, standalone, over successive calls of T tokens, ragged sequences placed around window
boundaries, against the blocks' references (bit-equal to the model's compressor on the CPU,
tests/test_dsv4_compress.py), the entries NaN-poisoned.
Run: `pytest -m gpu tests/gpu/test_dsv4_compress_gpu.py`."""
import pytest
import torch

from harness import clock_seed, need_gpu, rel_err, run_standalone

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dim,ratio,overlap,batch,T", [(512, 128, False, 64, 1), (512, 4, True, 8, 2),
                                                       (128, 4, True, 64, 1), (512, 128, False, 3, 4)],
                         ids=["hca-b64", "csa-b8-T2", "indexer-b64", "hca-b3-T4"])
def test_dsv4_compress(dim, ratio, overlap, batch, T):
    need_gpu()
    from sdk.blocks.dsv4_compress import DSV4CompressConfig, compressor_blocks
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, C = 64, 2 * dim if overlap else dim
    block, norm = compressor_blocks(DSV4CompressConfig(dim=dim, ratio=ratio, overlap=overlap, batch=batch, tokens=T,
                                                       max_entries=E))
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    # sequences just before a window boundary, at one, and far in
    start = torch.tensor([(ratio * (1 + b % 5)) - (b % 3) for b in range(batch)], dtype=torch.int32, device="cuda")
    t = {"position_bias": 0.5 * r(ratio, C), "kv_norm": (1 + 0.1 * r(dim)).to(torch.bfloat16),
         "state_kv": r(batch, block.slots, C).to(torch.bfloat16), "state_gate": r(batch, block.slots, C),
         "entries": torch.full((batch, E, dim), float("nan"), device="cuda", dtype=torch.bfloat16)}
    closed = 0
    # two whole windows of calls at small batch; at batch 64 the first calls only (the sequences
    # start 0-2 tokens before a boundary): the CPU reference of 256 calls x 64 sequences took
    # over pytest's 180 s beside the other GPU tests
    for call in range(max(2, 2 * ratio // T) if batch <= 8 else 8):
        ang = r(batch, T, 32)
        t.update({"kv": r(batch, T, C).to(torch.bfloat16), "gate": r(batch, T, C).to(torch.bfloat16),
                  "cos": ang.cos().to(torch.bfloat16), "sin": ang.sin().to(torch.bfloat16), "start": start})
        cpu = {k: v.cpu() for k, v in t.items()}
        want = block.reference(**cpu)
        want.update(norm.reference(**{**cpu, **want}))
        run_standalone(block, t)
        run_standalone(norm, t)
        for name in ("state_kv", "state_gate"):                 # values moved / one exact fp32 add
            assert torch.equal(t[name].cpu(), want[name]), f"seed {seed}, call {call}: {name}"
        fin = torch.isfinite(want["entries"])
        assert torch.equal(torch.isfinite(t["entries"].cpu()), fin), f"seed {seed}, call {call}: entries written"
        if fin.any():
            err = rel_err(t["entries"].cpu()[fin], want["entries"][fin])
            assert err <= 1e-2, f"seed {seed}, call {call}: entries rel err {err:.3e}"
        closed += int((((start.cpu()[:, None] + torch.arange(T)) + 1) % ratio == 0).sum())
        start = start + T
    assert closed > 0


@pytest.mark.parametrize("dim,ratio,overlap,batch,T,entry_dtype", [(512, 128, False, 8, 1, "fp4_e2m1"),
                                                                   (512, 4, True, 8, 2, "fp4_e2m1"),
                                                                   (128, 4, True, 8, 2, "mxfp4")],
                         ids=["hca-b8", "csa-b8-T2", "indexer-mxfp4-b8-T2"])
def test_dsv4_compress_record_entries(dim, ratio, overlap, batch, T, entry_dtype):
    """entry_dtype="fp4_e2m1" (E2M1 codes + an E4M3 scale per 16 values) / "mxfp4" (the indexer's
    keys: + a UE8M0 scale per 32): the pooling writes `pooled`, the norm quantises the entry into
    V4.1's record - the records equal the torch twin's from the device's own pooled rows, except
    a code one step away where the norm's sums (another order) round the value across a code
    boundary (counted, bounded); every other byte exact."""
    need_gpu()
    from sdk.blocks.dsv4_compress import DSV4CompressConfig, compressor_blocks
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, C = 64, 2 * dim if overlap else dim
    block, norm = compressor_blocks(DSV4CompressConfig(dim=dim, ratio=ratio, overlap=overlap, batch=batch, tokens=T,
                                                       max_entries=E, entry_dtype=entry_dtype))
    quantize, dequantize = norm.quantize, norm.dequantize
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    start = torch.tensor([(ratio * (1 + b % 5)) - (b % 3) for b in range(batch)], dtype=torch.int32, device="cuda")
    t = {"position_bias": 0.5 * r(ratio, C), "kv_norm": (1 + 0.1 * r(dim)).to(torch.bfloat16),
         "state_kv": r(batch, block.slots, C).to(torch.bfloat16), "state_gate": r(batch, block.slots, C),
         "pooled": torch.full((batch, T, dim), float("nan"), device="cuda", dtype=torch.bfloat16),
         "entries": quantize(r(batch, E, dim))}
    closed = 0
    # ratio / T + 2 calls close a pool in every sequence (the starts sit 0-2 positions before a
    # boundary): 2 ratio / T calls (256 for HCA) ran past the 180 s test limit under xdist (H200)
    for call in range(ratio // T + 2):
        ang = r(batch, T, 32)
        t.update({"kv": r(batch, T, C).to(torch.bfloat16), "gate": r(batch, T, C).to(torch.bfloat16),
                  "cos": ang.cos().to(torch.bfloat16), "sin": ang.sin().to(torch.bfloat16), "start": start})
        run_standalone(block, t)
        cpu = {k: v.cpu() for k, v in t.items()}           # the norm's twin from the device's pooled rows
        want = norm.reference(**cpu)["entries"]
        run_standalone(norm, t)
        got = t["entries"].cpu()
        vg, vw = dequantize(got).float(), dequantize(want).float()
        err = rel_err(vg, vw, check_finite=False, min_norm=1e-6)
        assert err <= 2e-2, f"seed {seed}, call {call}: entry values rel err {err:.3e}"
        diff = (got != want).sum().item()
        assert diff <= 0.01 * got.numel(), f"seed {seed}, call {call}: {diff} record words differ"
        closed += int((((start.cpu()[:, None] + torch.arange(T)) + 1) % ratio == 0).sum())
        start = start + T
    assert closed > 0
