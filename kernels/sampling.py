"""Triton sampling: temperature, top-k, top-p and greedy rows without a sort.

A sort of every row (what top-p over a softmax needs, done plainly) took gpt2's
256-row sampled decode step from 0.99 to ~2.9 ms on an H200, and qwen3's (a 152K
vocabulary) from 2.9 to ~8 ms (BENCHMARKS.md). Here the logits are streamed a few
times instead:

1. the row's maximum, its first index (a greedy row's token, done) and the softmax
   normaliser Z over the row's candidates, in one pass (online, per lane);
2. a round of rejection sampling: the exponential race (Gumbel-max) over the tokens
   scoring above a pivot picks a token t with probability proportional to p_t among
   them; a second pass sums the mass of the tokens scoring above t. t is in the top-p
   set iff that mass is under top_p * Z: accept t. Else every token scoring at most t's
   score is outside the set too, and the next round races only the tokens above it.

Each row is split into chunks (`chunking`: about TARGET_PROGRAMS programs a launch, so
that one row's 50-150K logits spread over the SMs as a batch's do). Each pass is a
launch over (chunk, row) programs that write partials (a chunk's max, first argmax and
Z; its race winner; its mass above the winner) to a workspace; the next launch's
programs combine a row's partials again (a few hundred floats) rather than wait for a
reduction. The first launch runs pass 1 and round 0's race in one stream. The first
SPLIT_ROUNDS rounds run this way; a row still undecided after them (rare: round 0
fails with the probability of drawing outside the top-p set, ~1 - top_p) takes its
further rounds in the finishing launch, one program streaming the whole row.

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

Random numbers are Philox (tl.randint4x) of a per-row key and counter: the uniform
for candidate i in round r is word i % 4 of Philox(key, base + r * num_cols + i // 4).
A request with a seed has key = seed and base = its token's position << 32, so its
tokens do not depend on its batch neighbours or on the step that samples them; the
others share a key drawn per step by the host and take base = row << 32.
kernels.reference.sample_tokens_ref is the same algorithm in torch, with the same Philox.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.reference import sample_tokens_ref  # noqa: F401  (the torch reference)

MAX_ROUNDS = 64
SPLIT_ROUNDS = 2  # rounds run split over a row's chunks; the rest (rare) by one program a row
BLOCK = 1024  # logits per lane pass
TARGET_PROGRAMS = 2048  # a launch's programs, about: rows x chunks (swept: BENCHMARKS.md)
MAX_CHUNKS = 256  # a row's chunks at most (a combine reads them as one vector)
NUM_WARPS = 4
FINISH_WARPS = 16  # the finishing program may stream a whole row in further rounds
_NONE = tl.constexpr(1 << 30)  # "no index", above any vocabulary
# The interpreter (CPU tests) has no libdevice: there the race's logs are tl.log.
_FAST_LOG = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _uniforms(key, counter0, start, BLOCK: tl.constexpr):
    """Uniforms in (0, 1) of candidates start + [0, BLOCK) (start a multiple of 4):
    candidate i's is 23 random bits of word i % 4 of Philox(key, counter0 + i // 4),
    centred in their step. One Philox per four candidates: the race's costliest part."""
    groups = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.int64)
    w0, w1, w2, w3 = tl.randint4x(key, counter0 + groups)
    bits = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))  # w0 w1 w2 w3 w0 ..
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _scores(x_ptr, i, limit, inv_t):
    """Candidates i's logits over the temperature, in float32; -inf past the row's limit."""
    return tl.load(x_ptr + i, mask=i < limit, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _first_max(values, idx):
    """(the largest of values, the least idx holding it): the first argmax over a
    program's lanes, or over a row's chunks."""
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, idx, _NONE), axis=0)


@triton.jit
def _race_lanes(s, u, i, pivot, win_key, win_idx):
    """Each lane's race so far, after candidates i (scores s, uniforms u) above pivot.

    The key is s - log(E), E = -log(u) ~ Exp(1), both logs fast ones on the GPU: tl.log
    is libdevice's exact logf, ~20 instructions, and two of them were ~40% of the race's
    loop (BENCHMARKS.md). lg2.approx has an absolute error near 2**-22, so E's relative
    error stays under ~1.2e-6 where E > 0.13, and the key moves by less than its own
    float32 step (~2e-6 at 16). A winner's E is small (u near 1): for u > 7/8, E is the
    series of -log(1 - w), w = 1 - u exact, to w**7 (relative error under 1e-7)."""
    if _FAST_LOG:
        w = 1.0 - u
        tail = 1 / 4 + w * (1 / 5 + w * (1 / 6 + w / 7))
        series = w * (1 + w * (1 / 2 + w * (1 / 3 + w * tail)))
        e = tl.where(w < 0.125, series, -libdevice.fast_logf(u))
        log_e = libdevice.fast_logf(e)
    else:
        log_e = tl.log(-tl.log(u))
    race = tl.where(s > pivot, s - log_e, float("-inf"))
    better = race > win_key
    return tl.where(better, race, win_key), tl.where(better, i, win_idx)


@triton.jit
def _gumbel_race(x_ptr, lo, hi, limit, inv_t, pivot, key, counter0, BLOCK: tl.constexpr):
    """The race over candidates [lo, hi) scoring above pivot: (best key, its first index)."""
    lanes = tl.arange(0, BLOCK)
    win_key = tl.full([BLOCK], float("-inf"), tl.float32)
    win_idx = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(lo, hi, BLOCK):
        i = start + lanes
        s = _scores(x_ptr, i, tl.minimum(limit, hi), inv_t)
        u = _uniforms(key, counter0, start, BLOCK)
        win_key, win_idx = _race_lanes(s, u, i, pivot, win_key, win_idx)
    return _first_max(win_key, win_idx)


@triton.jit
def _mass_above(x_ptr, lo, hi, limit, inv_t, s_t, m, BLOCK: tl.constexpr):
    """Softmax mass (relative to exp(m)) of candidates [lo, hi) scoring above s_t."""
    lanes = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        s = _scores(x_ptr, start + lanes, tl.minimum(limit, hi), inv_t)
        above += tl.where(s > s_t, tl.exp(s - m), 0.0)
    return tl.sum(above, axis=0)


@triton.jit
def _row(prog, rows_ptr, logits_ptr, stride_logits, temps_ptr, limits_ptr, top_ps_ptr,
         num_cols, TOP_P: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ROWS: tl.constexpr):  # fmt: skip
    """Program prog's row: (row, its logits or candidates, limit, top_p, greedy, 1 / T);
    top_p 1 unless TOP_P (a launch whose rows all have top_p 1 skips its work)."""
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
    # At least one candidate: a row with none (a graph's unused row) takes the first.
    limit = tl.maximum(tl.minimum(tl.load(limits_ptr + row), num_cols), 1).to(tl.int32)
    greedy = temp == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    if TOP_P:
        top_p = tl.load(top_ps_ptr + row)
    else:
        top_p = tl.full([], 1.0, tl.float32)
    return row, x_ptr, limit, top_p, greedy, inv_t


@triton.jit
def _combine_stats(ws_row, num_chunks, FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """The row's (max, first argmax, Z relative to exp(max)) from its chunks' partials."""
    at = ws_row + tl.arange(0, MAX_CHUNKS) * FIELDS
    mask = tl.arange(0, MAX_CHUNKS) < num_chunks
    mx = tl.load(at, mask=mask, other=float("-inf"))
    m, best = _first_max(mx, tl.load(at + 1, mask=mask, other=_NONE))
    part = tl.load(at + 2, mask=mask, other=0.0)
    z = tl.sum(tl.where(mx == float("-inf"), 0.0, part * tl.exp(mx - m)), axis=0)
    return m, best.to(tl.int32), z


@triton.jit
def _combine_race(ws_row, rnd, num_chunks, FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """Round rnd's winner over the row's chunks: the first index of the best key (none
    where num_chunks is 0)."""
    at = ws_row + tl.arange(0, MAX_CHUNKS) * FIELDS + 3 + 3 * rnd
    mask = tl.arange(0, MAX_CHUNKS) < num_chunks
    key = tl.load(at, mask=mask, other=float("-inf"))
    top, idx = _first_max(key, tl.load(at + 1, mask=mask, other=_NONE))
    return idx.to(tl.int32)


@triton.jit
def _decided(ws_row, x_ptr, rounds, num_chunks, limit, inv_t, top_p, z, best,
             FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr):  # fmt: skip
    """After split rounds [0, rounds) of a sampled row: (done, token, pivot). A round's
    partials are read only while the row was still undecided (later ones were not written)."""
    done = tl.full([], 0, tl.int32)
    token = best
    pivot = tl.full([], float("-inf"), tl.float32)
    chunks = tl.arange(0, MAX_CHUNKS)
    for rnd in range(0, rounds):
        live = done == 0  # (a decided row's later rounds were not written)
        t = _combine_race(ws_row, rnd, tl.where(live, num_chunks, 0), FIELDS, MAX_CHUNKS)
        s_t = tl.load(x_ptr + t, mask=live & (t < limit), other=0.0).to(tl.float32) * inv_t
        at = ws_row + chunks * FIELDS + 5 + 3 * rnd
        summed = tl.where(live & (top_p < 1.0), num_chunks, 0)  # (the mass was written)
        mass = tl.sum(tl.load(at, mask=chunks < summed, other=0.0), axis=0)
        accept = live & ((top_p >= 1.0) | (mass < top_p * z))
        token = tl.where(accept, t, token)
        pivot = tl.where(live & ~accept, s_t, pivot)
        done = done | accept.to(tl.int32)
    return done, token, pivot


@triton.jit(do_not_specialize=["num_cols", "chunk", "num_chunks", "rnd"])
def _race_kernel(
    logits_ptr, stride_logits, rows_ptr, ws_ptr, temps_ptr, limits_ptr, top_ps_ptr,
    keys_ptr, bases_ptr, num_cols, chunk, num_chunks, rnd,
    FIRST: tl.constexpr, TOP_P: tl.constexpr, HAS_IDS: tl.constexpr,
    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, FIELDS: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
):  # fmt: skip
    """Program (c, prog): chunk c of its row. Round rnd's race over the chunk (unless the
    row is decided) and, FIRST, the chunk's max and first argmax besides, and its Z
    where TOP_P (else 0: Z only weighs a top_p)."""
    c = tl.program_id(0)
    prog = tl.program_id(1)
    row, x_ptr, limit, top_p, greedy, inv_t = _row(
        prog, rows_ptr, logits_ptr, stride_logits, temps_ptr, limits_ptr, top_ps_ptr,
        num_cols, TOP_P, HAS_IDS, HAS_ROWS,
    )  # fmt: skip
    ws_row = ws_ptr + prog.to(tl.int64) * num_chunks * FIELDS
    at = ws_row + c * FIELDS
    lo = c * chunk
    hi = tl.minimum(lo + chunk, limit)
    counter0 = tl.load(bases_ptr + row) + rnd.to(tl.int64) * num_cols
    key = tl.load(keys_ptr + row)
    if FIRST:
        # One stream: each lane's running max (first index), its softmax sum relative to
        # it (TOP_P: Z weighs only a top_p), and round 0's race (pivot -inf: every
        # candidate) but on greedy rows.
        lanes = tl.arange(0, BLOCK)
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_idx = tl.full([BLOCK], _NONE, tl.int32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        win_key = tl.full([BLOCK], float("-inf"), tl.float32)
        win_idx = tl.full([BLOCK], _NONE, tl.int32)
        for start in range(lo, hi, BLOCK):
            i = start + lanes
            s = _scores(x_ptr, i, hi, inv_t)
            better = s > lane_max
            if TOP_P:
                # One exp a candidate: a new max rescales the sum by exp(old - new) and
                # adds 1; any other candidate adds exp(s - max). (-inf - -inf is NaN: a
                # lane that has seen only -inf keeps a zero sum.)
                e = tl.exp(tl.where(better, lane_max - s, s - lane_max))
                lane_sum = tl.where(
                    better, lane_sum * e + 1.0, lane_sum + tl.where(s == float("-inf"), 0.0, e)
                )
            lane_idx = tl.where(better, i, lane_idx)
            lane_max = tl.where(better, s, lane_max)
            if not greedy:
                u = _uniforms(key, counter0, start, BLOCK)
                win_key, win_idx = _race_lanes(s, u, i, float("-inf"), win_key, win_idx)
        m, best = _first_max(lane_max, lane_idx)
        tl.store(at, m)
        tl.store(at + 1, best.to(tl.float32))
        rel = tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - m))
        tl.store(at + 2, tl.sum(rel, axis=0))
        top, t = _first_max(win_key, win_idx)
        tl.store(at + 3, top)
        tl.store(at + 4, t.to(tl.float32))
    else:
        if greedy:
            return
        m, best, z = _combine_stats(ws_row, num_chunks, FIELDS, MAX_CHUNKS)
        done, token, pivot = _decided(
            ws_row, x_ptr, rnd, num_chunks, limit, inv_t, top_p, z, best, FIELDS, MAX_CHUNKS
        )
        if done != 0:
            return
        top, t = _gumbel_race(x_ptr, lo, hi, limit, inv_t, pivot, key, counter0, BLOCK)
        tl.store(at + 3 + 3 * rnd, top)
        tl.store(at + 4 + 3 * rnd, t.to(tl.float32))


@triton.jit(do_not_specialize=["num_cols", "chunk", "num_chunks", "rnd"])
def _mass_kernel(
    logits_ptr, stride_logits, rows_ptr, ws_ptr, temps_ptr, limits_ptr, top_ps_ptr,
    num_cols, chunk, num_chunks, rnd,
    TOP_P: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr, FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):  # fmt: skip
    """Program (c, prog): the mass of chunk c's candidates scoring above round rnd's
    winner, for rows with a top_p still undecided."""
    c = tl.program_id(0)
    prog = tl.program_id(1)
    row, x_ptr, limit, top_p, greedy, inv_t = _row(
        prog, rows_ptr, logits_ptr, stride_logits, temps_ptr, limits_ptr, top_ps_ptr,
        num_cols, TOP_P, HAS_IDS, HAS_ROWS,
    )  # fmt: skip
    if greedy | (top_p >= 1.0):
        return
    ws_row = ws_ptr + prog.to(tl.int64) * num_chunks * FIELDS
    m, best, z = _combine_stats(ws_row, num_chunks, FIELDS, MAX_CHUNKS)
    done, token, pivot = _decided(
        ws_row, x_ptr, rnd, num_chunks, limit, inv_t, top_p, z, best, FIELDS, MAX_CHUNKS
    )
    if done != 0:
        return
    t = _combine_race(ws_row, rnd, num_chunks, FIELDS, MAX_CHUNKS)
    s_t = tl.load(x_ptr + t).to(tl.float32) * inv_t
    lo = c * chunk
    mass = _mass_above(x_ptr, lo, tl.minimum(lo + chunk, limit), limit, inv_t, s_t, m, BLOCK)
    tl.store(ws_row + c * FIELDS + 5 + 3 * rnd, mass)


@triton.jit(do_not_specialize=["num_cols", "num_chunks", "split_rounds"])
def _finish_kernel(
    logits_ptr, stride_logits, ids_ptr, stride_ids, rows_ptr, ws_ptr, out_ptr,
    temps_ptr, limits_ptr, top_ps_ptr, keys_ptr, bases_ptr, num_cols, num_chunks,
    split_rounds, TOP_P: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr, FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
):  # fmt: skip
    """Program prog: its row's token. The split rounds' verdict, else further rounds over
    the whole row by this program alone (rare: see the module docstring)."""
    prog = tl.program_id(0)
    row, x_ptr, limit, top_p, greedy, inv_t = _row(
        prog, rows_ptr, logits_ptr, stride_logits, temps_ptr, limits_ptr, top_ps_ptr,
        num_cols, TOP_P, HAS_IDS, HAS_ROWS,
    )  # fmt: skip
    ws_row = ws_ptr + prog.to(tl.int64) * num_chunks * FIELDS
    m, best, z = _combine_stats(ws_row, num_chunks, FIELDS, MAX_CHUNKS)
    token = best
    if not greedy:
        done, token, pivot = _decided(
            ws_row, x_ptr, split_rounds, num_chunks, limit, inv_t, top_p, z, best, FIELDS,
            MAX_CHUNKS,
        )  # fmt: skip
        key = tl.load(keys_ptr + row)
        base = tl.load(bases_ptr + row)
        rnd = split_rounds
        while (rnd < MAX_ROUNDS) & (done == 0):
            counter0 = base + rnd * num_cols
            top, t = _gumbel_race(x_ptr, 0, limit, limit, inv_t, pivot, key, counter0, BLOCK)
            s_t = tl.load(x_ptr + t).to(tl.float32) * inv_t
            accept = _mass_above(x_ptr, 0, limit, limit, inv_t, s_t, m, BLOCK) < top_p * z
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
    any_top_p: bool = True,  # False: every row's top_p taken as 1 (two launches, not five)
) -> torch.Tensor:
    """One token per row into out (rows: only those), as the module docstring describes.

    Without ids, logits has every row (N) and rows picks some; with ids, logits and ids
    hold the candidates of rows[j] in their row j (all rows when rows is None). Never
    reads device data on the host. Triton compiles a kernel per launch form (ids, rows)
    and per class of the logits' strides (divisible by 16 or not); the widths and the
    chunking are not specialised on, so nothing compiles mid-serving.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [R, C], columns contiguous"
    # The workspace keeps indices as float32: exact below 2**24 columns (vocabularies: < 300K).
    assert logits.shape[1] < 2**24, "logits: more columns than the workspace indexes exactly"
    num_programs = rows.shape[0] if rows is not None else logits.shape[0]
    if ids is not None:
        assert ids.shape == logits.shape and ids.stride(1) == 1, "ids: as logits"
        assert logits.shape[0] == num_programs, "candidates: one row per sampled row"
    if num_programs == 0:
        return out
    num_cols = logits.shape[1]
    chunk, num_chunks = chunking(num_programs, num_cols)
    fields = 3 + 3 * SPLIT_ROUNDS  # per (row, chunk): max, argmax, Z; per round: key, index, mass
    ws = torch.empty(num_programs * num_chunks * fields, dtype=torch.float32, device=out.device)
    rows_arg = rows if rows is not None else out
    params = (temperatures, limits, top_ps)
    forms = dict(TOP_P=any_top_p, HAS_IDS=ids is not None, HAS_ROWS=rows is not None,
                 BLOCK=BLOCK, FIELDS=fields, MAX_CHUNKS=MAX_CHUNKS)  # fmt: skip
    split = (num_chunks, num_programs)
    split_rounds = SPLIT_ROUNDS if any_top_p else 1  # without a top_p, round 0 decides
    for rnd in range(split_rounds):
        _race_kernel[split](
            logits, logits.stride(0), rows_arg, ws, *params, keys, bases, num_cols, chunk,
            num_chunks, rnd, FIRST=rnd == 0, **forms, num_warps=NUM_WARPS,
        )  # fmt: skip
        if any_top_p:
            _mass_kernel[split](
                logits, logits.stride(0), rows_arg, ws, *params, num_cols, chunk, num_chunks,
                rnd, **forms, num_warps=NUM_WARPS,
            )  # fmt: skip
    _finish_kernel[(num_programs,)](
        logits, logits.stride(0), ids if ids is not None else logits,
        ids.stride(0) if ids is not None else 0, rows_arg, ws, out, *params, keys, bases,
        num_cols, num_chunks, split_rounds, **forms, MAX_ROUNDS=MAX_ROUNDS,
        num_warps=FINISH_WARPS,
    )  # fmt: skip
    return out


def chunking(num_rows: int, num_cols: int) -> tuple[int, int]:
    """(chunk, num_chunks): each row split into chunks of whole BLOCKs, enough of them for
    about TARGET_PROGRAMS programs a launch (one row alone still spreads over the SMs),
    at most MAX_CHUNKS."""
    blocks = triton.cdiv(num_cols, BLOCK)
    per_row = max(1, min(blocks, MAX_CHUNKS, triton.cdiv(TARGET_PROGRAMS, num_rows)))
    chunk = triton.cdiv(blocks, per_row) * BLOCK
    return chunk, triton.cdiv(num_cols, chunk)


def candidates_width(max_top_k: int, vocab_size: int) -> int:
    """torch.topk's width for a batch whose largest top_k is max_top_k: a multiple of 16
    (the rows' limits mask the extra candidates), so that every top-k launch has widths
    and strides of one class whatever the batch's top_k, and one compiled kernel."""
    return min(-(-max_top_k // 16) * 16, vocab_size)
