"""Token choice on the device: argmax (a two-stage Triton reduction) and sampling, so that a decode
loop reads back token ids, never logits.

Sampling follows the host sampler's chain (edgellm.sampling: top-k -> top-p -> min-p ->
temperature -> draw), each row with its own parameters, in two parts:
- `cuts`: each row's candidate set is the logits at or above a value, the cut. Top-k, top-p and
  min-p all keep a best-first prefix of the ranked logits, so one value describes the three
  together (ties at the cut are all kept). Found with torch ops: the row maximum for min-p alone,
  a top-k for rows whose top-k bounds the prefix, a sort of the row for top-p without top-k.
- `sample`: a Gumbel-max draw, argmax over the kept logits of x / T + G with G = -log(-log(U)),
  which picks token i with probability softmax(x / T)_i over the kept set; U from Philox keyed by
  the row's seed, its counter the row's position times the vocabulary plus the token id, so a
  seeded sequence draws the same tokens on every run. One pass over the logits, as argmax; rows
  with temperature 0 take the argmax in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from ....sampling import ranked_need  # noqa: F401 - the kernels' host-side helper, torch-free
from ._common import check_2d, jit, next_pow2, pdl, pdl_prologue


@jit
def _argmax_partial_kernel(x_ptr, stride_x, pv_ptr, pi_ptr, V, N_PART, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    c = part * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + c, mask=c < V, other=float("-inf")).to(tl.float32)
    mx = tl.max(v, axis=0)
    idx = tl.min(tl.where(v == mx, c, V), axis=0)  # first index of the maximum, as torch.argmax
    tl.store(pv_ptr + row * N_PART + part, mx)
    tl.store(pi_ptr + row * N_PART + part, idx)


@jit
def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, V, N_PART, tok_ptr, start_ptr, seq_ptr, PART_PAD: tl.constexpr,
                         STEP: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    p = tl.arange(0, PART_PAD)
    pm = p < N_PART
    v = tl.load(pv_ptr + row * N_PART + p, mask=pm, other=float("-inf"))
    i = tl.load(pi_ptr + row * N_PART + p, mask=pm, other=V)
    mx = tl.max(v, axis=0)
    best = tl.min(tl.where(v == mx, i, V), axis=0)
    best = tl.where(best >= V, 0, best)  # all -inf (or NaN): 0
    tl.store(out_ptr + row, best.to(out_ptr.dtype.element_ty))
    if STEP:  # the next decode step's inputs: this token, its position, the cache length
        tl.store(tok_ptr, best.to(tok_ptr.dtype.element_ty))
        tl.store(start_ptr, tl.load(start_ptr) + 1)
        tl.store(seq_ptr, tl.load(seq_ptr) + 1)


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None,
           step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Index of the largest logit of each row: logits [T, V] -> int64 [T] (or out's int dtype).

    step = (tokens, start, seq_len), one-element int tensors of a greedy decode loop on the device:
    the kernel also stores the token into tokens[0] and adds one to start and seq_len (one row only),
    which saves a greedy step three launches."""
    check_2d(logits, "logits")
    return _choose_rows(logits, out, config, step, "argmax",
                        lambda grid, pv, pi, V, n_part, block, warps: _argmax_partial_kernel[grid](
                            logits, logits.stride(0), pv, pi, V, n_part, BLOCK=block, num_warps=warps, **pdl()))


def _check_per_row(what: str, logits: torch.Tensor, tensors) -> None:
    """Each (name, tensor, dtypes) must hold one element per row of logits, on its device."""
    T = logits.shape[0]
    for name, t, kinds in tensors:
        if t.dtype not in kinds or t.shape != (T,) or t.device != logits.device:
            raise ValueError(f"{what}: {name} must be a {'/'.join(map(str, kinds))} tensor of shape ({T},) "
                             f"on {logits.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _choose_rows(logits: torch.Tensor, out, config, step, what: str, partial) -> torch.Tensor:
    """The two-stage launch argmax and sample share: `partial` writes each (row, block of the
    vocabulary)'s best score and its index, the final kernel keeps each row's first best (and,
    with step, the device loop's next inputs)."""
    T, V = logits.shape
    if step is not None:
        if T != 1 or any(t.dtype not in (torch.int32, torch.int64) or t.numel() < 1 for t in step):
            raise ValueError(f"{what} step takes one row of logits and three int32/int64 tensors "
                             "(tokens, start, seq_len)")
    if out is None:
        out = torch.empty((T,), dtype=torch.int64, device=logits.device)
    elif out.shape != (T,) or out.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} out must be int32/int64 of shape ({T},), got {out.dtype} {tuple(out.shape)}")
    if T == 0:
        return out
    cfg = {**configs.ARGMAX_DEFAULT, **(config or {})}
    block = min(cfg["BLOCK"], next_pow2(V))
    n_part = triton.cdiv(V, block)
    pv = torch.empty((T, n_part), dtype=torch.float32, device=logits.device)
    pi = torch.empty((T, n_part), dtype=torch.int32, device=logits.device)
    partial((T, n_part), pv, pi, V, n_part, block, cfg["num_warps"])
    tok, start, seq = step if step is not None else (out, out, out)
    _argmax_final_kernel[(T,)](pv, pi, out, V, n_part, tok, start, seq, PART_PAD=next_pow2(n_part),
                               STEP=step is not None, num_warps=1, **pdl())
    return out


@jit
def _sample_partial_kernel(x_ptr, stride_x, pv_ptr, pi_ptr, V, N_PART, temp_ptr, cut_ptr, seed_ptr, pos_ptr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    c = part * BLOCK + tl.arange(0, BLOCK)
    inside = c < V
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + c, mask=inside, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + row)
    keep = inside & (v >= tl.load(cut_ptr + row))  # NaN fails the comparison: never drawn
    if t > 0:
        seed = tl.load(seed_ptr + row)
        counter = tl.load(pos_ptr + row).to(tl.int64) * V + c  # 64-bit Philox counter: distinct per step and token
        u = tl.rand(seed, counter)
        score = v / t - tl.log(-tl.log(u))  # u == 0 gives -inf: that token is not drawn
    else:
        score = v
    score = tl.where(keep, score, float("-inf"))
    mx = tl.max(score, axis=0)
    idx = tl.min(tl.where(score == mx, c, V), axis=0)
    tl.store(pv_ptr + row * N_PART + part, mx)
    tl.store(pi_ptr + row * N_PART + part, idx)


def sample(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, seed: torch.Tensor,
           pos: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None,
           step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row of logits [T, V] -> int64 [T] (or out's int dtype), drawn on the device.

    Per row, device tensors of T elements: temperature (float32; <= 0: the argmax, as `argmax`),
    cut (float32: only logits >= cut are drawn, see `cuts`; -inf keeps all), seed (int64: the
    Philox key) and pos (int32/int64: the row's position, the counter that makes each step's draw
    new). step: as for `argmax` (one row; the device loop's next inputs, pos may be its start)."""
    check_2d(logits, "logits")
    T, V = logits.shape
    _check_per_row("sample", logits, (("temperature", temperature, (torch.float32,)), ("cut", cut, (torch.float32,)),
                                      ("seed", seed, (torch.int64,)), ("pos", pos, (torch.int32, torch.int64))))
    return _choose_rows(logits, out, config, step, "sample",
                        lambda grid, pv, pi, V, n_part, block, warps: _sample_partial_kernel[grid](
                            logits, logits.stride(0), pv, pi, V, n_part, temperature, cut, seed, pos,
                            BLOCK=block, num_warps=warps, **pdl()))


FULL_SORT_FROM = 4096  # a ranked prefix longer than this is taken from a sort of the row, not a top-k


@jit
def _cut_kernel(x_ptr, stride_x, vals_ptr, stride_v, cut_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, NEED,
                BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row's cut: vals holds the row's NEED largest logits, best first (none when NEED is 0)."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    xrow = x_ptr + row.to(tl.int64) * stride_x
    vrow = vals_ptr + row.to(tl.int64) * stride_v
    r0 = tl.arange(0, BLOCK)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    mp = tl.load(min_p_ptr + row)
    by_rank = (k > 0) & (k < V)
    if NEED > 0:
        best = tl.load(vrow).to(tl.float32)
    else:  # min-p alone: the row's maximum
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            c = start + r0
            top = tl.maximum(top, tl.load(xrow + c, mask=c < V, other=float("-inf")).to(tl.float32))
        best = tl.max(top, axis=0)
    cut = tl.where(mp > 0, best + tl.log(tl.maximum(mp, 1e-30)), float("-inf"))
    if (NEED > 0) & (by_rank | (p < 1.0)):
        limit = tl.where(by_rank, k, V)  # ranked_need made NEED cover it
        # the mass top-p is measured against: the top-k's, or the whole row's without top-k
        acc = tl.zeros([BLOCK], tl.float32)
        if by_rank:
            for start in range(0, NEED, BLOCK):
                r = start + r0
                v = tl.load(vrow + r, mask=(r < limit) & (r < NEED), other=float("-inf")).to(tl.float32)
                acc += tl.exp(v - best)
        else:
            for start in range(0, V, BLOCK):
                c = start + r0
                acc += tl.exp(tl.load(xrow + c, mask=c < V, other=float("-inf")).to(tl.float32) - best)
        mass = tl.sum(acc, axis=0)
        # the ranked tokens whose mass ranked ahead of them is below top-p (the best one always)
        ahead = mass * 0.0
        n = 0
        for start in range(0, NEED, BLOCK):
            r = start + r0
            inside = (r < limit) & (r < NEED)
            e = tl.where(inside, tl.exp(tl.load(vrow + r, mask=inside, other=0.0).to(tl.float32) - best) / mass, 0.0)
            before = tl.cumsum(e, axis=0) - e + ahead
            n += tl.sum((inside & (before < p)).to(tl.int32), axis=0)
            ahead += tl.sum(e, axis=0)
        n = tl.maximum(n, 1)
        cut = tl.maximum(cut, tl.load(vrow + n - 1).to(tl.float32))
    tl.store(cut_ptr + row, cut)


@jit
def _key(x):
    """float32 -> int64 key in [0, 2^32) whose order is the floats' order."""
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(u >= 0x80000000, (~u) & 0xFFFFFFFF, u | 0x80000000)


@jit
def _value(k):
    u = tl.where(k >= 0x80000000, k & 0x7FFFFFFF, (~k) & 0xFFFFFFFF)
    return u.to(tl.int32).to(tl.float32, bitcast=True)


@jit
def _last_of_row(cnt_ptr, row, P):
    """True in the row's last program to get here (its partial results all stored): it combines them."""
    return tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel") == P - 1


@jit
def _rounds_stats_kernel(x_ptr, stride_x, V, CHUNK, part_ptr, cnt_ptr, si_ptr, sf_ptr, P,
                         BLOCK: tl.constexpr, P_PAD: tl.constexpr, PDL: tl.constexpr):
    """The row's largest and smallest logits and its mass relative to the largest (state), over P
    programs a row; each round of `_round_kernel` then starts from the whole row."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    pid = tl.program_id(1)
    xrow = x_ptr + row.to(tl.int64) * stride_x
    r0 = tl.arange(0, BLOCK)
    end = tl.minimum(V, (pid + 1) * CHUNK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(pid * CHUNK, end, BLOCK):
        c = start + r0
        v = tl.load(xrow + c, mask=c < end, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.where(c < end, v, float("-inf")))
        low = tl.minimum(low, tl.where(c < end, v, float("inf")))
    m = tl.max(top, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * CHUNK, end, BLOCK):
        c = start + r0
        acc += tl.exp(tl.load(xrow + c, mask=c < end, other=float("-inf")).to(tl.float32) - m)
    part = part_ptr + (row * P + pid) * 16
    tl.store(part, m)
    tl.store(part + 1, tl.sum(acc, axis=0))
    tl.store(part + 2, tl.min(low, axis=0))
    if _last_of_row(cnt_ptr, row, P):
        q = tl.arange(0, P_PAD)
        base = part_ptr + (row * P + q) * 16
        ms = tl.load(base, mask=q < P, other=float("-inf"))
        best = tl.max(ms, axis=0)
        mass = tl.sum(tl.load(base + 1, mask=q < P, other=0.0) * tl.exp(ms - best), axis=0)
        least = tl.min(tl.load(base + 2, mask=q < P, other=float("inf")), axis=0)
        tl.store(sf_ptr + row * 2, best)
        tl.store(sf_ptr + row * 2 + 1, mass)
        kb = _key(best)
        kl = _key(least)
        tl.store(si_ptr + row * 4, kb)
        tl.store(si_ptr + row * 4 + 1, kl)  # lo, hi: the range a round splits
        tl.store(si_ptr + row * 4 + 2, kb + 1)
        tl.store(si_ptr + row * 4 + 3, kl)  # the top-k's cut (every logit without top-k)
        tl.store(cnt_ptr + row, 0)


@jit
def _round_kernel(x_ptr, stride_x, V, CHUNK, part_ptr, cnt_ptr, si_ptr, sf_ptr, top_k_ptr, top_p_ptr, P,
                  MODE: tl.constexpr, BLOCK: tl.constexpr, P_PAD: tl.constexpr, PDL: tl.constexpr):
    """One round of a cut's search on the logits' keys, over P programs a row: the range [lo, hi)
    is split 16 ways and the sixteenth holding the cut kept. MODE 0, top-k: the cut is the largest
    key with at least k logits at or above it. MODE 1, top-p: the largest key whose mass at or
    above it (among the logits the top-k keeps) reaches top_p of their mass (state); the kept
    logits are those at or above it. MODE 2: that mass itself, then the range for MODE 1."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    pid = tl.program_id(1)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    if MODE == 0:
        active = (k > 0) & (k < V)
    else:
        active = p < 1.0
    if active:
        xrow = x_ptr + row.to(tl.int64) * stride_x
        r0 = tl.arange(0, BLOCK)
        j = tl.arange(0, 16)
        lo = tl.load(si_ptr + row * 4 + 1)
        hi = tl.load(si_ptr + row * 4 + 2)
        ck = tl.load(si_ptr + row * 4 + 3)
        best = tl.load(sf_ptr + row * 2)
        t = lo + ((hi - lo) * j) // 16
        end = tl.minimum(V, (pid + 1) * CHUNK)
        acc = tl.zeros([16], tl.float32)
        for start in range(pid * CHUNK, end, BLOCK):
            c = start + r0
            v = tl.load(xrow + c, mask=c < end, other=0.0).to(tl.float32)
            key = _key(v)
            if MODE == 0:
                w = tl.where(c < end, 1.0, 0.0)
            else:
                w = tl.where((c < end) & (key >= ck), tl.exp(v - best), 0.0)
            if MODE == 2:
                acc += tl.where(j == 0, tl.sum(w, axis=0), 0.0)
            else:
                acc += tl.sum(tl.where(key[:, None] >= t[None, :], w[:, None], 0.0), axis=0)
        part = part_ptr + (row * P + pid) * 16
        tl.store(part + j, acc)
        if _last_of_row(cnt_ptr, row, P):
            q = tl.arange(0, P_PAD)
            total = tl.sum(tl.load(part_ptr + (row * P + q[:, None]) * 16 + j[None, :], mask=(q < P)[:, None],
                                   other=0.0), axis=0)
            if MODE == 2:
                tl.store(sf_ptr + row * 2 + 1, tl.sum(tl.where(j == 0, total, 0.0), axis=0))
                tl.store(si_ptr + row * 4 + 1, ck)  # top-p's range: from the top-k's cut to the best
                tl.store(si_ptr + row * 4 + 2, _key(best) + 1)
            else:
                if MODE == 0:
                    goal = k.to(tl.float32)
                else:
                    goal = p * tl.load(sf_ptr + row * 2 + 1)
                pick = tl.max(tl.where((j >= 1) & (total >= goal), j, 0), axis=0)
                new_lo = lo + ((hi - lo) * pick) // 16
                tl.store(si_ptr + row * 4 + 1, new_lo)
                tl.store(si_ptr + row * 4 + 2, lo + ((hi - lo) * (pick + 1)) // 16)
                if MODE == 0:
                    tl.store(si_ptr + row * 4 + 3, new_lo)
            tl.store(cnt_ptr + row, 0)


@jit
def _rounds_cut_kernel(si_ptr, sf_ptr, cut_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    mp = tl.load(min_p_ptr + row)
    best = tl.load(sf_ptr + row * 2)
    cut = tl.where(mp > 0, best + tl.log(tl.maximum(mp, 1e-30)), float("-inf"))
    cut = tl.where((k > 0) & (k < V), tl.maximum(cut, _value(tl.load(si_ptr + row * 4 + 3))), cut)
    cut = tl.where(p < 1.0, tl.maximum(cut, _value(tl.load(si_ptr + row * 4 + 1))), cut)
    tl.store(cut_ptr + row, cut)


ROUNDS = 8  # 16-way rounds from 2^32 keys down to one
# the most rows cuts finds by rounds rather than a sort (H200, 128k vocabulary, bench_sampling.py
# --kernels: one row 179 us against the sort's 186 and the 1B decode loop's nucleus 1,697 tok/s
# against 1,426; 16 rows 380 us against 325)
ROUNDS_ROWS = 1


def _cuts_by_rounds(logits, top_k, top_p, min_p, out, any_top_k: bool) -> None:
    """cuts without ranking the row (top-p without top-k, where a sort of 128k logits cost 0.19 ms
    a step on the H200): the cuts found on the logits' keys, 16 ways a round over P programs a row."""
    T, V = logits.shape
    P = max(1, min(32, triton.cdiv(V, 4096)))
    chunk = triton.cdiv(V, P)
    dev = logits.device
    part = torch.empty((T, P, 16), dtype=torch.float32, device=dev)
    cnt = torch.zeros((T,), dtype=torch.int32, device=dev)
    si = torch.empty((T, 4), dtype=torch.int64, device=dev)
    sf = torch.empty((T, 2), dtype=torch.float32, device=dev)
    grid, common = (T, P), dict(BLOCK=256, P_PAD=next_pow2(P), num_warps=4, **pdl())
    args = (logits, logits.stride(0), V, chunk, part, cnt, si, sf)
    _rounds_stats_kernel[grid](*args, P, **common)
    if any_top_k:
        for _ in range(ROUNDS):
            _round_kernel[grid](*args, top_k, top_p, P, MODE=0, **common)
        _round_kernel[grid](*args, top_k, top_p, P, MODE=2, **common)
    for _ in range(ROUNDS):
        _round_kernel[grid](*args, top_k, top_p, P, MODE=1, **common)
    _rounds_cut_kernel[(T,)](si, sf, out, top_k, top_p, min_p, V, **pdl())


# Ranked prefixes of up to this many logits come from the two-pass top-k kernels below; longer ones
# from torch (topk, or a sort past FULL_SORT_FROM). The kernels keep a sampled decode step's CUDA
# graph all Triton, which a start-up image needs (backends/cuda/replay.py): torch.topk's kernels
# live in libtorch, which a replay does not load.
TOPK_MAX = 256
TOPK_CHUNK = 4096  # logits a first-pass program ranks


@jit
def _topk_part_kernel(x_ptr, stride_x, part_ptr, V, CH: tl.constexpr, KP: tl.constexpr, P: tl.constexpr,
                      PDL: tl.constexpr):
    """First pass: the KP largest logits of one CH-long chunk of a row, best first."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    p = tl.program_id(1)
    offs = p * CH + tl.arange(0, CH)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    tl.store(part_ptr + (row * P + p) * KP + tl.arange(0, KP), tl.topk(x, KP))


@jit
def _topk_merge_kernel(part_ptr, vals_ptr, stride_v, KP: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr):
    """Second pass: the KP largest of a row's P chunks' KP, best first."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.load(part_ptr + row * P * KP + tl.arange(0, P * KP))
    tl.store(vals_ptr + row.to(tl.int64) * stride_v + tl.arange(0, KP), tl.topk(c, KP))


def ranked_prefix(logits: torch.Tensor, need: int) -> torch.Tensor:
    """Each row's `need` largest logits, best first, as float32 [T, >= need] (the first need
    columns): two kernels (P programs a row rank a chunk each, one merges) for need <= TOPK_MAX."""
    T, V = logits.shape
    KP = max(2, next_pow2(int(need)))  # tl.topk reduces a pair at the least
    CH = min(TOPK_CHUNK, max(next_pow2(V), KP))
    P = next_pow2(triton.cdiv(V, CH))
    part = torch.empty((T, P, KP), dtype=torch.float32, device=logits.device)
    vals = torch.empty((T, KP), dtype=torch.float32, device=logits.device)
    _topk_part_kernel[(T, P)](logits, logits.stride(0), part, V, CH=CH, KP=KP, P=P, num_warps=4, **pdl())
    _topk_merge_kernel[(T,)](part, vals, vals.stride(0), KP=KP, P=P, num_warps=4, **pdl())
    return vals


def cuts(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, need: int,
         out: torch.Tensor | None = None, any_top_k: bool = True) -> torch.Tensor:
    """Each row's cut for `sample` (float32 [T]): the smallest logit that top-k, then top-p (over the
    top-k's probabilities, or the whole row's without top-k), then min-p (against the best token's
    probability) keep; -inf where nothing is cut. top_k (int32/int64, 0: none), top_p and min_p
    (float32): device tensors of T elements; need: ranked_need of the same values (a host number,
    so that the work done, and a CUDA graph holding it, does not depend on device values). The
    ranked prefix comes from ranked_prefix's kernels up to TOPK_MAX, else from torch (topk, or a
    sort of the row past FULL_SORT_FROM); the rest is one kernel, a program per row. A single row (the device decode loop; up to ROUNDS_ROWS) that
    needs the whole ranking (top-p without top-k), longer than FULL_SORT_FROM, is not ranked: the
    cuts are found on the logits' 32-bit keys in 16-way rounds (_cuts_by_rounds; any_top_k=False,
    a host fact, skips the top-k rounds)."""
    check_2d(logits, "logits")
    T, V = logits.shape
    _check_per_row("cuts", logits, (("top_k", top_k, (torch.int32, torch.int64)), ("top_p", top_p, (torch.float32,)),
                                    ("min_p", min_p, (torch.float32,))))
    if out is None:
        out = torch.empty((T,), dtype=torch.float32, device=logits.device)
    if T == 0:
        return out
    need = min(max(int(need), 0), V)
    if need >= V and V > FULL_SORT_FROM and T <= ROUNDS_ROWS:  # top-p without top-k: no ranking at all
        _cuts_by_rounds(logits, top_k, top_p, min_p, out, any_top_k)
        return out
    if need == 0:
        vals = logits
    elif need <= TOPK_MAX:
        vals = ranked_prefix(logits, need)
    elif need >= min(V, FULL_SORT_FROM):
        vals = torch.sort(logits, dim=1, descending=True).values
    else:
        vals = torch.topk(logits, need, dim=1).values
    _cut_kernel[(T,)](logits, logits.stride(0), vals, vals.stride(0), out, top_k, top_p, min_p, V, need,
                      BLOCK=1024, num_warps=4, **pdl())
    return out
