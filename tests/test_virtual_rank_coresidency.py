"""The co-residency rule of N virtual ranks on one GPU, on CPU (CUDA calls stubbed): every rank's
CTAs must be resident at once (ranks x CTAs <= SMs: `ctas_per_rank` refuses more rather than let
the flag waits time out), the launches must be concurrent (the benchmarks release eager launches
together behind a GPU-side gate, not one CUDA graph: bench/NOTES.md, 2026-12-03), and a timeout
whose cause is a rank that started late says so."""
import inspect

import pytest
import torch

from bench import common
from sdk.comm.runtime import TPRuntime, ctas_per_rank
from sdk.errors import UnsupportedConfigError

H200_SMS = 132


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 7, 8, 16, 32, 132])
def test_default_ctas_per_rank_fit_the_gpu_together(ranks):
    n = ctas_per_rank(ranks, H200_SMS)
    assert n == H200_SMS // ranks and n >= 1 and ranks * n <= H200_SMS


def test_ctas_per_rank_refuses_what_cannot_be_resident_at_once():
    assert ctas_per_rank(8, H200_SMS) == 16            # the benchmarks' 8 ranks: 128 of 132 SMs
    assert ctas_per_rank(8, H200_SMS, 12) == 12        # fewer is fine
    with pytest.raises(UnsupportedConfigError, match=r"8 ranks x 17 CTAs .* exceed the 132 SMs.*at most 16"):
        ctas_per_rank(8, H200_SMS, 17)
    with pytest.raises(UnsupportedConfigError, match="at least one SM per rank"):
        ctas_per_rank(133, H200_SMS)
    with pytest.raises(UnsupportedConfigError):
        ctas_per_rank(4, H200_SMS, 0)
    with pytest.raises(UnsupportedConfigError):
        ctas_per_rank(0, H200_SMS)


def test_virtual_rank_benchmarks_launch_eagerly_behind_a_gate_not_from_a_cuda_graph():
    """The pattern that timed out: the N ranks' launches replayed from one CUDA graph."""
    from bench import allreduce_bench, ep_bench
    for mod in (allreduce_bench, ep_bench):
        src = inspect.getsource(mod.measure)
        assert "launch_together(rt.launch)" in src and "replayer(" not in src and "capture(" not in src, mod.__name__
        assert "num_sms=sms_per_rank" in src, mod.__name__


def test_launch_together_gates_the_launches_on_the_gpu(monkeypatch):
    """call(start): the spin kernel first, then the start event, then the ranks' launches; the
    spin is longer than the host took to issue them (calibrated)."""
    log = []

    class Ev:
        def __init__(self, **kw):
            pass

        def record(self):
            log.append("record")

        def elapsed_time(self, other):
            return 1.0                                  # ms: 2^20 cycles in 1000 us

    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda c: log.append(("sleep", c)))

    def launch():
        log.append("launch")

    call, mode = common.launch_together(launch)
    assert mode == "eager_gated" and log.count("launch") == 2    # calibration launches
    assert call.gate_us >= common.GATE_MIN_US
    log.clear()
    start = Ev()
    call(start)
    assert log[0][0] == "sleep" and log[1:] == ["record", "launch"]
    assert log[0][1] == round(call.gate_us * (1 << 20) / 1000.0)
    assert common.gate_us(0.0) == common.GATE_MIN_US and common.gate_us(500.0) >= 1500.0


class _FakeRankRuntime:
    """What TPRuntime.rank_starts reads of a rank's MegakernelRuntime: its timing record."""

    def __init__(self, starts_ns, lengths):
        self.num_sms = len(lengths)
        self.lengths_host = lengths
        self.timing_buf = torch.zeros(self.num_sms, 2, 2, dtype=torch.int64)
        for s, t in enumerate(starts_ns):
            self.timing_buf[s, 0, 0] = t


def test_a_timeout_caused_by_a_late_rank_is_named():
    rt = object.__new__(TPRuntime)
    rt.timeout_s = 0.2                                   # flag waits give up after 0.1 s
    t0 = 10 ** 12
    rt.runtimes = [_FakeRankRuntime([t0 + 1000, t0 + 3000], [2, 2]),
                   _FakeRankRuntime([t0 + 2000, 0], [2, 0]),           # SM 1 has no work
                   _FakeRankRuntime([t0 + 100_020_000, t0 + 100_021_000], [2, 2]),   # after the timeout
                   _FakeRankRuntime([0, 0], [2, 2])]                   # never started since zeroed
    assert rt.rank_starts() == [t0 + 1000, t0 + 2000, t0 + 100_020_000, None]
    late = rt.late_ranks()
    assert list(late) == [2] and late[2] == pytest.approx(0.100019)
