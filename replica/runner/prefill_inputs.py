"""Persistent prefill inputs: one packed buffer, filled by one host-to-device copy per step.

A prefill step runs over a bucket of (tokens, sequences). On CUDA the bucket is
the next captured size, so the step can replay a CUDA graph: padding tokens
write their K/V to the null block (their table row is the null row) and the
attention work list skips them; padding sequences are empty chunks. On CPU the
bucket is the exact size, so the same buffers feed the eager reference path.

Layout of the int64 buffer (fixed offsets, sized for the largest bucket):
input ids, positions and table rows per token; table row, context length,
start position, cu_seqlens, logit row and sampled slot per sequence; the
attention work lists (chunks, short chunks and long chunks:
kernels.prefill_attention). Host staging alternates between two copies (the
model runner's parity), so a step's inputs are never overwritten while its copy
may still be pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from kernels.prefill_attention import (
    long_chunks,
    prefill_block_q,
    prefill_short_q,
    prefill_tiles,
    prefill_work_capacity,
    prefill_work_list,
)
from replica.attention import AttentionMetadata
from replica.sequence import Sequence

_COMPUTED, _SLOT, _TOKENS = (attrgetter(a) for a in ("num_computed_tokens", "slot", "token_ids"))


@dataclass(frozen=True)
class PrefillBucket:
    """The padded shape of one prefill step (one CUDA graph on CUDA)."""

    num_tokens: int
    num_seqs: int  # sequence rows and logit rows
    num_work: int  # attention work-list capacity (the short chunks' list: num_seqs)
    num_long_work: int  # the long chunks' list; 0: none (no long chunk, or no long tile)


@dataclass(frozen=True)
class PrefillStep:
    """What the host filled for one step: the bucket and which sequences sample a token."""

    bucket: PrefillBucket
    done: list[Sequence]  # sequences whose chunk reaches their last token, in logit-row order


def prefill_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Captured prefill sizes: powers of 2 from 16 to 1024, then steps of 1024, then the max."""
    sizes = [16 << i for i in range(7) if 16 << i < max_num_batched_tokens]
    sizes += list(range(2048, max_num_batched_tokens, 1024))
    return sorted(set(sizes + [max_num_batched_tokens]))


class PrefillInputs:
    """The prefill half of the model runner's persistent device inputs."""

    _TOKEN_FIELDS = ("ids", "positions", "token_slots")
    _SEQ_FIELDS = ("seq_slots", "context_lens", "start_positions", "last_rows", "done_slots")

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cache_dtype: torch.dtype,
        null_row: int,
        device: torch.device,
        padded: bool,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.null_row = null_row
        tiles = prefill_tiles(head_dim, cache_dtype)
        self.block_q = prefill_block_q(num_heads, num_kv_heads, tiles.main.rows)
        self.short_q = prefill_short_q(num_heads, num_kv_heads)
        # Query tokens per long-list entry; 0: the model has no long tile, nor the list.
        self.long_q = prefill_block_q(num_heads, num_kv_heads, tiles.long.rows) if tiles.long else 0
        self.padded = padded
        self.token_buckets = prefill_token_buckets(max_num_tokens) if padded else []
        self.device = device
        max_work = prefill_work_capacity(max_num_tokens, max_num_seqs, self.block_q)
        max_long = self.bucket(max_num_tokens, max_num_seqs, long=True).num_long_work
        offsets: dict[str, tuple[int, int]] = {}
        size = 0
        for name, n in (
            *((f, max_num_tokens) for f in self._TOKEN_FIELDS),
            *((f, max_num_seqs) for f in self._SEQ_FIELDS),
            ("cu_seqlens", max_num_seqs + 1),
            ("work", 2 * max_work),
            ("short_work", 2 * max_num_seqs),  # at most one entry a sequence
            ("long_work", 2 * max_long),
        ):
            offsets[name] = (size, n)
            size += n
        self.offsets = offsets
        self.size = size
        pin = device.type == "cuda"
        self.staging = torch.zeros((2, size), dtype=torch.int64, pin_memory=pin)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self._device_views: dict[PrefillBucket, dict[str, torch.Tensor]] = {}
        self._host_views: dict[tuple[int, PrefillBucket], dict[str, np.ndarray]] = {}

    def bucket(self, num_tokens: int, num_seqs: int, long: bool = False) -> PrefillBucket:
        """The padded shape for a step: the next captured token size on CUDA, exact on CPU.

        long: the step has long chunks (kernels.prefill_attention.long_chunks), so the
        bucket has a long list, where the model has a long tile. A step without them
        gets none: that list's empty programs, on the long tile's registers and shared
        memory, took ~0.3 ms of each of the qwen3 burst's 8K-token steps (H200).
        """
        if self.padded:
            num_tokens = next(t for t in self.token_buckets if t >= num_tokens)
            num_seqs = min(num_tokens, self.max_num_seqs)
        work = prefill_work_capacity(num_tokens, num_seqs, self.block_q)
        num_long = 0
        if long and self.long_q:  # a long chunk has more than short_q tokens
            most = min(num_seqs, num_tokens // (self.short_q + 1))
            num_long = prefill_work_capacity(num_tokens, most, self.long_q)
        return PrefillBucket(num_tokens, num_seqs, work, num_long)

    def buckets(self) -> list[PrefillBucket]:
        """Every captured shape: each token bucket, with and without a long list."""
        variants = (False, True) if self.long_q else (False,)
        return [self.bucket(t, 0, long) for t in self.token_buckets for long in variants]

    def fill(
        self,
        seqs: list[Sequence],
        lens: list[int],
        parity: int,
        bucket: PrefillBucket | None = None,
    ) -> PrefillStep:
        """Write one step's inputs into staging[parity] and copy them to the device.

        bucket: the padded shape (default: self.bucket for this step's sizes).
        """
        q_lens = np.asarray(lens, dtype=np.int64)
        starts = np.fromiter(map(_COMPUTED, seqs), np.int64, len(seqs))
        slots = np.fromiter(map(_SLOT, seqs), np.int64, len(seqs))
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        ends = starts + q_lens
        is_done = ends == np.fromiter(map(len, map(_TOKENS, seqs)), np.int64, len(seqs))
        long = self.long_q > 0 and bool(long_chunks(q_lens, ends, self.short_q).any())
        bucket = bucket or self.bucket(num_tokens, len(seqs), long)
        v = self._host_views.get((parity, bucket))
        if v is None:
            v = self._host_views[parity, bucket] = self._views(self.staging[parity].numpy(), bucket)
        # A chunk of a prompt is a slice of its int64 ids; other tokens (a decode row's, or a
        # recomputed sequence's past its prompt) are Python ints, gathered into runs that
        # are converted once.
        pieces: list = []
        run: list[int] = []
        for seq, start, n in zip(seqs, starts.tolist(), lens, strict=True):
            if start + n <= seq.num_prompt_tokens:
                if run:
                    pieces.append(run)
                    run = []
                pieces.append(seq.prompt_ids[start : start + n])
            else:
                run += seq.token_ids[start : start + n]
        if run:
            pieces.append(run)
        if pieces:
            np.concatenate(pieces, out=v["ids"][:num_tokens])
        v["ids"][num_tokens:] = 0
        v["positions"][:num_tokens] = np.arange(num_tokens) + np.repeat(starts - cu[:-1], q_lens)
        v["positions"][num_tokens:] = 0
        v["token_slots"][:num_tokens] = np.repeat(slots, q_lens)
        v["token_slots"][num_tokens:] = self.null_row
        n = len(seqs)
        for name, values, pad in (
            ("seq_slots", slots, self.null_row),
            ("context_lens", ends, 0),
            ("start_positions", starts, 0),
        ):
            v[name][:n] = values
            v[name][n:] = pad
        v["cu_seqlens"][: n + 1] = cu
        v["cu_seqlens"][n + 1 :] = num_tokens
        num_done = int(is_done.sum())
        v["last_rows"][:num_done] = cu[1:][is_done] - 1
        v["last_rows"][num_done:] = 0
        v["done_slots"][:num_done] = slots[is_done]
        v["done_slots"][num_done:] = self.null_row
        prefill_work_list(
            q_lens, self.block_q, v["work"], v["short_work"], self.short_q, context_lens=ends,
            long_out=v["long_work"] if bucket.num_long_work else None,
            long_q=self.long_q if bucket.num_long_work else 0,
        )  # fmt: skip
        src = self.staging[parity]
        self.inputs.copy_(src, non_blocking=src.is_pinned())
        return PrefillStep(bucket, [s for s, d in zip(seqs, is_done.tolist()) if d])

    def fill_padding(self, parity: int) -> None:
        """Every row of the largest bucket as padding (for capturing graphs)."""
        self.fill([], [], parity, self.bucket(self.max_num_tokens, 0, long=True))

    def device_views(self, bucket: PrefillBucket) -> dict[str, torch.Tensor]:
        """Views of the device buffer for a bucket; made once per bucket (the buffer is fixed)."""
        views = self._device_views.get(bucket)
        if views is None:
            views = self._device_views[bucket] = self._views(self.inputs, bucket)
        return views

    def metadata(self, bucket: PrefillBucket, block_table: torch.Tensor) -> AttentionMetadata:
        v = self.device_views(bucket)
        return AttentionMetadata(
            is_decode=False,
            block_table=block_table,
            slot_mapping=v["seq_slots"],
            context_lens=v["context_lens"],
            positions=v["positions"],
            cu_seqlens_q=v["cu_seqlens"],
            start_positions=v["start_positions"],
            max_q_len=bucket.num_tokens,
            token_slots=v["token_slots"],
            prefill_work=v["work"],
            prefill_short_work=v["short_work"],
            prefill_long_work=v["long_work"] if bucket.num_long_work else None,
        )

    def _views(self, buf, bucket: PrefillBucket) -> dict:  # numpy or torch, same slicing
        sizes = {f: bucket.num_tokens for f in self._TOKEN_FIELDS}
        sizes |= {f: bucket.num_seqs for f in self._SEQ_FIELDS}
        sizes["cu_seqlens"] = bucket.num_seqs + 1
        sizes["work"] = 2 * bucket.num_work
        sizes["short_work"] = 2 * bucket.num_seqs
        sizes["long_work"] = 2 * bucket.num_long_work
        views = {name: buf[off : off + sizes[name]] for name, (off, _) in self.offsets.items()}
        views["work"] = views["work"].reshape(bucket.num_work, 2)
        views["short_work"] = views["short_work"].reshape(bucket.num_seqs, 2)
        views["long_work"] = views["long_work"].reshape(bucket.num_long_work, 2)
        return views
