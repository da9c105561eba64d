"""KDA decode block: the Kimi Delta Attention recurrence of one decode (or verify) step.

Per sequence b, head h, token t (the definition is `sdk/reference/kda.py`; K = V = head_dim):

    [conv=True]  q, k, v = bf16(SiLU(causal depthwise conv_W(qkv))), the rolling conv state
                 [B, 3C, W-1] updated with the committed tokens (C = heads * K, channels q | k | v)
    a     = log decay from the raw gate g (+ dt_bias, A_log):  "softplus": -exp(A_log)*softplus(g+dt)
            "sigmoid": lb*sigmoid(exp(A_log)*(g+dt))  (Kimi K3 / GLM-5.3, lb = -5); "log_decay": a = g
    beta  = sigmoid(beta_raw) in fp32 (`beta_sigmoid=False`: beta given as is)
    q, k  = l2norm(q) * K^-0.5, l2norm(k)                (x / sqrt(sum x^2 + 1e-6), fp32)
    S     = S * exp(a)[:, None];  S += k (beta (v - k^T S));  o = q^T S        (S: [K, V] fp32 math)
    [out_norm=True]  o = RMSNorm(bf16(o)) * norm_w * sigmoid(out_gate)   (the sigma-gated output norm)

Layouts (row-major, static shapes): q, k, g [B, T, H, K]; v, o, out_gate [B, T, H, V]; beta
[B, T, H]; state [B, H, K, V] (fp32, or bf16 storage with fp32 math); dt_bias [H*K] fp32; A_log
[H] fp32; qkv (conv=True, replaces q/k/v) [B, T, 3C] bf16; conv_state [B, 3C, W-1] bf16; conv_w
[3C, W] bf16 or fp32; norm_w [V] bf16.

A tile is one (sequence, head, V-slice): tile = (b * H + h) * v_split + slice. Columns of S are
independent (the decay and the k/q reductions run over K), so a V-slice of S is a complete unit
of work: every tile re-derives q, k, a, beta of its head (a few hundred bytes from L2) and
streams its K x V/v_split slice of the state. Thread mapping (8 warps): warp w owns V/(8 v_split)
columns; inside a warp LV lanes cover the columns (4 adjacent columns each: one 16-byte fp32 or
8-byte bf16 vector) and LK = 32/LV lanes cover K (RK = K/LK consecutive rows each). The state
slice lives in registers (K*V/(256 v_split) fp32 per thread) for all T tokens; every reduction
over K is a warp butterfly shuffle (no shared memory), the output norm's sum over V is one
8-float exchange through `scratch`.

T tokens per sequence run one after the other in the tile, the state staying in registers.
What is written back is `commit`:
    "all"        state (and conv state) after all T tokens, in place - plain decode (T = 1) or
                 a multi-token chunk that is known to be kept;
    "none"       nothing: outputs only (speculative verify, pass 1);
    "accepted"   only the first n_accepted[b] tokens are run (their outputs written, later ones
                 untouched) and the state after them is written in place - the commit pass after a
                 verify: re-running the accepted tokens costs one state read + write, whatever T;
    "per_token"  the state after every token goes to states_out [B, T, H, K, V], `state` is not
                 written; committing token j is then a copy (or a pool index swap) of states_out
                 [b, j-1]. Costs T state writes: use it when a re-run is not possible. The conv
                 state is not written either: after j tokens it is the last W-1 columns of
                 cat(conv_state, qkv[:, :j]), which the host can take from the inputs.
See docs/kda.md for the comparison of the two speculative designs.

Fused: gate math (dt_bias, A_log, gate kind), beta sigmoid, l2norm + scale, the short conv with
its rolling state (conv=True), the sigma-gated output RMSNorm (out_norm=True). Both fusions need
the whole head in one tile (v_split=1): the conv state is shared by the head's tiles and the norm
reduces over all of V. Not fused (they are GEMVs the megakernel has): the q/k/v/g/beta/gate
projections and o_proj. Not supported: the serving state pool ([slot, H, V, K] with slot
indices: the state is indexed by batch row here), head_dim other than a multiple of 32 with
V-slices of 32..128 columns, chunked prefill (T <= 16 tokens, token by token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..reference.kda import kda_log_decay, kda_recurrence
from ..spec import KDASpec
from .base import NUM_THREADS, Block, Cost, OperandSpec

COMMITS = ("all", "none", "accepted", "per_token")
GATES = ("softplus", "sigmoid", "log_decay")
MAX_TOKENS = 16
AUTO_K_WARPS_TILES = 512                 # KDABlock.nwk: 4 warps across K from this many tiles
NUM_WARPS = NUM_THREADS // 32


@dataclass(frozen=True)
class KDAConfig:
    batch: int = 1
    heads: int = 12
    head_dim: int = 128                  # K = V
    tokens: int = 1                      # T per sequence (1 = decode, > 1 = speculative verify)
    v_split: int = 1                     # tiles per head (V-slices of head_dim / v_split columns)
    state_dtype: str = "fp32"            # "fp32" | "bf16" (storage; math is fp32)
    gate_kind: str = "sigmoid"           # "softplus" | "sigmoid" | "log_decay"
    gate_lower_bound: float = -5.0
    g_dtype: str = "bf16"                # raw gate g (the f_b projection output); fp32 for log_decay
    beta_sigmoid: bool = True
    commit: str = "all"                  # see COMMITS
    conv: bool = False                   # fuse the short conv (+ SiLU) and its rolling state
    conv_kernel: int = 4
    conv_w_dtype: str = "bf16"           # "bf16" | "fp32" (glm5_next keeps the conv weight fp32)
    out_norm: bool = False               # fuse the sigma-gated RMSNorm of the output
    norm_eps: float = 1e-6
    out_dtype: str = "bf16"              # "bf16" | "fp32"
    conv_staged: bool = True             # conv=True: the head's 3K conv outputs per token computed
                                         # once per tile into shared memory (one thread per channel)
                                         # instead of by every lane that reads them (32x for q, k):
                                         # K3 TP8 batch 64 fused step 43.3% of copy vs 25.5% (H200);
                                         # without conv it has nothing to stage
    stream: bool = False                 # the streaming form: tile = (sequence, heads_per_tile
                                         # heads), its V-slices the chunks of the megakernel's smem
                                         # ring (the state loaded ahead like GEMV weights); no conv /
                                         # out_norm fusion
    beta_width: int = 0                  # row width of the beta operand [B, T, beta_width] (its first
                                         # `heads` values are read); 0 = heads. A projection GEMV's
                                         # rows come in multiples of 8: Kimi K3 TP8's 12 heads pad to 16
    heads_per_tile: int = 1              # stream=True: heads of one tile, their inputs staged by one
                                         # `begin` - whose loads queue behind the ring's copies
                                         # in flight, a wait paid once per tile (docs/kda.md)
    k_warps: int = 0                     # warps across K (1: each warp holds all K rows of its
                                         # columns, K sums are warp shuffles; 2 / 4 / 8: more lanes
                                         # across V - longer contiguous row segments per load -
                                         # and the K sums finish through shared memory); 0 = auto
                                         # (KDABlock.nwk)


class KDABlock(Block):
    name = "kda"
    Config = KDAConfig

    # -- static facts --------------------------------------------------------------------------
    @property
    def vs(self) -> int:
        """Columns of S per tile."""
        return self.config.head_dim // self.config.v_split

    @property
    def beta_width(self) -> int:
        return self.config.beta_width or self.config.heads

    @property
    def nwk(self) -> int:
        """Warps across K: `k_warps`, or (0) when there are at least AUTO_K_WARPS_TILES tiles
        (state streaming over several waves of CTAs) 8 for 32-column tiles, 4 for 64-column ones,
        else 1. Measured on the H200 (core step, fp32 state, batch 64): Kimi K3 TP8 v_split=2
        72.2% -> 78.6% of the copy bandwidth with 4 (78.1% with 8), v_split=4 43.7% -> 80.4%
        (80.1% with 8); GLM-5.3 TP8 67.3% -> 73.9% / 41.6% -> 75.7%. Since the decode tile issues
        its inputs before the state (2026-12-04), 8 at v_split=4: K3 87.8% vs 85.6% with 4, GLM-5.3
        83.9% vs 82.3% (with 8 a warp loads 4 rows x 128 bytes). Nsight Compute had the 1-warp mapping
        L2-throughput bound (80%) at 51% DRAM, its warps loading 32-byte pieces of 16 rows; with 4
        warps across K, 128-byte pieces of 4 rows. Not below: batch 8 (192 / 128 tiles, one
        wave, latency-bound) 6.2 -> 6.5 us, and whole-head tiles (v_split=1) lost with 2 (68.4% ->
        65.2%)."""
        c = self.config
        if c.k_warps:
            return c.k_warps
        if self.vs > 64 or c.batch * c.heads * c.v_split < AUTO_K_WARPS_TILES:
            return 1
        return 8 if self.vs == 32 and not c.stream else 4      # (the streaming form measured with 4)

    @property
    def lanes(self) -> tuple[int, int, int]:
        """(LV lanes across columns, LK lanes across K, RK rows per lane) inside a warp; the warps
        are NUM_WARPS / k_warps across the columns times k_warps across K."""
        lv = max(1, self.vs // (4 * (NUM_WARPS // self.nwk)))
        lk = max(1, 32 // lv)
        return lv, lk, max(1, self.config.head_dim // (lk * self.nwk))

    def check(self):
        c = self.config
        u = self.unsupported
        if c.state_dtype not in ("fp32", "bf16"):
            u(f"kda: state dtype {c.state_dtype!r} (supported: fp32, bf16)")
        if c.gate_kind not in GATES:
            u(f"kda: gate kind {c.gate_kind!r} (supported: {GATES})")
        if c.commit not in COMMITS:
            u(f"kda: commit {c.commit!r} (supported: {COMMITS})")
        if c.g_dtype not in ("bf16", "fp32") or c.conv_w_dtype not in ("bf16", "fp32") \
                or c.out_dtype not in ("bf16", "fp32"):
            u("kda: g_dtype, conv_w_dtype and out_dtype must be bf16 or fp32")
        if not 1 <= c.tokens <= MAX_TOKENS:
            u(f"kda: tokens={c.tokens} (supported: 1..{MAX_TOKENS})")
        if c.head_dim % c.v_split:
            u(f"kda: head_dim={c.head_dim} not divisible by v_split={c.v_split}")
        vs = c.head_dim // c.v_split
        if vs not in (32, 64, 128):
            u(f"kda: {vs} columns per tile (head_dim / v_split must be 32, 64 or 128: 8 warps x "
              f"LV lanes x 4 columns with at most 64 state values per thread)")
        nwk = self.nwk
        if nwk not in (1, 2, 4, 8):
            u(f"kda: k_warps={c.k_warps} (supported: 0 = auto, 1, 2, 4, 8)")
        elif vs % (4 * (NUM_WARPS // nwk)) or vs // (4 * (NUM_WARPS // nwk)) > 32:
            u(f"kda: {vs} columns per tile do not spread over {NUM_WARPS // nwk} warps x 4-column lanes "
              f"(k_warps={nwk})")
        else:
            lv, lk, rk = self.lanes
            if c.head_dim != lk * rk * nwk or rk * 4 > 64:
                u(f"kda: head_dim={c.head_dim} does not split over {nwk} warps x {lk} lanes across K "
                  f"with at most 64 state values per thread")
        if (c.conv or c.out_norm) and c.v_split != 1:
            u("kda: conv / out_norm fusion needs the whole head in one tile (v_split=1): the conv "
              "state is shared by the head's tiles and the norm reduces over all of V")
        if c.stream and (c.conv or c.out_norm):
            u("kda: the streaming form (stream=True) fuses neither the conv nor the output norm")
        if c.heads_per_tile < 1 or c.heads % c.heads_per_tile or (c.heads_per_tile > 1 and not c.stream):
            u(f"kda: heads_per_tile={c.heads_per_tile} (a divisor of heads={c.heads}; > 1 only with stream=True)")
        if c.beta_width and c.beta_width < c.heads:
            u(f"kda: beta_width={c.beta_width} < heads={c.heads}")
        if c.stream and c.head_dim % 32:
            u(f"kda: stream=True needs head_dim a multiple of 32 (one warp per token stages q, k), got {c.head_dim}")
        if c.conv and c.conv_kernel < 2:
            u(f"kda: conv_kernel={c.conv_kernel} (supported: >= 2)")
        if not 1 <= c.batch:
            u(f"kda: batch={c.batch}")

    def operand_specs(self):
        c = self.config
        B, T, H, K = c.batch, c.tokens, c.heads, c.head_dim
        C = H * K
        specs = []
        if c.conv:
            specs += [OperandSpec("qkv", (B, T, 3 * C), "bf16"),
                      OperandSpec("conv_state", (B, 3 * C, c.conv_kernel - 1), "bf16",
                                  output=c.commit in ("all", "accepted")),
                      OperandSpec("conv_w", (3 * C, c.conv_kernel), c.conv_w_dtype)]
        else:
            specs += [OperandSpec(n, (B, T, H, K), "bf16") for n in ("q", "k", "v")]
        g_dtype = "fp32" if c.gate_kind == "log_decay" else c.g_dtype
        specs.append(OperandSpec("g", (B, T, H, K), g_dtype))
        if c.gate_kind != "log_decay":
            specs += [OperandSpec("dt_bias", (C,), "fp32"), OperandSpec("a_log", (H,), "fp32")]
        specs.append(OperandSpec("beta", (B, T, self.beta_width), "bf16"))
        specs.append(OperandSpec("state", (B, H, K, K), c.state_dtype, output=c.commit in ("all", "accepted")))
        if c.commit == "accepted":
            specs.append(OperandSpec("n_accepted", (B,), "int32"))
        if c.commit == "per_token":
            specs.append(OperandSpec("states_out", (B, T, H, K, K), c.state_dtype, output=True))
        if c.out_norm:
            specs += [OperandSpec("out_gate", (B, T, H, K), "bf16"), OperandSpec("norm_w", (K,), "bf16")]
        specs.append(OperandSpec("o", (B, T, H, K), c.out_dtype, output=True))
        return specs

    def num_tiles(self) -> int:
        c = self.config
        return c.batch * c.heads // c.heads_per_tile if c.stream else c.batch * c.heads * c.v_split

    def own_smem_bytes(self) -> int:
        c = self.config
        if c.stream:
            return 0                    # everything lives in the ring's activation area (x_smem_bytes)
        conv = c.tokens * 3 * c.head_dim * 4 if c.conv_staged and c.conv else 0
        return conv + self.k_exchange_words() * 4

    # -- the streaming form (stream=True; kda_device.build_kda_stream) --------------------------
    def stream_chunks(self) -> int:
        c = self.config
        return c.v_split * c.heads_per_tile if c.stream else 0

    def chunk_bytes(self) -> int:
        c = self.config
        return c.head_dim * self.vs * (4 if c.state_dtype == "fp32" else 2) if c.stream else 0

    def streamed_operands(self) -> tuple[str, ...]:
        return ("state",) if self.config.stream else ()

    def stream_sx_exchange_offset(self) -> int:
        """fp32 word offset of the cross-warp K sums in `sx`, after the tile's staged q, k, decay,
        v [T, heads_per_tile, 4, K] and beta [T, heads_per_tile] (16-byte aligned)."""
        c = self.config
        n = c.tokens * c.heads_per_tile
        return -(-(n * 4 * c.head_dim + n) // 4) * 4

    def x_smem_bytes(self) -> int:
        if not self.config.stream:
            return 0
        return 4 * (self.stream_sx_exchange_offset() + max(4, self.k_exchange_words()))

    def k_exchange_words(self) -> int:
        """fp32 words of shared memory for the cross-warp K sums (k_warps > 1): two column-sum
        exchanges [k_warps, V-slice] (k^T S, then q^T S) and the q / k squared norms [k_warps, 2]."""
        return 0 if self.nwk == 1 else self.nwk * (2 * self.vs + 2)

    def state_bytes(self) -> int:
        """State bytes one step must move (read + write) for the whole op: the block's floor."""
        c = self.config
        sb = 4 if c.state_dtype == "fp32" else 2
        one = c.batch * c.heads * c.head_dim * c.head_dim * sb
        writes = {"all": 1, "accepted": 1, "none": 0, "per_token": c.tokens}[c.commit]
        return one * (1 + writes)

    def cost(self) -> Cost:
        c = self.config
        K, T = c.head_dim, c.tokens
        vs = c.head_dim if c.stream else self.vs      # a streaming tile: whole heads (heads_per_tile)
        nh = c.heads_per_tile if c.stream else 1
        sb = 4 if c.state_dtype == "fp32" else 2
        writes = {"all": 1, "accepted": 1, "none": 0, "per_token": T}[c.commit]
        b = K * vs * sb * (1 + writes)
        gb = 4 if (c.g_dtype == "fp32" or c.gate_kind == "log_decay") else 2
        ob = 4 if c.out_dtype == "fp32" else 2
        b += T * (2 * K * 2 + K * gb + vs * 2 + 2 + vs * ob)     # q, k, g, v, beta, o
        if c.conv:
            b += 3 * K * (c.conv_kernel - 1) * 2 * 2 + 3 * K * c.conv_kernel * 4
        if c.out_norm:
            b += T * vs * 2 + vs * 2
        return Cost(bytes=nh * b, flops=nh * T * K * vs * 10)

    def _kspec(self) -> KDASpec:
        c = self.config
        return KDASpec(num_heads=c.heads, head_dim=c.head_dim, gate_kind=c.gate_kind,
                       gate_lower_bound=c.gate_lower_bound, conv_kernel=c.conv_kernel)

    def random_operands(self, seed: int = 0, device="cpu", n_accepted=None) -> dict[str, torch.Tensor]:
        """Fresh random operands for tests and benchmarks; outputs poisoned with NaN. Gates like a
        trained model's: A_log = log(U(1, 16)) (kimi_linear's init), dt_bias small, so decays
        spread over (0, 1). n_accepted: per-sequence counts (default random in 0..T)."""
        from .base import DTYPES
        c = self.config
        g = torch.Generator().manual_seed(seed)
        t = {}
        for s in self.operand_specs():
            dt = DTYPES[s.dtype]
            if s.name == "n_accepted":
                x = (torch.randint(0, c.tokens + 1, s.shape, generator=g, dtype=torch.int32)
                     if n_accepted is None else torch.tensor(n_accepted, dtype=torch.int32))
            elif s.name in ("o", "states_out"):
                x = torch.full(s.shape, float("nan"), dtype=dt)
            elif s.name == "a_log":
                x = torch.empty(s.shape).uniform_(1, 16, generator=g).log()
            elif s.name == "dt_bias":
                x = 0.5 * torch.randn(s.shape, generator=g)
            elif s.name == "g" and c.gate_kind == "log_decay":
                x = F.logsigmoid(torch.randn(s.shape, generator=g) + 2)
            elif s.name == "state":
                x = (0.3 * torch.randn(s.shape, generator=g)).to(dt)
            elif s.name == "norm_w":
                x = (1 + 0.1 * torch.randn(s.shape, generator=g)).to(dt)
            elif s.name == "conv_w":
                x = (0.5 * torch.randn(s.shape, generator=g)).to(dt)
            else:
                x = torch.randn(s.shape, generator=g).to(dt)
            t[s.name] = x.to(device)
        return t

    # -- torch faces ---------------------------------------------------------------------------
    def _conv(self, qkv, conv_state, conv_w):
        """act(causal depthwise conv) of qkv [B, T, ch] with the state [B, ch, W-1] (as
        `KDAReference.short_conv`: the conv runs in the weight's dtype, the result is bf16).
        Returns (out [B, T, ch] bf16, the full window [B, ch, W-1+T])."""
        full = torch.cat([conv_state.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)
        t = qkv.shape[1]
        out = F.conv1d(full.to(conv_w.dtype), conv_w[:, None, :], groups=conv_w.shape[0])[..., -t:]
        return F.silu(out).to(torch.bfloat16).transpose(1, 2), full

    def _inputs(self, t, b_sl, heads, cols):
        """q, k [nb, T, nh, K], v [nb, T, nh, cols], log decay, beta for batch rows b_sl, heads
        `heads` (a slice), V columns `cols` (a slice); also the conv window (or None)."""
        c = self.config
        K, H, C = c.head_dim, c.heads, c.heads * c.head_dim
        full = None
        if c.conv:
            qkv, cs, w = t["qkv"][b_sl], t["conv_state"][b_sl], t["conv_w"]
            h0, h1 = heads.start, heads.stop
            chans = torch.cat([torch.arange(h0 * K, h1 * K), torch.arange(C + h0 * K, C + h1 * K),
                               torch.arange(2 * C + h0 * K, 2 * C + h1 * K)]).to(qkv.device)
            out, full = self._conv(qkv[..., chans], cs[:, chans], w[chans])
            nb, T, nh = out.shape[0], out.shape[1], h1 - h0
            q, k, v = (x.reshape(nb, T, nh, K) for x in out.chunk(3, dim=-1))
            v = v[..., cols]
        else:
            q, k, v = t["q"][b_sl, :, heads], t["k"][b_sl, :, heads], t["v"][b_sl, :, heads, cols]
        g = t["g"][b_sl, :, heads].float()
        if c.gate_kind == "log_decay":
            a = g
        else:
            dt = t["dt_bias"].float().view(H, K)[heads]
            a = kda_log_decay(self._kspec(), g + dt, t["a_log"].float()[heads])
        beta = t["beta"][b_sl, :, heads].float()
        if c.beta_sigmoid:
            beta = torch.sigmoid(beta)
        return q, k, v, a, beta, full

    def _norm(self, t, o, b_sl, heads):
        c = self.config
        h = o.to(torch.bfloat16).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.norm_eps) * t["norm_w"].float()
        return h * torch.sigmoid(t["out_gate"][b_sl, :o.shape[1], heads].float())

    def _run(self, t, b_sl, heads, cols, state_view):
        """Process batch rows b_sl (one row: `accepted` counts are per row) of heads/cols; state_view
        is the fp32 [nb, nh, K, cols] state to update. Returns (o, per-token states or None, n, window)."""
        c = self.config
        q, k, v, a, beta, full = self._inputs(t, b_sl, heads, cols)
        n = c.tokens
        if c.commit == "accepted":
            n = max(0, min(int(t["n_accepted"][b_sl][0]), c.tokens))
        s = state_view.clone()
        if c.commit == "per_token":
            os_, sts = [], []
            for j in range(n):
                os_.append(kda_recurrence(q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1], a[:, j:j + 1],
                                          beta[:, j:j + 1], s))
                sts.append(s.clone())
            return torch.cat(os_, 1), torch.stack(sts, 1), n, full
        if n == 0:                      # nothing accepted: no output, the state stays
            return v.new_zeros((v.shape[0], 0) + tuple(v.shape[2:]), dtype=torch.float32), s, 0, full
        o = kda_recurrence(q[:, :n], k[:, :n], v[:, :n], a[:, :n], beta[:, :n], s)
        return o, s, n, full

    def _store(self, t, b_sl, heads, cols, o, s, n, full, out):
        """Write the results of `_run` into the tensors `out` (operand dtypes)."""
        c = self.config
        if c.out_norm:
            o = self._norm(t, o, b_sl, heads)
        out["o"][b_sl, :n, heads, cols] = o.to(out["o"].dtype)
        if c.commit == "per_token":
            out["states_out"][b_sl, :, heads, :, cols] = s.to(out["states_out"].dtype)
        elif c.commit in ("all", "accepted") and n > 0:
            out["state"][b_sl, heads, :, cols] = s.to(out["state"].dtype)
            if c.conv:
                K, C, W1 = c.head_dim, c.heads * c.head_dim, c.conv_kernel - 1
                h0, h1 = heads.start, heads.stop
                new = full[..., n:n + W1]
                for r in range(3):
                    out["conv_state"][b_sl, r * C + h0 * K:r * C + h1 * K] = \
                        new[:, r * (h1 - h0) * K:(r + 1) * (h1 - h0) * K].to(out["conv_state"].dtype)

    def reference(self, **t) -> dict[str, torch.Tensor]:
        """The whole op in fp32 (state returned in fp32; outputs of tokens not run stay NaN)."""
        c = self.config
        B, T, H, K = c.batch, c.tokens, c.heads, c.head_dim
        dev = t["state"].device
        out = {"o": torch.full((B, T, H, K), float("nan"), device=dev)}
        if c.commit == "per_token":
            out["states_out"] = torch.full((B, T, H, K, K), float("nan"), device=dev)
        else:
            out["state"] = t["state"].float().clone()
        if c.conv:
            out["conv_state"] = t["conv_state"].clone()
        allh, allv = slice(0, H), slice(0, K)
        rows = [slice(b, b + 1) for b in range(B)] if c.commit == "accepted" else [slice(0, B)]
        for b_sl in rows:
            o, s, n, full = self._run(t, b_sl, allh, allv, t["state"][b_sl].float())
            self._store(t, b_sl, allh, allv, o, s, n, full, out)
        return out

    def emulate_tile(self, t: dict[str, torch.Tensor], tile: int) -> None:
        c = self.config
        if c.stream:                    # tile = (b, group of heads), every slice
            hpt = c.heads_per_tile
            (b, g), cols = divmod(tile, c.heads // hpt), slice(0, c.head_dim)
            heads = slice(g * hpt, (g + 1) * hpt)
        else:
            b, rest = divmod(tile, c.heads * c.v_split)
            h, sl = divmod(rest, c.v_split)
            cols = slice(sl * self.vs, (sl + 1) * self.vs)
            heads = slice(h, h + 1)
        b_sl = slice(b, b + 1)
        o, s, n, full = self._run(t, b_sl, heads, cols, t["state"][b_sl, heads, :, cols].float())
        self._store(t, b_sl, heads, cols, o, s, n, full, t)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        from .kda_device import build_kda_tile
        return build_kda_tile(self)

    def _build_device_stream(self):
        from .kda_device import build_kda_stream
        return build_kda_stream(self)
