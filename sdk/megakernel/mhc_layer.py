"""A whole decoder layer of an mHC model (DeepSeek-V4.1, GLM-5.3) in ONE launch: its two sublayer
programs, each in its mHC site (sdk/megakernel/mhc_site.py), joined where the first's post-mix
hands the second its inputs:

    streams ─ first sublayer's site ─ streams ─ second sublayer's site ─ streams
    part, carried ─┘   coef ─────────────── carried ─┘ (v41)     └─ coef, part_next (the next layer's)
                       part_next ─────────── part ─┘

`join(first, second)` replays both programs' ops into one: the first's buffers under prefix "attn."
(its default), the second's under "mlp.", except the layer's own ends - `streams` (shared, updated
in place by both posts), the first's `part` / `carried` (the layer's inputs), the second's `coef`
/ `part_next` (the layer's outputs) - and the two links, the first's coef -> the second's carried
(`attn.coef`) and the first's part_next -> the second's part (`mlp.part`). Each op keeps its waits;
the second program's first ops (those waiting for nothing: its collapse / coefficients) also wait
for the first's post-mix, the writer of everything they read. The weight ring streams both
sublayers' weights from the launch's start (a ring read never waits), so the second sublayer's
weights are in flight while the first computes.
"""
from __future__ import annotations

from .program import Program

ENDS = ("streams", "part", "carried", "coef", "part_next")


def op_waits(prog: Program) -> list[list[int]]:
    """The ops each op waits for (indices into prog.ops), from its instructions' wait words."""
    by_counter = {op.counter: i for i, op in enumerate(prog.ops)}
    out = []
    for op in prog.ops:
        counters = {c for i in op.instructions for c, _ in prog.instructions[i].waits}
        out.append(sorted(by_counter[c] for c in counters))
    return out


def layer_names(prefixes=("attn.", "mlp.")):
    """(first, second): each maps a sublayer program's buffer name to the layer program's."""
    p1, p2 = prefixes
    ends1 = {"streams": "streams", "part": "part", "carried": "carried", "coef": p1 + "coef", "part_next": p2 + "part"}
    ends2 = {"streams": "streams", "carried": p1 + "coef", "part": p2 + "part", "coef": "coef", "part_next": "part_next"}
    return (lambda n: ends1.get(n, p1 + n)), (lambda n: ends2.get(n, p2 + n))


def join(first: Program, second: Program, prefixes=("attn.", "mlp.")) -> Program:
    """The layer program of two mHC sublayer programs (module docstring)."""
    p1, p2 = prefixes
    name1, name2 = layer_names(prefixes)
    links = {p1 + "coef", p2 + "part"}
    for prog, names, which in ((first, name1, "first"), (second, name2, "second")):
        missing = {"streams", "part", "coef", "part_next"} - set(prog.buffers)
        if missing:
            raise ValueError(f"mhc_layer.join: the {which} program is not in an mHC site (no {sorted(missing)})")
    out = Program()
    for prog, names in ((first, name1), (second, name2)):
        for b in prog.buffers.values():
            name = names(b.name)
            if name in out.buffers:         # streams, the links: one buffer for both sides
                have = out.buffers[name]
                if name != "streams" and name not in links or (have.shape, have.dtype) != (b.shape, b.dtype):
                    raise ValueError(f"mhc_layer.join: buffer {name!r} twice ({have.dtype}{list(have.shape)}, "
                                     f"{b.dtype}{list(b.shape)})")
                continue
            out.buffer(name, b.shape, b.dtype, "scratch" if name in links else b.role)
    post = None
    for prog, names, prefix, after in ((first, name1, p1, False), (second, name2, p2, True)):
        base = len(out.ops)
        waits = op_waits(prog)
        for i, op in enumerate(prog.ops):
            w = [base + j for j in waits[i]]
            if after and not w:
                w = [post]
            bind = {k: names(v) for k, v in op.bindings.items() if v is not None}
            out.op(op.block, bind, waits=w, label=prefix + op.label)
        if post is None:         # the first's post-mix: the op writing its part_next
            post = base + next(i for i, op in enumerate(prog.ops) if op.bindings.get("part_next") == "part_next")
    return out
