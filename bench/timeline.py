"""Render a megakernel timing record (JSON from `megakernel_bench --timeline`) as a PNG timeline:
one row per SM, time on x, one bar per instruction coloured by its op (label). Runs on CPU.

    python -m bench.timeline bench/results/h200/timeline_mlp_stack.json -o timeline.png [--ops]

--ops prints per op: tiles, SMs, first start, last end, median / max tile time.
"""
from __future__ import annotations

import argparse
import json


def render(record: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # one colour per op (the instruction label without its tile index): ops of one block type
    # (the many GEMVs of a layer) stay apart; records without labels fall back to the opcode
    labels = record.get("label") or [f"{o}: {record['opcode_names'][o]}" for o in record["opcode"]]
    groups = list(dict.fromkeys(lab.split("[")[0] for lab in labels))
    cmap = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    nsm = max(record["sm"]) + 1
    fig, ax = plt.subplots(figsize=(14, max(4, nsm * 0.06)))
    by_group: dict = {}
    for sm, s, e, lab in zip(record["sm"], record["start_ns"], record["end_ns"], labels):
        by_group.setdefault(groups.index(lab.split("[")[0]), []).append((sm, s / 1e3, max(e - s, 1) / 1e3))
    for g, bars in by_group.items():
        for sm, s, w in bars:
            ax.broken_barh([(s, w)], (sm - 0.4, 0.8), facecolors=cmap(g % cmap.N), linewidth=0)
    ax.set_xlabel("time (us) from the first instruction's start")
    ax.set_ylabel("SM")
    ax.set_ylim(-1, nsm)
    ax.set_title(f"{record.get('case', '')}: {record.get('us', 0):.1f} us per launch (timed without the record)")
    ax.legend(handles=[Patch(color=cmap(i % cmap.N), label=n) for i, n in enumerate(groups)],
              loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def op_table(record: dict) -> str:
    """Per op (instruction label without its tile index), in order of first start: tiles, SMs, first
    start, last end, median / max tile time (us) - where the step's time goes, as numbers. Records
    with the finer stamps (sdk/megakernel/isa.py: wait_ns, begun_ns, chunks_ns) add the median
    wait (waits begun -> met), staging (-> activations staged), chunks (-> chunks consumed) and
    epilogue (-> end, after the signal) of the op's streaming tiles; with signal_ns too, the
    epilogue ends at the signal and `sig` is the signal's release (-> end)."""
    ops: dict = {}
    n = len(record["start_ns"])
    fine = all(record.get(k) for k in ("wait_ns", "begun_ns", "chunks_ns"))
    keys = ["wait_ns", "start_ns", "begun_ns", "chunks_ns"] + (["signal_ns"] if record.get("signal_ns") else [])
    keys.append("end_ns")
    for j in range(n):
        stamps = [record[k][j] for k in keys] if fine else None
        ops.setdefault(record["label"][j].split("[")[0], []).append(
            (record["sm"][j], record["start_ns"][j] / 1e3, record["end_ns"][j] / 1e3, stamps))
    med = lambda v: sorted(v)[len(v) // 2]
    phases = ["wait", "stage", "chunks", "epi", "sig"][:len(keys) - 1]
    head = f"{'op':<20} {'tiles':>5} {'SMs':>4} {'first':>7} {'last':>7} {'median':>7} {'max':>7}"
    lines = [head + ("".join(f" {p:>6}" for p in phases) if fine else "")]
    for name, tiles in sorted(ops.items(), key=lambda kv: min(t[1] for t in kv[1])):
        dur = sorted(e - s for _, s, e, _ in tiles)
        line = (f"{name:<20} {len(tiles):>5} {len({t[0] for t in tiles}):>4} {min(t[1] for t in tiles):>7.1f} "
                f"{max(t[2] for t in tiles):>7.1f} {dur[len(dur) // 2]:>7.2f} {dur[-1]:>7.2f}")
        streamed = [t[3] for t in tiles if fine and None not in t[3]]
        if streamed:
            line += "".join(f" {med([(st[p + 1] - st[p]) / 1e3 for st in streamed]):>6.2f}" for p in range(len(phases)))
        lines.append(line)
    span = max(record["end_ns"]) / 1e3
    busy = sum(e - s for s, e in zip(record["start_ns"], record["end_ns"])) / 1e3
    nsm = len(set(record["sm"]))
    lines.append(f"span {span:.1f} us; SMs busy {busy / (nsm * span):.0%} of it ({nsm} SMs)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record")
    ap.add_argument("-o", "--out", default=None)
    ap.add_argument("--ops", action="store_true", help="also print the per-op table (op_table)")
    a = ap.parse_args(argv)
    with open(a.record) as f:
        rec = json.load(f)
    out = a.out or a.record.rsplit(".", 1)[0] + ".png"
    render(rec, out)
    print(out)
    if a.ops and rec.get("label"):
        print(op_table(rec))


if __name__ == "__main__":
    main()
