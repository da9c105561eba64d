"""RouterSelectConfig.warp_argmax: the top-k rounds' warp (value, index) max as butterfly shuffles
(default) or as two redux.sync instructions on an order-preserving key. Same selection rule (the
CPU twin is route_rule for both); the device forms are compared on the GPU by
tests/gpu/test_moe_gpu.py::test_router_select_matches_rule[*-redux]. Here: the config check and
the compile for every target arch (split select at batch 1, one warp per token at batch 8, groups)."""
import pytest

from sdk.blocks.router import RouterSelectBlock, RouterSelectConfig
from sdk.errors import UnsupportedConfigError

KIMI = dict(num_experts=896, top_k=16, correction_bias=True, local_start=56, num_local=56)


def test_unknown_warp_argmax_is_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="warp_argmax 'sort'"):
        RouterSelectBlock(RouterSelectConfig(m=1, warp_argmax="sort", **KIMI))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_redux_select_compiles(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    cases = [(RouterSelectConfig(m=1, warp_argmax="redux", **KIMI), 8),       # split select + merge
             (RouterSelectConfig(m=8, warp_argmax="redux", **KIMI), 1),       # one warp per token
             (RouterSelectConfig(m=4, num_experts=256, top_k=8, n_group=8, topk_group=4, correction_bias=True,
                                 warp_argmax="redux"), 1)]                    # group-limited
    for cfg, warps in cases:
        block = RouterSelectBlock(cfg)
        assert block.warps_per_token == warps
        standalone(block, arch)
