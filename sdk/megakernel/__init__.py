"""The persistent megakernel runtime: instruction format (`isa`), programs (`program`), the PyVM
(`pyvm`, torch, CPU or GPU), the CuTe DSL kernel (`kernel`, imports cutlass) and its GPU runtime
(`runtime`). Importing this package imports no CuTe DSL; `kernel` and `runtime.MegakernelRuntime`
import it when used. See docs/megakernel.md.
"""
