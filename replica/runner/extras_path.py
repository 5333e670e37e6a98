"""ExtrasPath: a step's extras rows (logprobs, logits processors) beside its fast path.

A step with extras rows (Sequence.extras) first samples every row as it would without
them: the decode graph's argmax, the sampling graph, or the step sampler, which write
token_buf and the tokens the host copies. Then, for the E rows that ask logprobs or
process their logits only: their logits gathered from the forward's (float32), their
logprobs from those raw logits, the processors (replica.runner.logits_processors) over
them, their tokens sampled again from the processed logits (the argmax for greedy rows;
kernels.sample_tokens, or the torch path on the CPU, with the Philox key and counter
base, or the generator, that the row had on the fast path), and scattered over the fast
path's tokens and token_buf before the copy to the host.

The host's share is what sets its cost (~26 rows x vocab is nothing for the GPU, while
each launch and each copy costs the host microseconds): the Python here visits the E
rows only, every host input goes to the device in one copy from persistent pinned
staging (replica.runner.packed_upload), nothing waits for the device (a copy from
pageable memory, as torch.tensor(..., device=) makes, first waits for the stream, so for
the queued forward), and work no row asks for (logprobs, penalty state, sampling) is
skipped.
"""

from __future__ import annotations

import operator
from itertools import compress

import numpy as np
import torch

import kernels
from replica.runner.logits_processors import LogitsProcessors, has_penalties
from replica.runner.logprobs import PromptLogprobs, StepLogprobs, pack
from replica.runner.packed_upload import PackedUpload
from replica.runner.sampling import StepSampler
from replica.runner.sampling_batch import SamplingBatch, param_columns, sample
from replica.sampling_params import MAX_LOGPROBS
from replica.sequence import Sequence

_EXTRAS = operator.attrgetter("extras")


class ExtrasPath:
    """The extras rows' side path of a step (see the module docstring)."""

    def __init__(
        self,
        max_rows: int,  # the most rows a step samples
        vocab_size: int,
        device: torch.device,
        sampler: StepSampler,
        processors: LogitsProcessors,
        prompt_logprobs: PromptLogprobs,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = sampler
        self.processors = processors
        self.prompt_logprobs = prompt_logprobs
        self.upload = PackedUpload(device)
        # The logprobs' host staging, two copies by parity (a step's copy may be pending
        # while the next step fills the other); read by StepLogprobs.outputs in the drain
        # that follows the next launch, before the step after next reuses its copy.
        self.on_cpu = device.type == "cpu"
        width = 1 + 2 * MAX_LOGPROBS
        self.logprobs_host = torch.zeros(
            (2, max_rows * width), dtype=torch.float32, pin_memory=device.type == "cuda"
        )

    def run(
        self,
        logits: list[torch.Tensor],  # per forward that samples: [rows, vocab]
        slots: list[torch.Tensor],  # [rows]: each row's token_buf entry
        seqs: list[Sequence],  # the sampled rows' sequences, in order
        tokens: torch.Tensor,  # [len(seqs)] the fast path's tokens, the host copy's source
        token_buf: torch.Tensor,  # [table rows]
        step_key: int | None,  # the fast path's Philox key (None: it sampled none)
        parity: int,
    ) -> StepLogprobs:
        """Resample the extras rows into tokens and token_buf; their logprobs, and the
        prompt logprobs of the requests whose first token the step samples."""
        out = StepLogprobs()
        rows = list(compress(range(len(seqs)), map(_EXTRAS, seqs)))  # a C-level pass
        for row in rows:
            if seqs[row].params.prompt_logprobs is not None:
                parts = self.prompt_logprobs.take(seqs[row])
                if parts is not None:
                    out.prompts[row] = (seqs[row], parts)
        extras = [row for row in rows if seqs[row].params.needs_extras]
        if not extras:
            return out
        processing = any(seqs[row].params.processes_logits for row in extras)
        if processing:  # the rows with penalties first (LogitsProcessors.prepare)
            extras.sort(key=lambda row: not has_penalties(seqs[row]))
        extras_seqs = [seqs[row] for row in extras]
        params = [s.params for s in extras_seqs]
        lp_rows = [j for j, p in enumerate(params) if p.logprobs is not None]
        step = self.processors.prepare(extras_seqs) if processing else None
        sampled = not all(p.greedy for p in params)
        fused = sampled and self.sampler.fused
        arrays = [np.array(extras, np.int64)]
        if lp_rows and len(lp_rows) < len(extras):
            arrays.append(np.array(lp_rows, np.int64))
        if step is not None:
            arrays += step.arrays()
        if fused:
            temps, top_ps, ks, any_top_k, any_top_p = param_columns(params, self.vocab_size)
            seeds = [p.seed for p in params]
            keys = [step_key if seed is None else seed for seed in seeds]
            bases = [row if seed is None else len(s) for row, seed, s in
                     zip(extras, seeds, extras_seqs, strict=True)]  # fmt: skip
            arrays += [
                temps.astype(np.float32), top_ps.astype(np.float32), ks,
                np.array(keys, np.int64), np.array(bases, np.int64) << 32,
            ]  # fmt: skip
        views = iter(self.upload.upload(parity, arrays))
        index = next(views)  # [E]
        lp_index = next(views) if lp_rows and len(lp_rows) < len(extras) else None
        if step is not None:
            step = step.on_device(views)
        all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        rows_raw = all_logits.index_select(0, index)  # [E, vocab] in the model's dtype
        rows_logits = rows_raw.float()  # rows_raw itself if that is float32
        if lp_rows:  # of the model's logits, before the processors change them in place
            raw = rows_raw if lp_index is None else rows_raw.index_select(0, lp_index)
            logprobs = torch.log_softmax(raw, dim=-1, dtype=torch.float32)  # [L, vocab]
            # Ranked in the model's dtype: a 16-bit radix select takes half the passes of
            # a float32 one (topk over qwen3's 26 x 151,936 float32 logprobs: ~95 us of
            # an H200 step); the same order, as log_softmax keeps it.
            ks = [params[j].logprobs for j in lp_rows]
            width = max(ks)
            top_ids = raw.topk(width, dim=-1).indices if width else None
        if step is not None:
            self.processors.apply(rows_logits, step)
        if fused:
            temps, top_ps, ks, keys, bases = (next(views) for _ in range(5))
            extras_tokens = torch.empty(len(extras), dtype=torch.int64, device=self.device)
            kernels.sample_tokens(
                rows_logits, temps, ks, top_ps, keys, bases, extras_tokens,
                any_top_p=any_top_p, any_top_k=any_top_k,
            )  # fmt: skip
        elif sampled:  # the torch path (the CPU): each seeded row's own generator
            generators = [self.sampler.request_generator(s) for s in extras_seqs]
            batch = SamplingBatch.build(params, generators, self.vocab_size, self.device)
            extras_tokens = sample(rows_logits, batch, self.sampler.generator)
        else:
            extras_tokens = rows_logits.argmax(dim=-1)
        tokens.index_copy_(0, index, extras_tokens)
        all_slots = slots[0] if len(slots) == 1 else torch.cat(slots)
        token_buf.index_copy_(0, all_slots.index_select(0, index), extras_tokens)
        if step is not None:
            self.processors.record(extras_tokens, step)
        if lp_rows:
            targets = extras_tokens if lp_index is None else extras_tokens.index_select(0, lp_index)
            packed = pack(logprobs, targets, width, top_ids)  # [L, 1 + 2 width]
            out.rows = [extras[j] for j in lp_rows]
            out.ks = ks
            out.host = self._to_host(packed, parity)
        return out

    def _to_host(self, packed: torch.Tensor, parity: int) -> torch.Tensor:
        """packed's copy in this parity's pinned staging, not waited for (the step's
        token event, recorded after, covers it)."""
        if self.on_cpu:
            return packed
        host = self.logprobs_host[parity, : packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        return host
