"""Where a kernel's warps stall, region by region: Nsight Compute's per-instruction table cut at
the barriers.

    ncu --clock-control none --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \
        --section SourceCounters -o R python -m bench.profile_mla kimi_k3_tp8 131072 1 fp8=1,chunk=64
    ncu -i R.ncu-rep --page source --csv --print-source sass | gzip > R_sass.csv.gz
    python -m bench.ncu_source R_sass.csv.gz [--min-share 0.01] [--top 0]

A region runs from one barrier (BAR, DEPBAR) to the next: a tile's phases. Each printed line has
the region's share of the warp stall samples, the most executions of any of its instructions,
its three largest stall reasons, and its commonest opcodes. `--top N` lists the N instructions
with the most samples, each with its two largest reasons.
"""
from __future__ import annotations

import argparse
import csv
import gzip

CUTS = ("BAR", "DEPBAR")


def load(path: str) -> tuple[list[str], list[list[str]], list[int]]:
    """(header, instruction rows, indices of the stall-reason columns) of an ncu source CSV
    (gzip or plain; the first line names the kernel)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    data = [r for r in rows[2:] if len(r) == len(hdr)]
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    return hdr, data, reasons


def opcode(source: str) -> str:
    """The opcode of a SASS line, without its predicate and modifiers ("@!P0 BAR.SYNC 0x0" -> BAR)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def regions(hdr, data, reasons) -> list[dict]:
    """The rows cut before each barrier: per region its first and last row, samples, most
    executions, stall reasons and opcode counts."""
    col = {h: i for i, h in enumerate(hdr)}
    samples, execs = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    edges = [0] + [i for i, r in enumerate(data) if opcode(r[col["Source"]]) in CUTS] + [len(data)]
    out = []
    for a, b in zip(edges, edges[1:]):
        if b <= a:
            continue
        rows = data[a:b]
        ops: dict[str, int] = {}
        for r in rows:
            o = opcode(r[col["Source"]])
            ops[o] = ops.get(o, 0) + 1
        out.append({"first": a, "last": b - 1, "samples": sum(int(r[samples]) for r in rows),
                    "executed": max(int(r[execs]) for r in rows),
                    "reasons": {hdr[k][len("stall_"):]: sum(int(r[k]) for r in rows) for k in reasons},
                    "opcodes": ops})
    return out


def report(path: str, min_share: float = 0.01, top: int = 0) -> str:
    hdr, data, reasons = load(path)
    regs = regions(hdr, data, reasons)
    total = sum(r["samples"] for r in regs) or 1
    lines = [f"{path}: {len(data)} instructions, {total} stall samples"]
    for r in regs:
        if r["samples"] < min_share * total:
            continue
        why = sorted(r["reasons"].items(), key=lambda kv: -kv[1])[:3]
        ops = sorted(r["opcodes"].items(), key=lambda kv: -kv[1])[:6]
        lines.append(f"{r['first']:6d}-{r['last']:<6d} {r['samples'] / total:6.1%}  executed <= {r['executed']:<8d} "
                     + " ".join(f"{k}:{v}" for k, v in why) + "  | " + " ".join(f"{k}x{v}" for k, v in ops))
    if top:
        col = {h: i for i, h in enumerate(hdr)}
        s = col["Warp Stall Sampling (All Samples)"]
        for i in sorted(sorted(range(len(data)), key=lambda i: -int(data[i][s]))[:top]):
            r = data[i]
            why = sorted(((int(r[k]), hdr[k][len("stall_"):]) for k in reasons), reverse=True)[:2]
            lines.append(f"{i:6d} {r[col['Source']].strip()[:64]:64s} {r[s]:>6s}  " + " ".join(f"{n}:{v}" for v, n in why))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--min-share", type=float, default=0.01, help="hide regions under this share of the samples")
    ap.add_argument("--top", type=int, default=0, help="also list the N instructions with the most samples")
    a = ap.parse_args(argv)
    print(report(a.csv, a.min_share, a.top))


if __name__ == "__main__":
    main()
