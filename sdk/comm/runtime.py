"""N virtual ranks on one GPU: N concurrent megakernel launches (one per rank, each on its own
stream, num_sms // N CTAs each), talking through `VirtualRanks` symmetric buffers.

    rt = TPRuntime(program, comm, bufs, tensors_per_rank)     # one MegakernelRuntime per rank
    rt.run()                  # fork: every rank's launch on its stream; join; raise on errors
    rt.run(ranks=[0, 1, 2])   # rank 3 never launched: the others end in KernelTimeoutError

Why N launches and not one launch whose CTAs are partitioned among ranks: each rank is then
exactly what it is on a real multi-GPU machine - its own launch, counters, epoch, error word,
operand table, and the same compiled kernel (the rank is data) - so this path tests the code
that runs across GPUs, including a rank whose launch never comes. The price: CUDA does not
promise that kernels on different streams run concurrently. They do here because the N grids
together fit the GPU at once (num_sms // N CTAs each, one per SM) and each stream gets its own
hardware queue (CUDA_DEVICE_MAX_CONNECTIONS, default 8, must be >= N: checked). If they ever
were serialised (MPS limits, a profiler serialising kernels), the first rank's flag waits would
expire and the run would end in KernelTimeoutError, never hang.

Timeouts: flag waits (in the all-reduce tiles) get half the counter-wait timeout, so when a
peer is missing the all-reduce tile - the cause - claims the error word before CTAs that wait
on the all-reduce's counter - the consequence - would.
"""
from __future__ import annotations

import os

import torch

from ..blocks.allreduce import ERR_PEER_TIMEOUT, PEER_ERROR_FIELDS
from ..errors import KernelTimeoutError, UnsupportedConfigError
from ..megakernel import isa
from .ops import ERR, PARAMS


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
        self.num_sms = num_sms or total // n
        if self.num_sms * n > total:
            raise UnsupportedConfigError(f"{n} ranks x {self.num_sms} CTAs exceed the {total} SMs: all ranks' "
                                         f"CTAs must be resident at once")
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
        """Raise KernelTimeoutError naming every rank whose error word is set (then reset all)."""
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
            self.reset()
            raise KernelTimeoutError("\n".join(msgs))

    def reset(self) -> None:
        """Zero every rank's counters, error word, all-reduce flags, epoch states, row counters."""
        torch.cuda.synchronize(self.device)
        for rt in self.runtimes:
            rt.reset()
        self.comm.reset(self.bufs, self.tensors)
        torch.cuda.synchronize(self.device)

    def timing_raw(self) -> list[torch.Tensor]:
        """Per rank: the raw globaltimer record [num_sms, max_len, 2] (all ranks share the GPU's
        clock, so ranks can be compared)."""
        return [rt.timing_buf.cpu() for rt in self.runtimes]
