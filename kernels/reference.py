"""Torch references for every kernel in kernels/.

These define the semantics; each Triton kernel is tested against its reference
under TRITON_INTERPRET=1, and the CPU model runner uses them directly.

Cache layout: one tensor for the whole model,
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
and the kernels take one layer's views k_cache = kv_cache[l, 0], v_cache = kv_cache[l, 1]:
    [num_blocks, block_size, num_kv_heads, head_dim], each token's row contiguous.
A token at position `pos` of the sequence in table row `slot` lives at
    block = block_table[slot, pos // block_size], offset = pos % block_size.
All index tensors are int32 (int64 accepted by the references).
A cache holds the model's dtype, or float8_e4m3fn (quantize_kv_ref) read back exactly.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype stores it: a cast, or for an fp8 cache the nearest
    e4m3 value (ties to even) saturated at +-448, with no scale (kernels.kv_quant)."""
    if cache_dtype == FP8_KV_DTYPE:
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def append_kv_ref(
    k: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_writes]
    offsets: torch.Tensor,  # [num_writes]
    src_rows: torch.Tensor | None = None,  # [num_writes]; None: row i is write i
) -> None:
    """Generic form: write k[src_rows[i]] at (block_ids[i], offsets[i])."""
    rows = src_rows.long() if src_rows is not None else slice(None, block_ids.shape[0])
    k_cache[block_ids.long(), offsets.long()] = quantize_kv_ref(k[rows], k_cache.dtype)
    v_cache[block_ids.long(), offsets.long()] = quantize_kv_ref(v[rows], v_cache.dtype)


def append_kv_slots_ref(
    k: torch.Tensor,  # [B, num_kv_heads, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [B]: the table row of batch row i
    positions: torch.Tensor | int,  # [B], or one position for every row
) -> None:
    """Identity-batch form: batch row i writes one token at its own position."""
    block_size = k_cache.shape[1]
    num_rows = k.shape[0]
    if isinstance(positions, int):
        positions = torch.full((num_rows,), positions, dtype=torch.long, device=k.device)
    positions = positions.long()
    block_ids = block_table[slot_mapping.long(), positions // block_size]
    append_kv_ref(k, v, k_cache, v_cache, block_ids, positions % block_size)


def append_kv_prefill_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], sequences packed
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [num_seqs]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1]: sequence i owns rows cu[i]:cu[i+1]
    start_positions: torch.Tensor,  # [num_seqs]: position of each sequence's first row
) -> None:
    """Prefill form: many tokens per sequence, variable lengths packed together."""
    positions, slots = _packed_positions(cu_seqlens, start_positions, slot_mapping)
    append_kv_slots_ref(k, v, k_cache, v_cache, block_table, slots, positions)


def _packed_positions(
    cu_seqlens: torch.Tensor, start_positions: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_of_row = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    row_in_seq = (
        torch.arange(int(lens.sum()), device=lens.device) - cu_seqlens[:-1].long()[seq_of_row]
    )
    return start_positions.long()[seq_of_row] + row_in_seq, slot_mapping.long()[seq_of_row]


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_seq]
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table_row[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def _attend(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [ctx_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """Causal attention of the last q_len positions of a ctx_len context, in float32."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, q, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, q, ctx]
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
    k_pos = torch.arange(ctx_len, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [B]
    context_lens: torch.Tensor,  # [B]: tokens in cache, the query's own included
    scale: float,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim]
) -> torch.Tensor:
    """One query token per sequence attends to all context_lens[i] cached tokens."""
    out = torch.empty_like(q) if out is None else out
    slots = slot_mapping.tolist()
    lens = context_lens.tolist()
    for i, (slot, ctx_len) in enumerate(zip(slots, lens)):
        k = gather_context(k_cache, block_table[slot], ctx_len)
        v = gather_context(v_cache, block_table[slot], ctx_len)
        out[i] = _attend(q[i : i + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor,  # [num_seqs]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]: cached prefix + this chunk, all in cache
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill chunk over its cached prefix and itself.

    Sequence i's queries are the last (cu[i+1] - cu[i]) of its context_lens[i]
    positions; their K/V must already be appended to the cache.
    """
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    for i, (slot, ctx_len) in enumerate(zip(slot_mapping.tolist(), context_lens.tolist())):
        k = gather_context(k_cache, block_table[slot], ctx_len)
        v = gather_context(v_cache, block_table[slot], ctx_len)
        out[cu[i] : cu[i + 1]] = _attend(q[cu[i] : cu[i + 1]], k, v, scale)
    return out


def copy_blocks_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_copies]
    dst: torch.Tensor,  # [num_copies]
) -> None:
    """Copy whole blocks src[i] -> dst[i] in every layer's K and V (copy-on-write)."""
    kv_cache[:, :, dst.long()] = kv_cache[:, :, src.long()]


def scatter_table_rows_ref(
    table: torch.Tensor,  # [num_table_rows, width] int32
    header: torch.Tensor,  # [1 + max_rows] int64: count, then the table row of each row
    rows: torch.Tensor,  # [max_rows, width] int32
) -> None:
    """table[header[1 + i]] = rows[i] for i < header[0]."""
    count = int(header[0])
    table.index_copy_(0, header[1 : 1 + count], rows[:count])


def argmax_rows_ref(
    x: torch.Tensor,  # [num_rows, num_cols]
    out: torch.Tensor | None = None,
    *,
    token_buf: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_rows] int64
    """The first index of each row's maximum (kernels.argmax's reference; greedy on CPU),
    also written to token_buf[token_rows] when given."""
    index = x.argmax(dim=-1)
    if out is not None:
        index = out.copy_(index)
    if token_buf is not None:
        token_buf.index_copy_(0, token_rows, index)
    return index


def apply_penalties_ref(
    logits: torch.Tensor,  # [E, vocab] float32; rows 0..P-1 change, in place
    counts: torch.Tensor,  # [R, vocab] int32 output-token counts
    prompt_mask: torch.Tensor,  # [R, vocab] bool
    state_rows: torch.Tensor,  # [P] int64
    penalties: torch.Tensor,  # [3, P] float32: repetition, frequency, presence
    any_repetition: bool,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties over logits' first P rows
    (kernels.penalties' reference; the CPU path): row i reads counts[state_rows[i]]."""
    num_rows = state_rows.shape[0]
    if num_rows == 0:
        return logits
    rows = logits[:num_rows]  # [P, vocab]
    row_counts = counts.index_select(0, state_rows)  # [P, vocab] int32
    seen = row_counts > 0
    repetition, frequency, presence = penalties.unsqueeze(2)  # each [P, 1]
    if any_repetition:
        seen_any = seen | prompt_mask.index_select(0, state_rows)
        penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
        rows = torch.where(seen_any, penalized, rows)
    torch.sub(rows - frequency * row_counts, presence * seen, out=logits[:num_rows])
    return logits


def resolve_placeholders_ref(
    ids: torch.Tensor, token_buf: torch.Tensor, token_rows: torch.Tensor
) -> torch.Tensor:
    """ids with each negative entry replaced by token_buf[token_rows[row]]."""
    return torch.where(ids >= 0, ids, token_buf[token_rows])


_MASK32 = 0xFFFFFFFF
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul32(a: torch.Tensor, b: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * b for a, b in [0, 2**32), in int64 without overflow."""
    x = (a & 0xFFFF) * b  # < 2**48
    y = (a >> 16) * b
    return (y + (x >> 16)) >> 16, (((y & 0xFFFF) << 16) + x) & _MASK32


def philox_uint32_ref(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Triton's tl.randint(key, counter): Philox4x32-10's first word, as int64 in
    [0, 2**32). key: int64 (broadcast against counter), counter: int64 >= 0."""
    return philox_words_ref(key, counter)[0]


def philox_words_ref(key: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton's tl.randint4x(key, counter): Philox4x32-10's four words, as philox_uint32_ref."""
    key = key.to(torch.int64)
    c0, c1 = counter & _MASK32, counter >> 32
    c2 = c3 = torch.zeros_like(counter)
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mul32(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def sample_tokens_ref(
    logits: torch.Tensor,  # [N, C]
    temperatures: torch.Tensor,  # [N] float32
    top_ks: torch.Tensor,  # [N] int64: off at 0 or at least C
    top_ps: torch.Tensor,  # [N] float32
    keys: torch.Tensor,  # [N] int64
    bases: torch.Tensor,  # [N] int64
    out: torch.Tensor,  # [N] int64
    max_rounds: int = 64,
) -> torch.Tensor:
    """kernels.sampling.sample_tokens in torch: greedy rows take the first argmax; the
    others sample among the tokens at or above their k-th largest logit (top-k, ties
    kept), temperature then top-p, by rounds of a Gumbel race over the tokens above a
    pivot, each accepted when the tokens scoring above it hold less than top_p of the mass."""
    num_rows, num_cols = logits.shape
    temp, top_p = temperatures.float(), top_ps.float()
    greedy = temp == 0
    inv_t = torch.where(greedy, torch.ones_like(temp), 1.0 / temp)
    x = logits.float()  # exact for 16-bit logits: the same order and ties
    k = top_ks.long()
    top_k = (k > 0) & (k < num_cols) & ~greedy
    kth = x.sort(dim=1, descending=True).values.gather(1, (k.clamp(1, num_cols) - 1)[:, None])
    floor = torch.where(top_k[:, None], kth, float("-inf"))
    cols = torch.arange(num_cols, device=logits.device)
    s = torch.where(x >= floor, x * inv_t[:, None], float("-inf"))
    m = s.max(dim=1).values
    token = s.argmax(dim=1)  # the first maximum
    z = torch.exp(s - m[:, None]).sum(dim=1)
    pivot = torch.full_like(m, float("-inf"))
    done = greedy.clone()
    counter = bases[:, None] + cols[None, :] // 4  # token i: word i % 4
    word = (cols % 4)[None, :].expand(num_rows, -1)
    for rnd in range(max_rounds):
        if bool(done.all()):
            break
        words = philox_words_ref(keys[:, None], counter + rnd * num_cols)
        bits = torch.stack(words, dim=-1).gather(-1, word[..., None])[..., 0]
        u = ((bits >> 9).float() + 0.5) * (1.0 / 8388608.0)
        race = torch.where(s > pivot[:, None], s - torch.log(-torch.log(u)), float("-inf"))
        t = race.argmax(dim=1)
        s_t = s.gather(1, t[:, None])[:, 0]
        above = torch.where(s > s_t[:, None], torch.exp(s - m[:, None]), 0.0).sum(dim=1)
        accept = ~done & ((top_p >= 1) | (above < top_p * z))
        token = torch.where(accept, t, token)
        pivot = torch.where(done | accept, pivot, s_t)
        done |= accept
    out.copy_(token.to(out.dtype))
    return out
