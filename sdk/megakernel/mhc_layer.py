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


def site_names(k: int, count: int, prefixes) -> "callable":
    """Maps site k's (of `count` chained) program buffer names to the chained program's: the
    chain's ends keep their names (streams; the first site's part / carried; the last's coef /
    part_next), site k's coef is site k+1's carried and its part_next site k+1's part (under
    their prefixes), everything else is prefixed."""
    p = prefixes[k]
    ends = {"streams": "streams"}
    ends.update({"part": "part", "carried": "carried"} if k == 0 else
                {"part": p + "part", "carried": prefixes[k - 1] + "coef"})
    ends.update({"coef": "coef", "part_next": "part_next"} if k == count - 1 else
                {"coef": p + "coef", "part_next": prefixes[k + 1] + "part"})
    return lambda n: ends.get(n, p + n)


def layer_names(prefixes=("attn.", "mlp.")):
    """(first, second): each maps a sublayer program's buffer name to the layer program's."""
    return site_names(0, 2, prefixes), site_names(1, 2, prefixes)


def join(first: Program, second: Program, prefixes=("attn.", "mlp.")) -> Program:
    """The layer program of two mHC sublayer programs (module docstring)."""
    return chain([first, second], prefixes)[0]


def chain(progs: list, prefixes, prologue: Program | None = None, aliases: dict | None = None,
          out: Program | None = None, replay_ops=None) -> tuple[Program, int]:
    """The program of mHC sublayer programs run one after the other (join's rule, site after
    site), after `prologue`'s ops (its buffers keep their names; the first site's first ops wait
    for its last op). aliases: further links, {a chained name: the earlier buffer it is} (GLM-5.3's
    shared indexer: a layer's `index` is the previous layer's). out: the program to build into
    (a new one by default). replay_ops(out, prog, name, prefix, after) -> the op in `out` of each
    of prog's ops (default: `replay`'s one op each; the tensor-parallel chain turns each post-mix
    into the all-reduce with the post-mix epilogue: sdk/megakernel/tp_model.py). Returns
    (program, the last site's post-mix op)."""
    count = len(progs)
    aliases = aliases or {}
    names = [lambda n, f=site_names(k, count, prefixes): aliases.get(f(n), f(n)) for k in range(count)]
    links = {prefixes[k] + "coef" for k in range(count - 1)} | {prefixes[k] + "part" for k in range(1, count)}
    links |= set(aliases.values())
    for k, prog in enumerate(progs):
        missing = {"streams", "part", "coef"} - set(prog.buffers)
        if missing:
            raise ValueError(f"mhc_layer.chain: program {k} is not in an mHC site (no {sorted(missing)})")
    out = Program() if out is None else out
    replay_ops = replay_ops or replayed_ops
    # the prologue may produce the first site's inputs (streams, part, carried): its definitions stand
    links |= set(prologue.buffers) & {"part", "carried"} if prologue else set()
    for prog, name in ([(prologue, lambda n: n)] if prologue else []) + list(zip(progs, names)):
        for b in prog.buffers.values():
            n = name(b.name)
            if n in out.buffers:            # streams, the links: one buffer for both sides
                have = out.buffers[n]
                if n != "streams" and n not in links or (have.shape, have.dtype) != (b.shape, b.dtype):
                    raise ValueError(f"mhc_layer.chain: buffer {n!r} twice ({have.dtype}{list(have.shape)}, "
                                     f"{b.dtype}{list(b.shape)})")
                continue
            out.buffer(n, b.shape, b.dtype, "scratch" if n in links and prog is not prologue else b.role)
    last = replay(out, prologue, lambda n: n, "", None)[1] if prologue else None
    for prog, name, prefix in zip(progs, names, prefixes):
        ops = replay_ops(out, prog, name, prefix, last)
        # the site's post-mix: the op rewriting the streams, what the next site starts after
        last = ops[next(i for i, op in enumerate(prog.ops) if op.bindings.get("streams_out") == "streams")]
    return out, last


def replayed_ops(out: Program, prog: Program, name, prefix: str, after: int | None) -> list[int]:
    """`replay`, returning the op in `out` of each of prog's ops."""
    base, last = replay(out, prog, name, prefix, after)
    return list(range(base, last + 1))


def replay(out: Program, prog: Program, name, prefix: str, after: int | None) -> tuple[int, int]:
    """prog's ops appended to `out` (bindings renamed, waits kept; ops waiting for nothing wait
    for `after`). Returns (index of its first op in out, of its last)."""
    base = len(out.ops)
    waits = op_waits(prog)
    for i, op in enumerate(prog.ops):
        w = [base + j for j in waits[i]] or ([after] if after is not None else [])
        out.op(op.block, {k: name(v) for k, v in op.bindings.items() if v is not None}, waits=w,
               label=prefix + op.label)
    return base, len(out.ops) - 1
