"""A step's sampled rows to tokens, and the random state they draw from.

On CUDA, kernels.sampling draws with Philox keys: a seeded request's key is its seed
and its counter its position, so its tokens do not depend on the batch it rides in;
an unseeded row's key is drawn per step from a Random seeded by the engine's seed. On
the CPU, torch ops draw from torch Generators: one per seeded request (made on its
first sampled step, dropped by release), and the engine's for the rest.
"""

from __future__ import annotations

import operator
import random

import torch

from replica.runner.sampling_batch import SamplingBatch, sample, sample_fused
from replica.sequence import Sequence

_GREEDY = operator.attrgetter("greedy")


def all_greedy(seqs: list[Sequence]) -> bool:
    """Whether every sequence samples greedily: a C-level pass, 256 rows a step on the hot
    path."""
    return all(map(_GREEDY, seqs))


class StepSampler:
    def __init__(
        self, device: torch.device, vocab_size: int, seed: int, fused: bool | None = None
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        # kernels.sampling, else torch ops; by default on CUDA (the runner's CPU graph
        # emulation asks for the kernels on the CPU too)
        self.fused = device.type == "cuda" if fused is None else fused
        self.step_keys = random.Random(seed)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampling parameters of seqs' rows, in order."""
        if all_greedy(seqs):
            return SamplingBatch.greedy()
        params = [s.params for s in seqs]
        if self.fused:  # a seeded row's key is its seed, its counter its position
            return SamplingBatch.build(
                params, [None] * len(seqs), self.vocab_size, self.device,
                positions=[len(s) for s in seqs], step_key=self.step_key(),
            )  # fmt: skip
        # An extras row samples again from its processed logits (replica.runner.
        # extras_path), drawing from its own generator there: here it draws from the
        # engine's, so that its generator moves once a step, as a plain row's does.
        generators = [None if s.params.needs_extras else self.request_generator(s) for s in seqs]
        return SamplingBatch.build(params, generators, self.vocab_size, self.device)

    def sample(
        self,
        logits: list[torch.Tensor],  # per forward that samples: [rows, vocab]
        slots: list[torch.Tensor],  # [rows]: each row's token_buf entry
        greedy: list[torch.Tensor | None],  # [rows]: the argmax a forward took, or None
        sampling: SamplingBatch,
        token_buf: torch.Tensor,  # [table rows]: the last token per slot
    ) -> torch.Tensor:  # [all rows]
        """Every forward's sampled rows as tokens, in order, written to token_buf too."""
        cat = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts)  # noqa: E731
        if sampling.all_greedy:
            # Each forward's argmax on its own: no [rows, vocab] concatenation (a step that
            # ran a prefill and a decode forward copied both logits into a new buffer).
            greedy = list(greedy)
            for i, part in enumerate(greedy):
                if part is None:  # a prefill forward's rows: not argmaxed in its graph
                    greedy[i] = logits[i].argmax(dim=-1)
                    token_buf.index_copy_(0, slots[i], greedy[i])
            return cat(greedy)
        rows = cat(logits)
        if self.fused:
            tokens = sample_fused(rows, sampling)
        else:
            tokens = sample(rows, sampling, self.generator)
        token_buf.index_copy_(0, cat(slots), tokens)
        return tokens

    def step_key(self) -> int:
        """A step's Philox key for its unseeded rows (the sampling graphs' too)."""
        return self.step_keys.getrandbits(63)

    def release(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def request_generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded request's own generator (made on its first sampled step), else None."""
        seed = seq.params.seed
        if seed is None:
            return None
        gen = self.request_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.request_generators[seq.request_id] = gen
        return gen
