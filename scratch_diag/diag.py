"""Diagnostic of the wgmma MLA tile on one split: lse (QK^T only) and o_part (PV) per row/column."""
import sys, torch
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "tests")
from test_mla_gpu import make_case
from harness import run_standalone
from sdk.blocks.mla_decode import MLADecodeConfig
for ctx, heads, rope, T, kvd in [(64, 12, 64, 1, "bf16"), (200, 12, 64, 1, "bf16"), (64, 8, 0, 1, "bf16"), (130, 12, 64, 2, "bf16"), (200, 12, 64, 1, "fp8_e4m3")]:
    cfg = MLADecodeConfig(heads=heads, softmax_scale=0.07, batch=1, q_tokens=T, rope=rope, num_pages=8, max_seq_len=256,
                          num_splits=1, chunk=64, mma="wgmma", kv_dtype=kvd)
    blk, t = make_case(cfg, [ctx], 1234)
    run_standalone(blk, t)
    want = blk.reference(**{k: v.cpu() for k, v in t.items()})
    got_o, got_l = t["o_part"].cpu(), t["lse_part"].cpu()
    dl = (got_l - want["lse_part"]).abs()
    do = (got_o - want["o_part"]).abs()
    print(f"ctx={ctx} heads={heads} rope={rope} T={T}: lse max err {dl.max():.3e} (per row {dl[0,0].tolist()})")
    print("  o_part rel", ((got_o - want["o_part"]).norm() / want["o_part"].norm()).item())
    if do.max() > 1e-2:
        per_row = do[0, 0].amax(-1)
        per_col = do[0, 0].amax(0)
        print("  o err per row", [round(x, 3) for x in per_row.tolist()])
        bad = (per_col > 1e-2).nonzero().flatten().tolist()
        print("  bad cols", len(bad), bad[:20], bad[-5:])
