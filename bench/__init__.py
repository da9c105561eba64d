"""Benchmarks (GPU). Entry point for `megakernel bench`: `bench.megakernel_bench.run(out_dir, quick)`."""
