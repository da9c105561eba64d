"""Running a megakernel program on the GPU: buffers, operand table, counters, launch, error word.

    rt = MegakernelRuntime(program, tensors, num_sms=132)   # tensors: name -> cuda tensor
    rt.run()            # one launch (one decode step), synchronize, raise on the error word
    rt.launch(stream)   # launch only (benchmarks, CUDA-graph capture); rt.check() later

Everything the kernel reads is uploaded once: instruction words, list lengths, the operand table
of raw device pointers (so the tensors must stay alive and in place: the runtime keeps them).
The call itself passes eight scalars, no tensor conversion (`from_dlpack` costs ~12.5 us a call).
"""
from __future__ import annotations

import torch

from ..blocks.base import DTYPES
from ..errors import KernelTimeoutError
from ..schedule import schedule, validate
from . import isa
from .program import encode


def check_buffers(program, tensors: dict, device_type: str) -> None:
    """Every buffer of `program` has its tensor: its shape and dtype, contiguous, 16-byte aligned
    (the blocks' vector loads), on `device_type` - a clear error naming the buffer otherwise."""
    for name, b in program.buffers.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"no tensor for buffer {name!r}")
        if tuple(t.shape) != b.shape or t.dtype != DTYPES[b.dtype] or not t.is_contiguous() \
                or t.device.type != device_type or t.data_ptr() % 16:
            where = "" if t.data_ptr() % 16 == 0 else f" at address {t.data_ptr():#x}"
            raise ValueError(f"buffer {name!r}: want contiguous 16-byte aligned {device_type} {b.dtype}{list(b.shape)}, "
                             f"got {t.dtype}{list(t.shape)} on {t.device}{where}")


class MegakernelRuntime:
    def __init__(self, program, tensors: dict[str, torch.Tensor], *, num_sms: int | None = None,
                 timing: bool = False, timeout_s: float = 2.0, device="cuda",
                 error: torch.Tensor | None = None, pdl: bool = False, schedule_order: str = "phase",
                 records_window: int | None = None):
        # error: use this int32[ERROR_WORDS] tensor as the error word (blocks that wait on other
        # GPUs, e.g. the all-reduce, bind the same tensor as an operand, so that their timeout
        # stops this launch's other CTAs too); default: a fresh one.
        # pdl: programmatic dependent launch - a launch may start on the SMs the previous one
        # (the previous decode step) has left, instruction records and weight ring filled,
        # before griddepcontrol.wait lets it read what that step wrote. Correct on the H200, but
        # opt-in: the 8-layer I=2048 MLP stack measured 222.8 us with it vs 214.5 us without
        # (2026-12-03); the standalone streaming kernel (blocks._cute.standalone) has it on.
        # records_window: the instruction records' smem window (program.records_geometry); None:
        # all resident when they fit, else the largest window that fits its budget.
        self.program = program
        self.device = torch.device(device)
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = num_sms
        check_buffers(program, tensors, "cuda")
        self.tensors = tensors
        self.schedule = schedule(program, num_sms, order=schedule_order)   # sdk.schedule.op_order
        validate(program, self.schedule.per_sm)
        words, lengths = encode(program, self.schedule.per_sm)
        self.words_host, self.lengths_host = words, lengths
        dev = self.device
        self.words = torch.from_numpy(words).to(dev)
        self.lengths = torch.from_numpy(lengths).to(dev)
        self.counters = torch.zeros(program.num_counters, dtype=torch.int32, device=dev)
        if error is not None and (error.dtype != torch.int32 or error.numel() != isa.ERROR_WORDS
                                  or error.device != self.counters.device):
            raise ValueError(f"error word: want int32[{isa.ERROR_WORDS}] on {dev}, got {error.dtype}{list(error.shape)}")
        self.error = error if error is not None else torch.zeros(isa.ERROR_WORDS, dtype=torch.int32, device=dev)
        ptrs = [0 if n is None else tensors[n].data_ptr() for n in program.optab]
        from .program import records_geometry
        nops, _, self.records_window = records_geometry(program.opcodes.blocks, words.shape[1], records_window)
        # padded: every instruction record reads nops pointers from its base
        self.optab = torch.tensor(ptrs + [0] * nops, dtype=torch.int64, device=dev)
        self.timing = timing
        self.max_len = words.shape[1]
        self.timing_buf = torch.zeros((num_sms, self.max_len, isa.TIMING_STAMPS) if timing else (1,),
                                      dtype=torch.int64, device=dev)
        self.timeout_ns = int(timeout_s * 1e9)
        from .kernel import compile_megakernel
        self.fn = compile_megakernel(program.opcodes.blocks, num_sms, self.max_len, timing, pdl=pdl,
                                     records_window=self.records_window)
        self._args = [t.data_ptr() for t in (self.words, self.lengths, self.counters, self.error,
                                               self.optab, self.timing_buf)]

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        import cuda.bindings.driver as cuda
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        self.fn(*self._args, self.timeout_ns, cuda.CUstream(s.cuda_stream))

    def check(self) -> None:
        """Raise KernelTimeoutError if a launch set the error word (then reset the counters)."""
        err = self.error.cpu().tolist()
        if err[0] == 0:
            return
        f = dict(zip(isa.ERROR_FIELDS, err))
        c = f["counter"]
        cname = self.program.counter_names[c] if 0 <= c < self.program.num_counters else "?"
        ins = ""
        sm, idx = f["sm"], f["instruction"]
        if 0 <= sm < self.num_sms and 0 <= idx < len(self.schedule.per_sm[sm]):
            ins = self.program.instructions[self.schedule.per_sm[sm][idx]].label
        self.reset()
        raise KernelTimeoutError(
            f"megakernel wait timed out after {self.timeout_ns / 1e9:g} s: SM {sm}, instruction #{idx} "
            f"{ins!r} (opcode {f['opcode']}) waited for counter {c} ({cname}) >= {f['target']}, saw "
            f"{f['seen']} (epoch {f['epoch']}); the dependency never arrived")

    def run(self) -> None:
        self.launch()
        torch.cuda.synchronize(self.device)
        self.check()

    def reset(self) -> None:
        """Zero counters and the error word (after an error, or to restart the epochs)."""
        self.counters.zero_()
        self.error.zero_()
        torch.cuda.synchronize(self.device)

    def timing_record(self) -> dict:
        """Per-SM instruction timings of the last launch, ns relative to the earliest start: when
        each instruction's waits began (wait_ns) and were met (start_ns), when a streaming tile's
        activations were staged (begun_ns) and its chunks consumed (chunks_ns; both None for a
        plain tile), when its signal's release began (signal_ns) and its end (end_ns, after the
        signal); with the opcode and label of each
        instruction (for the timeline plot and `bench.timeline --ops`)."""
        if not self.timing:
            raise ValueError("built with timing=False")
        tim = self.timing_buf.cpu().numpy()
        t0 = min(int(tim[s, 0, isa.STAMP_START]) for s in range(self.num_sms) if self.lengths_host[s] > 0)
        stamps = {"start_ns": isa.STAMP_START, "end_ns": isa.STAMP_END, "wait_ns": isa.STAMP_WAIT,
                  "begun_ns": isa.STAMP_BEGUN, "chunks_ns": isa.STAMP_CHUNKS, "signal_ns": isa.STAMP_SIGNAL}
        rec = {"sm": [], "opcode": [], "label": [], **{k: [] for k in stamps}}
        for s, lst in enumerate(self.schedule.per_sm):
            for j, i in enumerate(lst):
                ins = self.program.instructions[i]
                rec["sm"].append(s)
                rec["opcode"].append(ins.opcode)
                rec["label"].append(ins.label)
                for k, x in stamps.items():
                    v = int(tim[s, j, x])
                    rec[k].append(v - t0 if v else None)
        rec["opcode_names"] = [type(b).__name__ + ("+swiglu" if getattr(b.config, "swiglu", False) else "")
                               for b in self.program.opcodes.blocks]
        return rec


def program_runtime(program, weights: dict, inputs: dict | None = None, device="cuda", **kw) -> MegakernelRuntime:
    """A MegakernelRuntime of `program` with every buffer allocated (PyVM.alloc), the weights the
    program binds taken from `weights` (others ignored; a missing, mis-shaped or mistyped one is a
    WeightsMismatchError: program.check_weights), `inputs` bound as given; kw to MegakernelRuntime."""
    from .program import check_weights
    from .pyvm import PyVM
    check_weights(program, {**weights, **(inputs or {})})      # weights may come in as inputs too
    tensors = PyVM.alloc(program, device=device)
    tensors.update({k: v for k, v in weights.items() if k in program.buffers})
    tensors.update(inputs or {})
    return MegakernelRuntime(program, tensors, **kw)
