"""The model runner's start-up warm-up: every device op a step may launch outside the graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import kernels
from replica.runner.sampling_batch import SamplingBatch, sample_fused
from replica.sampling_params import SamplingParams

if TYPE_CHECKING:
    from replica.runner.model_runner import ModelRunner


def warm_up(runner: ModelRunner) -> None:
    """Run every device op a step may launch outside the graphs once (at start-up).

    Their first use otherwise lands in the first steps that need them: CUDA loads a
    kernel's module on its first launch, Triton compiles a kernel on its first call,
    and the caching allocator grows. On an H200 the first step that sampled a prefill
    and a decode forward together had a launch of 7.5-9.6 ms against 1.2-1.9 for the
    next such step (256 prompts). Everything here writes only the null
    row and the null block.
    """
    rows, null = runner.max_num_seqs, runner.max_num_seqs  # the null row of token_buf
    logits = torch.zeros((rows, runner.vocab_size), dtype=runner.dtype, device=runner.device)
    slots = torch.full((rows,), null, dtype=torch.long, device=runner.device)
    greedy = runner.forwards.argmax_rows(logits, token_buf=runner.token_buf, token_rows=slots)
    half = rows - rows // 2  # a prefill forward's rows, then a decode forward's
    parts = [(logits[:half], slots[:half], None), (logits[half:], slots[half:], greedy[half:])]
    logits_parts, slot_parts, greedy_parts = (
        list(x) for x in zip(*(p for p in parts if len(p[1])), strict=True)
    )
    # Every form of kernels.sampling's launches (with top-k rows or not, top-p rows or
    # not), sampled rows beside greedy ones.
    sampled = (
        SamplingParams(temperature=0.5, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.9),
        SamplingParams(temperature=0.5),
    )
    batches = [SamplingBatch.greedy()]
    for kind in sampled:
        params = [SamplingParams(temperature=0.0) if i % 2 else kind for i in range(rows)]
        batches.append(
            SamplingBatch.build(
                params, [None] * rows, runner.vocab_size, runner.device, positions=[0] * rows
            )
        )
    host = runner.token_staging.host[runner.parity, :rows]
    generator = runner.sampler.generator
    state = generator.get_state()  # the warm-up draws no numbers a request would see
    for sampling in batches:
        tokens = runner.sampler.sample(
            logits_parts, slot_parts, greedy_parts, sampling, runner.token_buf
        )
        runner.token_staging.to_host(tokens, host, runner.parity).wait()
    generator.set_state(state)
    if runner.sampler.fused and runner.dtype != torch.float32:
        # The extras rows' side path samples their processed logits in float32
        # (replica.runner.extras_path): Triton compiles those launch forms apart.
        for sampling in batches[1:]:
            sample_fused(logits.float(), sampling)
    processors = runner.processors
    if processors.fused:  # kernels.penalties' two forms (repetition or not); counts only read
        rows_logits = logits[:1].float()
        state = torch.zeros(1, dtype=torch.long, device=runner.device)
        neutral = torch.tensor([[1.0], [0.0], [0.0]], device=runner.device)
        for repetition in (False, True):
            kernels.apply_penalties(
                rows_logits, processors.counts, processors.prompt_mask, state, neutral, repetition
            )
    runner.step_inputs.upload(
        runner.parity, False, runner.block_table.cpu().numpy(), [null], runner.block_table
    )
    block = torch.tensor([runner.null_block], device=runner.device)
    runner.backend.copy_blocks(runner.kv_cache, block, block)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
