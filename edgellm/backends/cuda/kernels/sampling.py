"""Token choice on the device: argmax (a two-stage Triton reduction) and a sampler from torch ops
(temperature, top-k, top-p); nothing leaves the device, so a decode loop never synchronises."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
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
    T, V = logits.shape
    if step is not None:
        if T != 1 or any(t.dtype not in (torch.int32, torch.int64) or t.numel() < 1 for t in step):
            raise ValueError("argmax step takes one row of logits and three int32/int64 tensors "
                             "(tokens, start, seq_len)")
    if out is None:
        out = torch.empty((T,), dtype=torch.int64, device=logits.device)
    elif out.shape != (T,) or out.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"argmax out must be int32/int64 of shape ({T},), got {out.dtype} {tuple(out.shape)}")
    if T == 0:
        return out
    cfg = {**configs.ARGMAX_DEFAULT, **(config or {})}
    block = min(cfg["BLOCK"], next_pow2(V))
    n_part = triton.cdiv(V, block)
    pv = torch.empty((T, n_part), dtype=torch.float32, device=logits.device)
    pi = torch.empty((T, n_part), dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(T, n_part)](logits, logits.stride(0), pv, pi, V, n_part, BLOCK=block,
                                        num_warps=cfg["num_warps"], **pdl())
    tok, start, seq = step if step is not None else (out, out, out)
    _argmax_final_kernel[(T,)](pv, pi, out, V, n_part, tok, start, seq, PART_PAD=next_pow2(n_part),
                               STEP=step is not None, num_warps=1, **pdl())
    return out


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row of logits [T, V] -> int64 [T], on the logits' device.

    temperature <= 0 is greedy (argmax). top_k > 0 keeps the k largest logits; top_p < 1 keeps the
    smallest set of most likely tokens whose probability reaches top_p (always at least one).
    The draw is argmax(p / E) with E ~ Exp(1), which picks token i with probability p_i.
    """
    check_2d(logits, "logits")
    if temperature <= 0:
        return argmax(logits)
    x = logits.float() / float(temperature)
    V = x.shape[1]
    if 0 < top_k < V:
        vals, idx = torch.topk(x, int(top_k), dim=1)
    elif top_p < 1.0:
        vals, idx = torch.sort(x, dim=1, descending=True)
    else:
        vals, idx = x, None
    probs = torch.softmax(vals, dim=1)
    if top_p < 1.0:
        if idx is None:  # pragma: no cover - handled above
            raise AssertionError
        cum = torch.cumsum(probs, dim=1)
        drop = (cum - probs) >= float(top_p)  # tokens after the nucleus is already complete
        probs = probs.masked_fill(drop, 0.0)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    choice = torch.argmax(probs / noise, dim=1)
    if idx is None:
        return choice
    return idx.gather(1, choice[:, None]).squeeze(1)
