"""bench/common.run_cases, the loop the attention benchmarks share, on CPU (CUDA calls stubbed):
a failing case becomes an error record and does not lose the others, the JSON is rewritten
after every case, and the summary table names every case."""
import json

import pytest
import torch

from bench import common


def test_run_cases_records_errors_and_writes_json_after_each_case(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(common, "copy_bandwidth", lambda: {"copy": 4000.0, "read": 4400.0})
    seen = []

    def one(case, bw):
        # the JSON on disk already holds every case before this one
        seen.append(len(json.loads((tmp_path / "x.json").read_text())["cases"]) if seen else 0)
        if case == 2:
            raise RuntimeError("shape not supported")
        return {"case": f"c{case}", "us": 10.0 * case, "gbs": bw / 2, "fraction_of_floor": 0.5,
                "torch_graph_us": 20.0, "speedup_vs_torch_graph": 2.0, "rel_err": 1e-3}

    res = common.run_cases("x.json", [1, 2, 3], one, lambda c: f"c{c}", str(tmp_path), case_width=10)
    assert seen == [0, 1, 2]
    assert [r["case"] for r in res["cases"]] == ["c1", "c2", "c3"]
    assert res["cases"][1]["error"] == "RuntimeError: shape not supported"
    assert res["copy_bandwidth_gbs"]["copy"] == 4000.0 and res["gpu"] == "fake GPU"
    on_disk = json.loads((tmp_path / "x.json").read_text())
    assert on_disk["cases"] == res["cases"]
    out = capsys.readouterr().out
    assert "copy bandwidth 4000 GB/s (read-only 4400 GB/s)" in out
    assert "c2         ERROR RuntimeError: shape not supported" in out
    assert out.count("c3") >= 2     # its JSON line and its table row


def test_cli_bench_names_every_benchmark_and_refuses_unknown(capsys):
    """`megakernel bench NAME` runs bench/NAME_bench.py: every listed name has one (importable
    without CUDA, with a main), and an unknown name is a clear error, not a traceback."""
    import importlib

    from sdk.cli import BENCHES, main
    for name in BENCHES:
        assert callable(importlib.import_module(f"bench.{name}_bench").main)
    assert main(["bench", "nosuch"]) == 2
    assert "unknown benchmark 'nosuch'; one of: megakernel, moe" in capsys.readouterr().err


@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
def test_gemv_chain_program_equals_reference_in_pyvm(wd):
    """The bench's in-launch GEMV chain: independent GEMVs, each y_j = x @ W_j^T (PyVM, 16 SMs)."""
    from bench.megakernel_bench import gemv_chain_program
    from sdk.megakernel.mlp_stack import quantize_fp8
    from sdk.megakernel.pyvm import PyVM
    n, k, m, count = 256, 512, 2, 3
    g = torch.Generator().manual_seed(3)
    weights, refs = {}, []
    for j in range(count):
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
        if wd == "fp8_e4m3":
            q, sc = quantize_fp8(w)
            weights[f"w{j}"], weights[f"w{j}_scale"] = q, sc
            refs.append(q.float() * sc.repeat_interleave(128, 0).repeat_interleave(128, 1))
        else:
            weights[f"w{j}"] = w
            refs.append(w.float())
    vm, sched = PyVM.from_program(gemv_chain_program(n, k, m, wd, count), 16, weights)
    assert sum(len(lst) for lst in sched.per_sm) == count * n // vm.program.ops[0].block.config.rows_per_tile
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    vm.tensors["x"].copy_(x)
    for j in range(count):
        vm.tensors[f"y{j}"].fill_(float("nan"))
    vm.step()
    for j in range(count):
        ref = x.float() @ refs[j].T
        assert ((vm.tensors[f"y{j}"].float() - ref).norm() / ref.norm()).item() < 1e-2


def test_select_bench_program_repeats_one_select_on_one_sm():
    """bench/select_bench.py: three selects chained on one SM, each equal to the routing rule."""
    import torch

    from bench.select_bench import program
    from sdk.megakernel.pyvm import PyVM
    prog, blk = program("kimi_k3", 1)
    assert [op.label for op in prog.ops] == ["select.0", "select.1", "select.2"]
    vm, sched = PyVM.from_program(prog, 1, {})
    assert len(sched.per_sm[0]) == 3
    vm.tensors["logits"].copy_(torch.randn(1, 896))
    vm.tensors["bias"].copy_(torch.randn(896) * 0.1)
    vm.step()
    want = blk.reference(**vm.tensors)["topk_ids"]
    assert torch.equal(vm.tensors["topk_ids"], want)


def test_timeline_op_table_summarises_each_op():
    """bench/timeline.py --ops: per op (label without the tile index) the tile count, SMs, first
    start, last end, median and max tile time; ops in order of first start; the busy fraction."""
    from bench.timeline import op_table
    rec = {"sm": [0, 1, 0, 1], "start_ns": [0, 1000, 5000, 6000], "end_ns": [4000, 3000, 9000, 10000],
           "label": ["a.gemv[0]", "a.gemv[1]", "b.select[0]", "c.down[0]"]}
    rows = {line.split()[0]: line.split()[1:] for line in op_table(rec).splitlines()[1:-1]}
    assert rows["a.gemv"] == ["2", "2", "0.0", "4.0", "4.00", "4.00"]     # durations 4 and 2 us: median = upper
    assert rows["b.select"] == ["1", "1", "5.0", "9.0", "4.00", "4.00"]
    assert list(rows) == ["a.gemv", "b.select", "c.down"]
    assert op_table(rec).splitlines()[-1] == "span 10.0 us; SMs busy 70% of it (2 SMs)"
    # the finer stamps: medians of wait, staging, chunks, epilogue over an op's streaming tiles
    fine = dict(rec, wait_ns=[-500, 0, 4000, 5000], begun_ns=[500, 1500, None, 6200],
                chunks_ns=[3000, 2500, None, 9000])
    rows = {line.split()[0]: line.split()[1:] for line in op_table(fine).splitlines()[1:-1]}
    assert op_table(fine).splitlines()[0].split()[-4:] == ["wait", "stage", "chunks", "epi"]
    assert rows["a.gemv"][6:] == ["1.00", "0.50", "2.50", "1.00"]    # upper medians of (0.5, 1), (0.5, 0.5), ...
    assert rows["b.select"] == ["1", "1", "5.0", "9.0", "4.00", "4.00"]          # a plain tile: no phases
    assert rows["c.down"][6:] == ["1.00", "0.20", "2.80", "1.00"]
    # with the signal stamp: the epilogue ends at it, `sig` is the release (-> end)
    sig = dict(fine, signal_ns=[3600, 2900, 8000, 9700])
    table = op_table(sig).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[1:-1]}
    assert table[0].split()[-5:] == ["wait", "stage", "chunks", "epi", "sig"]
    assert rows["a.gemv"][6:] == ["1.00", "0.50", "2.50", "0.60", "0.40"]
    assert rows["c.down"][6:] == ["1.00", "0.20", "2.80", "0.70", "0.30"]


def test_profile_block_experts_table_routes_one_token_to_the_asked_hits():
    """bench.profile_block's experts input (for Nsight Compute on the batch-1 expert tile): one token
    routed to `hits` local experts of the model's MoE layer - the block's own reference consumes it
    and every hit expert's row contributes (the other experts' weights stay zero)."""
    import torch

    from bench.profile_block import experts_table
    blk, optab, t = experts_table("glm_53", "down", 2, {}, device="cpu")
    assert int(t["hits"][0]) == 2 and int(t["counts"].sum()) == 2 and optab.shape == (len(blk.operands()),)
    hit = t["hits"][1:3].long()
    assert t["w"][hit].abs().sum() > 0 and t["w"].abs().sum() == t["w"][hit].abs().sum()
    out = blk.reference(**t)["out"].float()
    assert torch.isfinite(out).all() and out.abs().mean() > 0.1
    one = dict(t, counts=t["counts"].clone(), hits=t["hits"].clone())
    one["counts"][hit[1]] = 0
    one["hits"][0] = 1                                         # the second expert dropped: a different sum
    assert not torch.allclose(blk.reference(**one)["out"].float(), out)


def test_experts_bench_routings_rotate_over_the_local_experts():
    """bench/experts_bench.py's cold timing: routing r sends the token to experts r, r + 1, ...
    (mod the local count), every one of them with its own random weights, and the block's
    reference for a routing is the weighted sum of those experts' rows plus the shared input."""
    import torch

    from bench.experts_bench import operands
    from sdk.blocks.experts import ExpertsBlock, ExpertsConfig, dequant_mxfp4
    blk = ExpertsBlock(ExpertsConfig(stage="down", hidden=256, intermediate=128, num_local=4, top_k=2,
                                     weight_dtype="mxfp4", rows_per_tile=8, shared=True))
    shared, tables = operands(blk, 2, device="cpu")
    assert [t["hits"][1:3].tolist() for t in tables] == [[0, 1], [1, 2], [2, 3], [0, 3]]
    assert all(shared["w"][e].abs().sum() > 0 for e in range(4))
    t = tables[3] | shared
    want = shared["shared"].float().clone()
    for j, e in enumerate((0, 3)):      # assignment j of the token: expert e, act row j, weight topk_w[j]
        w = dequant_mxfp4(shared["w"][e], shared["w_scale"][e])
        want += shared["topk_w"].reshape(-1)[j] * (shared["act"][j].float() @ w.T)
    got = blk.reference(**t)["out"].float()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2) and want.abs().mean() > 0.1


def test_ncu_source_cuts_the_table_at_barriers(tmp_path):
    """bench/ncu_source.py: an ncu source table (SASS rows with their stall samples) summed
    between barriers - the regions' samples, reasons and opcodes, and the top instructions."""
    import csv
    from bench.ncu_source import regions, load, opcode, report
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
           "Instructions Executed", "stall_long_sb", "stall_short_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
    rows = [["0x0", "LDGSTS.E.128 [R1], desc[UR4][R2.64]", "2", "2", "16", "0", "1", "0", "0"],
            ["0x10", "IADD3 R3, R2, R1, RZ", "30", "30", "16", "29", "0", "0", "0"],
            ["0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", "1", "1", "16", "0", "0", "1", "0"],
            ["0x30", "@!P0 LDS R4, [R5]", "7", "7", "16", "0", "3", "4", "0"],
            ["0x40", "HMMA.16816.F32 R8, R4, R6, R8", "10", "10", "32", "0", "9", "0", "0"]]
    path = tmp_path / "t.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(hdr)
        w.writerows(rows)
    assert opcode("@!P0 LDS R4, [R5]") == "LDS" and opcode("BAR.SYNC.DEFER_BLOCKING 0x0") == "BAR"
    regs = regions(*load(str(path)))
    assert [(r["first"], r["last"], r["samples"], r["executed"]) for r in regs] == [(0, 1, 32, 16), (2, 4, 18, 32)]
    assert regs[0]["reasons"] == {"long_sb": 29, "short_sb": 1, "barrier": 0}
    assert regs[1]["reasons"]["barrier"] == 5 and regs[1]["opcodes"] == {"BAR": 1, "LDS": 1, "HMMA": 1}
    text = report(str(path), min_share=0.0, top=1)
    assert "64.0%" in text and "36.0%" in text and "IADD3 R3, R2, R1, RZ" in text and "long_sb:29" in text
