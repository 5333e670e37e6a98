"""Triton sampling: temperature, top-k, top-p and greedy rows without a sort.

A sort of every row (what top-p over a softmax needs, done plainly) took gpt2's 256-row
sampled decode step from 0.99 to ~2.9 ms on an H200, and qwen3's (a 152K vocabulary)
from 2.9 to ~8 ms (docs/design.md, "Sampling"). Here the logits are streamed a few times
instead:

1. the row's maximum, its first index (a greedy row's token, done) and the softmax
   normaliser Z over the row's candidates (its top-k set, else the whole row), in one
   pass (online, per lane);
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
SPLIT_ROUNDS rounds run this way (one in a launch of few logits: ONE_ROUND_LOGITS); a
row still undecided after them (rare: round 0 fails with the probability of drawing
outside the top-p set, ~1 - top_p) takes its further rounds in the finishing launch, one
program streaming the whole row.

Each round races a superset of the top-p set with the right proportions, so an
accepted token is distributed exactly as top-p sampling's (the top-p set is taken
with ties whole: a token is in it when the tokens strictly above it hold less than
top_p). The most likely token is always in the set, so rounds end; MAX_ROUNDS bounds
them and the most likely token stands in past it. The worst case is a flat row with a
top_p that keeps one token: each round's winner is uniform over the tokens above the
pivot, so the rounds number about ln(vocabulary) (12 for 152K tokens), and 64 of them
are a Poisson tail beyond 1e-20. top_p == 1 accepts the first race.

Top-k is a floor: the row's k-th largest logit. Three launches find it, reading every
logit twice (a radix select's passes over every logit's bits cost ~4x more, and
qwen3's top-k decode step at 256 rows took 3.51 ms with one against 3.11 with this,
on an H200): (1) a lower bound: per whole chunk, each lane's largest logit and the
m-th largest of those lane maxima (m = ceil(k / whole chunks): the chunk holds at least
m logits at or above it), so that at least k logits of the row are at or above the
least of its chunks' bounds; (2) every logit at or above that bound gathered (about k
to a few k of them); (3) the k-th largest among them, by a bisection over the logits'
ordered bit keys. A row whose gathered logits overflow CANDIDATES (a
huge k, or a bound dragged down by a chunk of -inf) bisects over its whole row
instead: rare and slow. The top-k set is every token at or above the floor: ties at
the k-th value are all kept, as transformers' TopKLogitsWarper and vLLM keep them.
Round 0's race and the normaliser run over that set; later rounds race above a pivot
that is in it already. So top-p runs over the renormalised top-k set (transformers'
order, top-k first).

Random numbers are Philox (tl.randint4x) of a per-row key and counter: the uniform
for token i in round r is word i % 4 of Philox(key, base + r * num_cols + i // 4).
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
# A top-p launch over at most this many logits (rows x vocabulary) splits round 0 alone:
# the second split round's two launches cost more there than the finishing program's rare
# rounds. On an H200, top-p 0.95, kernels us with one split round against two, logits of a
# trained model's spread: gpt2 at 1 / 2 / 4 / 8 rows 9.5 / 11.6 / 13.8 / 16.1 against 12.6
# / 15.1 / 16.0 / 17.1, qwen3-0.6b (152K) at 1 / 2 rows 13.3 / 17.1 against 15.6 / 16.8.
# Two rounds win from 16 rows (gpt2) and 4 (qwen3) up.
ONE_ROUND_LOGITS = 1 << 18
BLOCK = 1024  # logits per lane pass
# A launch's programs, about (rows x chunks). Swept on an H200 against 1024 and 4096:
# within 1 us of the best for gpt2 and qwen3-0.6b at 1, 64 and 256 rows, but for qwen3's
# top-p at 256 rows (298 us against 285 at 4096, which cost gpt2 at 64 rows 8 us).
TARGET_PROGRAMS = 2048
MAX_CHUNKS = 256  # a row's chunks at most (a combine reads them as one vector)
NUM_WARPS = 4
FINISH_WARPS = 16  # the finishing program may stream a whole row (rounds; top-k's floor too)
FINISH_BLOCK = 4096  # its logits per lane pass: 8 a thread, one vector load (as BLOCK's 4 warps)
CANDIDATES = 4096  # a top-k row's logits at or above its lower bound, gathered at most
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
def _block(x_ptr, start, hi, other, BLOCK: tl.constexpr):
    """Logits [start, start + BLOCK), other from hi on. start is a multiple of BLOCK (a
    row's chunks are whole blocks) and a whole block loads unmasked: where the row is
    16-aligned too (a padded LM head's stride), a lane's logits load as one vector, not
    one load each. (start // BLOCK * BLOCK tells the compiler what tl.multiple_of cannot
    tell it of a loop's counter.)"""
    start = start // BLOCK * BLOCK
    i = start + tl.arange(0, BLOCK)
    if start + BLOCK <= hi:
        x = tl.load(x_ptr + i)
    else:
        x = tl.load(x_ptr + i, mask=i < hi, other=other)
    return x


@triton.jit
def _scores(x_ptr, start, hi, inv_t, BLOCK: tl.constexpr):
    """Tokens [start, start + BLOCK)'s logits over the temperature, in float32; -inf from
    hi on."""
    return _block(x_ptr, start, hi, float("-inf"), BLOCK).to(tl.float32) * inv_t


@triton.jit
def _keys(x, KEY_BITS: tl.constexpr):
    """Ordered keys of logits x ([0, 2**KEY_BITS): int32 for 16-bit logits, else int64): a
    larger logit has a larger key, equal logits equal keys (-0 as +0). Negative floats'
    bits flip whole, others gain the sign bit."""
    sign: tl.constexpr = 1 << (KEY_BITS - 1)
    mask: tl.constexpr = (1 << KEY_BITS) - 1
    if KEY_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & mask
    else:
        bits = x.to(tl.int32, bitcast=True).to(tl.int64) & mask
    key = tl.where(bits >= sign, mask - bits, bits + sign)
    return tl.where(bits == sign, sign, key)


@triton.jit
def _key_logit(key, dtype: tl.constexpr, KEY_BITS: tl.constexpr):
    """The logit (of type dtype, in float32) whose key is key (_keys' inverse; the key of
    -0 gives +0): a float compare with it orders as the keys do (-0 == +0 too)."""
    sign: tl.constexpr = 1 << (KEY_BITS - 1)
    mask: tl.constexpr = (1 << KEY_BITS) - 1
    bits = tl.where(key >= sign, key - sign, mask - key)
    if KEY_BITS == 16:
        return bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _first_max(values, idx):
    """(the largest of values, the least idx holding it): the first argmax over a
    program's lanes, or over a row's chunks."""
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, idx, _NONE), axis=0)


@triton.jit
def _race_lanes(s, u, i, pivot, win_key, win_idx):
    """Each lane's race so far, after candidates i (scores s, uniforms u) above pivot.

    The key is s - log(E), E = -log(u) ~ Exp(1), both logs fast ones on the GPU: tl.log is
    libdevice's exact logf, ~20 instructions, and two of them were ~40% of the race's loop
    (~100 instructions a token in its sm_90 PTX). lg2.approx has an absolute error near
    2**-22, so E's relative error stays under ~1.2e-6 where E > 0.13, and the key moves by
    less than its own float32 step (~2e-6 at 16). A winner's E is small (u near 1): for
    u > 7/8, E is the series of -log(1 - w), w = 1 - u exact, to w**7 (relative error
    under 1e-7)."""
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
def _gumbel_race(x_ptr, lo, hi, inv_t, pivot, key, counter0, BLOCK: tl.constexpr):
    """The race over tokens [lo, hi) scoring above pivot: (best key, its first index)."""
    lanes = tl.arange(0, BLOCK)
    win_key = tl.full([BLOCK], float("-inf"), tl.float32)
    win_idx = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(lo, hi, BLOCK):
        i = start + lanes
        s = _scores(x_ptr, start, hi, inv_t, BLOCK)
        u = _uniforms(key, counter0, start, BLOCK)
        win_key, win_idx = _race_lanes(s, u, i, pivot, win_key, win_idx)
    return _first_max(win_key, win_idx)


@triton.jit
def _mass_above(x_ptr, lo, hi, inv_t, s_t, m, BLOCK: tl.constexpr):
    """Softmax mass (relative to exp(m)) of tokens [lo, hi) scoring above s_t."""
    above = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        s = _scores(x_ptr, start, hi, inv_t, BLOCK)
        above += tl.where(s > s_t, tl.exp(s - m), 0.0)
    return tl.sum(above, axis=0)


@triton.jit
def _row(row, logits_ptr, stride_logits, temps_ptr, top_ps_ptr, TOP_P: tl.constexpr):
    """Row row's (logits, top_p, greedy, 1 / T); top_p 1 unless TOP_P (a launch whose rows
    all have top_p 1 skips its work)."""
    x_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    if TOP_P:
        top_p = tl.load(top_ps_ptr + row)
    else:
        top_p = tl.full([], 1.0, tl.float32)
    return x_ptr, top_p, greedy, inv_t


@triton.jit
def _top_k_on(row, temps_ptr, top_ks_ptr, num_cols):
    """(whether row row samples among its top k, k): k in (0, num_cols), not greedy."""
    k = tl.load(top_ks_ptr + row)
    return (k > 0) & (k < num_cols) & (tl.load(temps_ptr + row) != 0.0), k


@triton.jit
def _kth_key(keys, m, KEY_BITS: tl.constexpr):
    """The m-th largest of keys (a tensor of _keys), by bisection from the top bit: the
    largest t with at least m keys at or above it. 0 where fewer than m keys exceed 0."""
    ans = tl.zeros([], keys.dtype)
    for b in tl.static_range(KEY_BITS):
        t = ans | (1 << (KEY_BITS - 1 - b))
        ans = tl.where(tl.sum((keys >= t).to(tl.int32), axis=0) >= m, t, ans)
    return ans


@triton.jit(do_not_specialize=["num_cols", "chunk", "num_chunks"])
def _bound_kernel(
    logits_ptr, stride_logits, bound_ptr, count_ptr, temps_ptr, top_ks_ptr, num_cols, chunk,
    num_chunks, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (c, row) of a top-k row: chunk c's bound on the row's floor, the m-th
    largest of its lanes' maxima (a lane past the row's end holds -inf), m = ceil(k /
    the row's whole chunks). A short last chunk bounds nothing (2**KEY_BITS, above any
    key): its few logits' maxima would drag the least bound down (gpt2's 50,257 logits
    in chunks of 7,168 leave 81, and their largest is no bound for 50). A row of one
    short chunk takes m = k. Program 0 also zeroes the row's count for _gather_kernel."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    on, k = _top_k_on(row, temps_ptr, top_ks_ptr, num_cols)
    if not on:
        return
    if c == 0:
        tl.store(count_ptr + row, 0)
    at = bound_ptr + row.to(tl.int64) * num_chunks + c
    lo = c * chunk
    hi = tl.minimum(lo + chunk, num_cols)
    whole = num_cols // chunk
    if (hi - lo < chunk) & (whole > 0):
        tl.store(at, tl.full([], 1 << KEY_BITS, tl.int64))
        return
    x_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        x = _block(x_ptr, start, hi, float("-inf"), BLOCK)
        lane_max = tl.maximum(lane_max, x.to(tl.float32))
    m = tl.where(whole > 0, (k + whole - 1) // tl.maximum(whole, 1), k)
    lane_keys = _keys(lane_max.to(logits_ptr.dtype.element_ty), KEY_BITS)  # (exact)
    tl.store(at, _kth_key(lane_keys, m, KEY_BITS).to(tl.int64))


@triton.jit(do_not_specialize=["num_cols", "chunk", "num_chunks"])
def _gather_kernel(
    logits_ptr, stride_logits, bound_ptr, count_ptr, cand_ptr, temps_ptr, top_ks_ptr,
    num_cols, chunk, num_chunks, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr, CANDIDATES: tl.constexpr,
):  # fmt: skip
    """Program (c, row) of a top-k row: chunk c's logits at or above the row's bound (the
    least of its chunks'), appended to the row's candidates (the first CANDIDATES of
    them; the count goes on past it)."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    on, k = _top_k_on(row, temps_ptr, top_ks_ptr, num_cols)
    if not on:
        return
    chunks = tl.arange(0, MAX_CHUNKS)
    at = bound_ptr + row.to(tl.int64) * num_chunks + chunks
    bound = tl.min(tl.load(at, mask=chunks < num_chunks, other=1 << KEY_BITS), axis=0)
    low = _key_logit(bound, logits_ptr.dtype.element_ty, KEY_BITS)
    low = tl.where(low == low, low, float("-inf"))  # a NaN's key: m past the lanes (huge k)
    x_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    cand_row = cand_ptr + row.to(tl.int64) * CANDIDATES
    lo = c * chunk
    hi = tl.minimum(lo + chunk, num_cols)
    lanes = tl.arange(0, BLOCK)
    count = count_ptr + row + tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        # A place per taken logit, by an atomic of its own (few are taken: no reduction
        # of the block's lanes, no barrier; relaxed: no fence before the next loads).
        x = _block(x_ptr, start, hi, float("-inf"), BLOCK)
        take = (start + lanes < hi) & (x.to(tl.float32) >= low)
        pos = tl.atomic_add(count, 1, mask=take, sem="relaxed")
        tl.store(cand_row + pos, x, mask=take & (pos < CANDIDATES))


@triton.jit(do_not_specialize=["num_cols"])
def _floor_kernel(
    logits_ptr, stride_logits, count_ptr, cand_ptr, floor_ptr, temps_ptr, top_ks_ptr,
    num_cols, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, CANDIDATES: tl.constexpr,
):  # fmt: skip
    """Program row: its floor (-inf but on a top-k row), the k-th largest of its gathered
    logits; past CANDIDATES of them, of its whole row (one stream a key bit)."""
    row = tl.program_id(0)
    on, k = _top_k_on(row, temps_ptr, top_ks_ptr, num_cols)
    floor = tl.full([], float("-inf"), tl.float32)
    if on:
        dtype: tl.constexpr = logits_ptr.dtype.element_ty
        n = tl.load(count_ptr + row)
        if n <= CANDIDATES:
            i = tl.arange(0, CANDIDATES)
            x = tl.load(cand_ptr + row.to(tl.int64) * CANDIDATES + i, mask=i < n, other=0.0)
            keys = tl.where(i < n, _keys(x, KEY_BITS), 0)
            floor = _key_logit(_kth_key(keys, k, KEY_BITS), dtype, KEY_BITS)
        else:
            x_ptr = logits_ptr + row.to(tl.int64) * stride_logits
            lanes = tl.arange(0, BLOCK)
            ans = tl.zeros([], tl.int64)
            for b in range(KEY_BITS):
                t = ans | (tl.full([], 1, tl.int64) << (KEY_BITS - 1 - b))
                t_logit = _key_logit(t, dtype, KEY_BITS)
                at_or_above = tl.zeros([BLOCK], tl.int32)
                for start in range(0, num_cols, BLOCK):
                    x = _block(x_ptr, start, num_cols, float("-inf"), BLOCK).to(tl.float32)
                    at_or_above += ((start + lanes < num_cols) & (x >= t_logit)).to(tl.int32)
                ans = tl.where(tl.sum(at_or_above, axis=0) >= k, t, ans)
            floor = _key_logit(ans, dtype, KEY_BITS)
    tl.store(floor_ptr + row, floor)


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
def _decided(ws_row, x_ptr, rounds, num_chunks, inv_t, top_p, z, best,
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
        s_t = tl.load(x_ptr + t, mask=live & (t < _NONE), other=0.0).to(tl.float32) * inv_t
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
    logits_ptr, stride_logits, ws_ptr, floor_ptr, temps_ptr, top_ps_ptr, keys_ptr,
    bases_ptr, num_cols, chunk, num_chunks, rnd, FIRST: tl.constexpr, TOP_P: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):  # fmt: skip
    """Program (c, row): chunk c of its row. Round rnd's race over the chunk (unless the
    row is decided) and, FIRST, the chunk's max and first argmax besides, and its Z
    where TOP_P (else 0: Z only weighs a top_p). FIRST over a top-k row (TOP_K) takes the
    tokens at or above its floor alone (_floor_kernel's)."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    x_ptr, top_p, greedy, inv_t = _row(row, logits_ptr, stride_logits, temps_ptr, top_ps_ptr,
                                       TOP_P)  # fmt: skip
    ws_row = ws_ptr + row.to(tl.int64) * num_chunks * FIELDS
    at = ws_row + c * FIELDS
    lo = c * chunk
    hi = tl.minimum(lo + chunk, num_cols)
    counter0 = tl.load(bases_ptr + row) + rnd.to(tl.int64) * num_cols
    key = tl.load(keys_ptr + row)
    if FIRST:
        if TOP_K:
            floor = tl.load(floor_ptr + row)  # (-inf but on a top-k row)
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
            x = _block(x_ptr, start, hi, float("-inf"), BLOCK).to(tl.float32)
            s = x * inv_t
            if TOP_K:
                s = tl.where(x >= floor, s, float("-inf"))
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
            ws_row, x_ptr, rnd, num_chunks, inv_t, top_p, z, best, FIELDS, MAX_CHUNKS
        )
        if done != 0:
            return
        # Above the pivot (a rejected token of the set), every token is in a top-k set too.
        top, t = _gumbel_race(x_ptr, lo, hi, inv_t, pivot, key, counter0, BLOCK)
        tl.store(at + 3 + 3 * rnd, top)
        tl.store(at + 4 + 3 * rnd, t.to(tl.float32))


@triton.jit(do_not_specialize=["num_cols", "chunk", "num_chunks", "rnd"])
def _mass_kernel(
    logits_ptr, stride_logits, ws_ptr, temps_ptr, top_ps_ptr, num_cols, chunk, num_chunks,
    rnd, BLOCK: tl.constexpr, FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):  # fmt: skip
    """Program (c, row): the mass of chunk c's tokens scoring above round rnd's winner,
    for rows with a top_p still undecided (the tokens above it are in any top-k set)."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    x_ptr, top_p, greedy, inv_t = _row(row, logits_ptr, stride_logits, temps_ptr, top_ps_ptr,
                                       True)  # fmt: skip
    if greedy | (top_p >= 1.0):
        return
    ws_row = ws_ptr + row.to(tl.int64) * num_chunks * FIELDS
    m, best, z = _combine_stats(ws_row, num_chunks, FIELDS, MAX_CHUNKS)
    done, token, pivot = _decided(
        ws_row, x_ptr, rnd, num_chunks, inv_t, top_p, z, best, FIELDS, MAX_CHUNKS
    )
    if done != 0:
        return
    t = _combine_race(ws_row, rnd, num_chunks, FIELDS, MAX_CHUNKS)
    s_t = tl.load(x_ptr + t).to(tl.float32) * inv_t
    lo = c * chunk
    mass = _mass_above(x_ptr, lo, tl.minimum(lo + chunk, num_cols), inv_t, s_t, m, BLOCK)
    tl.store(ws_row + c * FIELDS + 5 + 3 * rnd, mass)


@triton.jit(do_not_specialize=["num_cols", "num_chunks", "split_rounds"])
def _finish_kernel(
    logits_ptr, stride_logits, ws_ptr, out_ptr, temps_ptr, top_ps_ptr, keys_ptr, bases_ptr,
    num_cols, num_chunks, split_rounds, TOP_P: tl.constexpr, BLOCK: tl.constexpr,
    FIELDS: tl.constexpr, MAX_CHUNKS: tl.constexpr, MAX_ROUNDS: tl.constexpr,
):  # fmt: skip
    """Program row: its token. The split rounds' verdict, else further rounds over the
    whole row by this program alone (rare: see the module docstring)."""
    row = tl.program_id(0)
    x_ptr, top_p, greedy, inv_t = _row(row, logits_ptr, stride_logits, temps_ptr, top_ps_ptr,
                                       TOP_P)  # fmt: skip
    ws_row = ws_ptr + row.to(tl.int64) * num_chunks * FIELDS
    m, best, z = _combine_stats(ws_row, num_chunks, FIELDS, MAX_CHUNKS)
    token = best
    if not greedy:
        done, token, pivot = _decided(
            ws_row, x_ptr, split_rounds, num_chunks, inv_t, top_p, z, best, FIELDS, MAX_CHUNKS
        )
        key = tl.load(keys_ptr + row)
        base = tl.load(bases_ptr + row)
        rnd = split_rounds
        while (rnd < MAX_ROUNDS) & (done == 0):
            counter0 = base + rnd * num_cols
            top, t = _gumbel_race(x_ptr, 0, num_cols, inv_t, pivot, key, counter0, BLOCK)
            s_t = tl.load(x_ptr + t).to(tl.float32) * inv_t
            accept = _mass_above(x_ptr, 0, num_cols, inv_t, s_t, m, BLOCK) < top_p * z
            token = tl.where(accept, t, token)
            pivot = tl.where(accept, pivot, s_t)
            done = accept.to(tl.int32)
            rnd += 1
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_tokens(
    logits: torch.Tensor,  # [N, C]
    temperatures: torch.Tensor,  # [N] float32; 0: greedy (the first argmax)
    top_ks: torch.Tensor,  # [N] int64: k of each row's top-k; off at 0 or at least C
    top_ps: torch.Tensor,  # [N] float32 in (0, 1]
    keys: torch.Tensor,  # [N] int64: Philox keys
    bases: torch.Tensor,  # [N] int64: Philox counter bases
    out: torch.Tensor,  # [N] int64: each row's token id
    any_top_p: bool = True,  # False: every row's top_p taken as 1 (no mass launches)
    any_top_k: bool = True,  # False: every row's top_k taken as off (no floor launches)
) -> torch.Tensor:
    """One token per row into out, as the module docstring describes.

    Never reads device data on the host. Triton compiles a kernel per launch form (the
    flags, the logits' width in bits) and per class of the logits' strides (divisible
    by 16 or not); the widths and the chunking are not specialised on, so nothing
    compiles mid-serving.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits: [N, C], columns contiguous"
    # The workspace keeps indices as float32: exact below 2**24 columns (vocabularies: < 300K).
    assert logits.shape[1] < 2**24, "logits: more columns than the workspace indexes exactly"
    key_bits = logits.element_size() * 8
    assert key_bits in (16, 32), "logits: 16- or 32-bit floats"
    num_rows, num_cols = logits.shape
    if num_rows == 0:
        return out
    chunk, num_chunks = chunking(num_rows, num_cols)
    split = (num_chunks, num_rows)
    fields = 3 + 3 * SPLIT_ROUNDS  # per (row, chunk): max, argmax, Z; per round: key, index, mass
    ws = torch.empty(num_rows * num_chunks * fields, dtype=torch.float32, device=out.device)
    floor = ws  # (unread without any_top_k)
    if any_top_k:
        counts = torch.empty(num_rows, dtype=torch.int32, device=out.device)
        floor = torch.empty(num_rows, dtype=torch.float32, device=out.device)
        bounds = torch.empty(num_rows * num_chunks, dtype=torch.int64, device=out.device)
        cand = torch.empty(num_rows * CANDIDATES, dtype=logits.dtype, device=out.device)
        rows_k = (logits, logits.stride(0))
        top_k = (temperatures, top_ks, num_cols)
        _bound_kernel[split](*rows_k, bounds, counts, *top_k, chunk, num_chunks,
                             KEY_BITS=key_bits, BLOCK=BLOCK, num_warps=NUM_WARPS)  # fmt: skip
        _gather_kernel[split](
            *rows_k, bounds, counts, cand, *top_k, chunk, num_chunks, KEY_BITS=key_bits,
            BLOCK=BLOCK, MAX_CHUNKS=MAX_CHUNKS, CANDIDATES=CANDIDATES, num_warps=NUM_WARPS,
        )  # fmt: skip
        _floor_kernel[(num_rows,)](
            *rows_k, counts, cand, floor, *top_k, KEY_BITS=key_bits, BLOCK=FINISH_BLOCK,
            CANDIDATES=CANDIDATES, num_warps=FINISH_WARPS,
        )  # fmt: skip
    rows = (logits, logits.stride(0), ws)
    forms = dict(BLOCK=BLOCK, FIELDS=fields, MAX_CHUNKS=MAX_CHUNKS)
    rounds = num_split_rounds(num_rows, num_cols, any_top_p)
    for rnd in range(rounds):
        _race_kernel[split](
            *rows, floor, temperatures, top_ps, keys, bases, num_cols, chunk, num_chunks,
            rnd, FIRST=rnd == 0, TOP_P=any_top_p, TOP_K=any_top_k, **forms,
            num_warps=NUM_WARPS,
        )  # fmt: skip
        if any_top_p:
            _mass_kernel[split](
                *rows, temperatures, top_ps, num_cols, chunk, num_chunks, rnd, **forms,
                num_warps=NUM_WARPS,
            )  # fmt: skip
    _finish_kernel[(num_rows,)](
        *rows, out, temperatures, top_ps, keys, bases, num_cols, num_chunks, rounds,
        TOP_P=any_top_p, **(forms | dict(BLOCK=FINISH_BLOCK)), MAX_ROUNDS=MAX_ROUNDS,
        num_warps=FINISH_WARPS,
    )  # fmt: skip
    return out


def num_split_rounds(num_rows: int, num_cols: int, any_top_p: bool) -> int:
    """The rejection rounds a launch runs split over the rows' chunks: without a top_p round 0
    decides; a launch of few logits leaves its rare later rounds to the finishing program."""
    return SPLIT_ROUNDS if any_top_p and num_rows * num_cols > ONE_ROUND_LOGITS else 1


def chunking(num_rows: int, num_cols: int) -> tuple[int, int]:
    """(chunk, num_chunks): each row split into chunks of whole BLOCKs, enough of them for
    about TARGET_PROGRAMS programs a launch (one row alone still spreads over the SMs),
    at most MAX_CHUNKS."""
    blocks = triton.cdiv(num_cols, BLOCK)
    per_row = max(1, min(blocks, MAX_CHUNKS, triton.cdiv(TARGET_PROGRAMS, num_rows)))
    chunk = triton.cdiv(blocks, per_row) * BLOCK
    return chunk, triton.cdiv(num_cols, chunk)
