"""Triton sampling: temperature, top-k, top-p and greedy rows in one launch, no sort.

A sort of every row (what top-p over a softmax needs, done plainly) took gpt2's
256-row sampled decode step from 0.99 to ~2.9 ms on an H200, and qwen3's (a 152K
vocabulary) from 2.9 to ~8 ms (BENCHMARKS.md). Here one program per row streams its
logits a few times instead:

1. the row's maximum, its first index (a greedy row's token, done) and the softmax
   normaliser Z over the row's candidates, in one pass (online, per lane);
2. a round of rejection sampling: the exponential race (Gumbel-max) over the tokens
   scoring above a pivot picks a token t with probability proportional to p_t among
   them; a second pass sums the mass of the tokens scoring above t. t is in the top-p
   set iff that mass is under top_p * Z: accept t. Else every token scoring at most t's
   score is outside the set too, and the next round races only the tokens above it.

Each round races a superset of the top-p set with the right proportions, so an
accepted token is distributed exactly as top-p sampling's (the top-p set is taken
with ties whole: a token is in it when the tokens strictly above it hold less than
top_p). The most likely token is always in the set, so rounds end; MAX_ROUNDS bounds
them and the most likely token stands in past it. The worst case is a flat row with a
top_p that keeps one token: each round's winner is uniform over the tokens above the
pivot, so the rounds number about ln(vocabulary) (12 for 152K tokens), and 64 of them
are a Poisson tail beyond 1e-20. top_p == 1 accepts the first race.

Top-k comes in as candidates: the row's top_k largest logits (torch.topk, largest
first) and their vocabulary ids, with `limits` the row's k; the normaliser and the
top-p masses then run over the top-k set, which is top-k first, top-p over the
renormalised rest (transformers' order).

Random numbers are Philox (tl.randint) of a per-row key and counter: the uniform for
candidate i in round r is Philox(key, base + r * num_cols + i). A request with a seed
has key = seed and base = its token's position << 32, so its tokens do not depend on
its batch neighbours or on the step that samples them; the others share a key drawn
per step by the host and take base = row << 32. kernels.reference.sample_tokens_ref is
the same algorithm in torch, with the same Philox.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import sample_tokens_ref  # noqa: F401  (the torch reference)

MAX_ROUNDS = 64
BLOCK = 1024  # logits per lane pass
NUM_WARPS = 4


@triton.jit
def _uniform(key, counter):
    """Uniform in (0, 1): 23 random bits of Philox(key, counter), centred in their step."""
    bits = tl.randint(key, counter)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _scores(x_ptr, i, limit, inv_t):
    """Candidates i's logits over the temperature, in float32; -inf past the row's limit."""
    return tl.load(x_ptr + i, mask=i < limit, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _sample_kernel(
    logits_ptr, stride_logits, ids_ptr, stride_ids, rows_ptr, out_ptr,
    temps_ptr, limits_ptr, top_ps_ptr, keys_ptr, bases_ptr, num_cols,
    HAS_IDS: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
):  # fmt: skip
    prog = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + prog)
    else:
        row = prog.to(tl.int64)
    # Candidates (HAS_IDS) are the program's own row; otherwise the logits are every row's.
    if HAS_IDS:
        x_ptr = logits_ptr + prog.to(tl.int64) * stride_logits
    else:
        x_ptr = logits_ptr + row * stride_logits
    temp = tl.load(temps_ptr + row)
    limit = tl.minimum(tl.load(limits_ptr + row), num_cols).to(tl.int32)
    top_p = tl.load(top_ps_ptr + row)
    key = tl.load(keys_ptr + row)
    base = tl.load(bases_ptr + row)
    greedy = temp == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    lanes = tl.arange(0, BLOCK)

    # Pass 1: each lane's running max (first index) and its softmax sum relative to it.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK], tl.int32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, limit, BLOCK):
        i = start + lanes
        s = _scores(x_ptr, i, limit, inv_t)
        better = s > lane_max
        new_max = tl.where(better, s, lane_max)
        # exp(-inf - -inf) is NaN: a lane that has seen only -inf keeps a zero sum
        rescale = tl.where(lane_max == float("-inf"), 0.0, tl.exp(lane_max - new_max))
        add = tl.where(s == float("-inf"), 0.0, tl.exp(s - new_max))
        lane_sum = lane_sum * rescale + add
        lane_idx = tl.where(better, i, lane_idx)
        lane_max = new_max
    m = tl.max(lane_max, axis=0)
    best = tl.min(tl.where(lane_max == m, lane_idx, num_cols), axis=0)  # the first max
    z = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - m)), axis=0)

    token = best
    pivot = m - float("inf")
    done = greedy.to(tl.int32)
    rnd = 0
    while (rnd < MAX_ROUNDS) & (done == 0):
        # Race the tokens above the pivot: argmax of score + Gumbel noise.
        win_key = tl.full([BLOCK], float("-inf"), tl.float32)
        win_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, limit, BLOCK):
            i = start + lanes
            s = _scores(x_ptr, i, limit, inv_t)
            u = _uniform(key, base + rnd * num_cols + i.to(tl.int64))
            race = tl.where(s > pivot, s - tl.log(-tl.log(u)), float("-inf"))
            better = race > win_key
            win_key = tl.where(better, race, win_key)
            win_idx = tl.where(better, i, win_idx)
        top = tl.max(win_key, axis=0)
        t = tl.min(tl.where(win_key == top, win_idx, num_cols), axis=0)
        s_t = tl.load(x_ptr + t).to(tl.float32) * inv_t
        accept = top_p >= 1.0
        if top_p < 1.0:
            above = tl.zeros([BLOCK], tl.float32)
            for start in range(0, limit, BLOCK):
                s = _scores(x_ptr, start + lanes, limit, inv_t)
                above += tl.where(s > s_t, tl.exp(s - m), 0.0)
            accept = tl.sum(above, axis=0) < top_p * z
        token = tl.where(accept, t, token)
        pivot = tl.where(accept, pivot, s_t)
        done = accept.to(tl.int32)
        rnd += 1

    if HAS_IDS:
        token_id = tl.load(ids_ptr + prog.to(tl.int64) * stride_ids + token)
    else:
        token_id = token.to(tl.int64)
    tl.store(out_ptr + row, token_id)


def sample_tokens(
    logits: torch.Tensor,  # [R, C]: rows' logits (ids None) or candidates (with ids)
    temperatures: torch.Tensor,  # [N] float32; 0: greedy (the first argmax)
    limits: torch.Tensor,  # [N] int64: candidates of each row (top_k), at most C
    top_ps: torch.Tensor,  # [N] float32 in (0, 1]
    keys: torch.Tensor,  # [N] int64: Philox keys
    bases: torch.Tensor,  # [N] int64: Philox counter bases
    out: torch.Tensor,  # [N] int64: each row's token id
    rows: torch.Tensor | None = None,  # [R] int64: the rows this launch samples
    ids: torch.Tensor | None = None,  # [R, C] int64: candidate i's vocabulary id
) -> torch.Tensor:
    """One token per row into out (rows: only those), as the module docstring describes.

    Without ids, logits has every row (N) and rows picks some; with ids, logits and ids
    hold the candidates of rows[j] in their row j (all rows when rows is None). Never
    reads device data on the host. Triton compiles a kernel per launch form (ids, rows)
    and per class of the widths and strides (divisible by 16 or not): callers keep those
    classes fixed (candidates_width), so that nothing compiles mid-serving.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [R, C], columns contiguous"
    num_programs = rows.shape[0] if rows is not None else logits.shape[0]
    if ids is not None:
        assert ids.shape == logits.shape and ids.stride(1) == 1, "ids: as logits"
        assert logits.shape[0] == num_programs, "candidates: one row per sampled row"
    if num_programs == 0:
        return out
    _sample_kernel[(num_programs,)](
        logits, logits.stride(0), ids if ids is not None else logits,
        ids.stride(0) if ids is not None else 0, rows if rows is not None else out, out,
        temperatures, limits, top_ps, keys, bases, logits.shape[1],
        HAS_IDS=ids is not None, HAS_ROWS=rows is not None, BLOCK=BLOCK,
        MAX_ROUNDS=MAX_ROUNDS, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def candidates_width(max_top_k: int, vocab_size: int) -> int:
    """torch.topk's width for a batch whose largest top_k is max_top_k: a multiple of 16
    (the rows' limits mask the extra candidates), so that every top-k launch has widths
    and strides of one class whatever the batch's top_k, and one compiled kernel."""
    return min(-(-max_top_k // 16) * 16, vocab_size)
