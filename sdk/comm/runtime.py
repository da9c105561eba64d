"""N virtual ranks on one GPU: N concurrent megakernel launches (one per rank, each on its own
stream, num_sms // N CTAs each), talking through `VirtualRanks` symmetric buffers.

    rt = TPRuntime(program, comm, bufs, tensors_per_rank)     # one MegakernelRuntime per rank
    rt.run()                  # fork: every rank's launch on its stream; join; raise on errors
    rt.run(ranks=[0, 1, 2])   # rank 3 never launched: the others end in KernelTimeoutError

Why N launches and not one launch whose CTAs are partitioned among ranks: each rank is then
exactly what it is on a real multi-GPU machine - its own launch, counters, epoch, error word,
operand table, and the same compiled kernel (the rank is data) - so this path tests the code
that runs across GPUs, including a rank whose launch never comes. The price: CUDA does not
promise that kernels on different streams run concurrently, and the protocol needs every rank's
CTAs resident at once (a rank spinning on a peer's flag holds its SMs). Two conditions:
  - the N grids fit the GPU together: N x CTAs per rank <= SMs, one CTA per SM (the megakernel's
    ~200 KB of shared memory allows one): `ctas_per_rank` (default SMs // N; 16 of the H200's
    132 at N = 8), which refuses more with UnsupportedConfigError instead of a timeout;
  - the launches really are concurrent: each rank's stream gets its own hardware queue
    (CUDA_DEVICE_MAX_CONNECTIONS, default 8, must be >= N: checked) and the launches are eager
    stream launches. NOT one CUDA graph holding the N launches as parallel branches: measured on
    the H200 (2026-12-03, 8 ranks x 16 CTAs, 52 SMs idle), the graph executor ran some ranks'
    kernel nodes only after another rank's kernel had ended (ranks 5-7 started when rank 0's
    flag wait gave up), depending on the graph (message size, CTA count), with
    CUDA_DEVICE_MAX_CONNECTIONS 8 or 32; eager launches never did. To launch the N ranks
    together without the host's launch skew, see bench.common.launch_together.
If they ever were serialised (a graph, MPS limits, a profiler serialising kernels), the first
rank's flag waits expire and the run ends in KernelTimeoutError, never hangs; with timing=True
the error says which ranks started late (`rank_starts`).

Timeouts: flag waits (in the all-reduce tiles) get half the counter-wait timeout, so when a
peer is missing the all-reduce tile - the cause - claims the error word before CTAs that wait
on the all-reduce's counter - the consequence - would.
"""
from __future__ import annotations

import os

import torch

from ..blocks.allreduce import ERR_PEER_TIMEOUT, PEER_ERROR_FIELDS
from ..errors import KernelTimeoutError, UnsupportedConfigError
from .ops import ERR, PARAMS


def ctas_per_rank(ranks: int, sms: int, num_sms: int | None = None) -> int:
    """CTAs of each of `ranks` concurrent launches on a GPU of `sms` SMs: `num_sms`, by default
    sms // ranks. Raises UnsupportedConfigError unless ranks x CTAs <= sms, i.e. unless every
    rank's CTAs can be resident at once (one CTA per SM), which the flag waits need."""
    if ranks < 1:
        raise UnsupportedConfigError(f"{ranks} virtual ranks")
    n = sms // ranks if num_sms is None else num_sms
    if n < 1 or n * ranks > sms:
        raise UnsupportedConfigError(
            f"{ranks} ranks x {n} CTAs (one per SM) exceed the {sms} SMs: all ranks' CTAs must be resident at "
            f"once, or a rank spinning on a peer's flag holds SMs that the peer needs; at most {sms // ranks} "
            f"CTAs per rank" if sms >= ranks else f"{ranks} ranks on {sms} SMs: at least one SM per rank")
    return n


class TPRuntime:
    def __init__(self, program, comm, bufs, tensors_per_rank: list[dict], *, num_sms: int | None = None,
                 timeout_s: float = 2.0, timing: bool = False, device="cuda"):
        from ..megakernel.runtime import MegakernelRuntime
        n = len(tensors_per_rank)
        self.n, self.comm, self.bufs, self.tensors = n, comm, bufs, tensors_per_rank
        self.device = torch.device(device)
        conns = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
        if conns < n:
            raise UnsupportedConfigError(f"{n} virtual ranks need CUDA_DEVICE_MAX_CONNECTIONS >= {n} "
                                         f"(is {conns}): launches sharing a hardware queue serialise")
        total = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = ctas_per_rank(n, total, num_sms)
        self.timing = timing
        self.timeout_s = timeout_s
        for r, t in enumerate(tensors_per_rank):
            t[PARAMS][0] = r
            t[PARAMS][1] = max(1, int(timeout_s * 1e6 / 2))
        self.runtimes = [MegakernelRuntime(program, t, num_sms=self.num_sms, timing=timing, timeout_s=timeout_s,
                                           device=device, error=t[ERR]) for t in tensors_per_rank]
        ref = self.runtimes[0].schedule.per_sm
        # every rank must walk the same lists: the deadlock-freedom argument (docs/allreduce.md)
        assert all(rt.schedule.per_sm == ref for rt in self.runtimes), "ranks scheduled differently"
        self.streams = [torch.cuda.Stream(self.device) for _ in range(n)]
        self.flag_ids = [comm.flag_ids(t) for t in tensors_per_rank]

    def launch(self, ranks=None, join: bool = True) -> None:
        """Every rank's launch on its own stream, ordered after the current stream's prior work
        and (join=True) joined back into it, so it can be timed with events or captured in a CUDA
        graph. join=False lets the ranks free-run: a rank's next launch may start while slower
        ranks still finish this one (the epochs make that safe); call join() before reading."""
        cur = torch.cuda.current_stream(self.device)
        ranks = range(self.n) if ranks is None else ranks
        for r in ranks:
            s = self.streams[r]
            if join:
                s.wait_stream(cur)
            self.runtimes[r].launch(s)
        if join:
            self.join(ranks)

    def join(self, ranks=None) -> None:
        cur = torch.cuda.current_stream(self.device)
        for r in (range(self.n) if ranks is None else ranks):
            cur.wait_stream(self.streams[r])

    def run(self, ranks=None) -> None:
        self.launch(ranks)
        torch.cuda.synchronize(self.device)
        self.check()

    def check(self) -> None:
        """Raise KernelTimeoutError naming every rank whose error word is set (then reset all).
        With timing=True it also names ranks whose launch started only after the flag timeout
        had passed on the first rank (`late_ranks`): the launches were not concurrent."""
        msgs = []
        for r, rt in enumerate(self.runtimes):
            err = rt.error.cpu().tolist()
            if err[0] == 0:
                continue
            if err[0] == ERR_PEER_TIMEOUT:
                f = dict(zip(PEER_ERROR_FIELDS, err))
                op = self.flag_ids[r].get(f["flag_id"], "?")
                what = getattr(self.comm, "op_kinds", {}).get(op, "all-reduce")
                msgs.append(f"rank {r}: {what} {op!r} tile {f['tile']} (SM {f['sm']}) waited "
                            f"{self.timeout_s / 2:g} s for rank {f['peer']}'s flag >= {f['target']} (epoch "
                            f"{f['epoch']}), saw {f['seen']}: rank {f['peer']} never arrived")
            else:
                try:
                    rt.check()
                except KernelTimeoutError as exc:
                    msgs.append(f"rank {r}: {exc}")
        if msgs:
            late = self.late_ranks() if self.timing else {}
            if late:
                msgs.append("not a protocol error: " + ", ".join(f"rank {r} started {dt * 1e3:.1f} ms after the first"
                                                                  for r, dt in late.items())
                            + " - the ranks' launches did not run concurrently (replayed from one CUDA graph? MPS? "
                              "a serialising profiler? see sdk/comm/runtime.py)")
            self.reset()
            raise KernelTimeoutError("\n".join(msgs))

    def zero_timing(self) -> None:
        """Zero every rank's timing record (before a launch whose `rank_starts` will be read)."""
        for rt in self.runtimes:
            rt.timing_buf.zero_()

    def rank_starts(self) -> list[int | None]:
        """Per rank: globaltimer ns of its first instruction start over its CTAs in the last
        launch (timing=True), or None if none of its CTAs has started since `zero_timing`."""
        out = []
        for rt in self.runtimes:
            tim = rt.timing_buf.cpu()
            st = [int(tim[s, 0, 0]) for s in range(rt.num_sms) if rt.lengths_host[s] > 0]
            st = [t for t in st if t > 0]
            out.append(min(st) if st else None)
        return out

    def late_ranks(self) -> dict[int, float]:
        """{rank: seconds after the first rank's start} for ranks that started only after the
        first rank's flag waits had expired (timeout_s / 2): their launch was not concurrent."""
        st = self.rank_starts()
        known = [t for t in st if t is not None]
        if not known:
            return {}
        t0 = min(known)
        return {r: (t - t0) / 1e9 for r, t in enumerate(st) if t is not None and t - t0 > self.timeout_s / 2 * 1e9}

    def reset(self) -> None:
        """Zero every rank's counters, error word, all-reduce flags, epoch states, row counters."""
        torch.cuda.synchronize(self.device)
        for rt in self.runtimes:
            rt.reset()
        self.comm.reset(self.bufs, self.tensors)
        torch.cuda.synchronize(self.device)

    def timing_raw(self) -> list[torch.Tensor]:
        """Per rank: the raw globaltimer record [num_sms, max_len, isa.TIMING_STAMPS] (all ranks share the GPU's
        clock, so ranks can be compared)."""
        return [rt.timing_buf.cpu() for rt in self.runtimes]
