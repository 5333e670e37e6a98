"""ModelRunner pieces that the engine tests do not isolate."""

from __future__ import annotations

import pytest
import torch

from replica import EngineConfig, LLMEngine, SamplingParams


def test_warm_up_touches_only_the_null_row_and_block():
    """The start-up warm-up runs the step's sampling, block-table upload and block copy on
    dummy data: it may write the null row of token_buf and the null block, nothing a request
    owns, and it leaves the sampling generator where it was."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=16, max_num_seqs=6))
    runner = engine.runner
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen))
        runner.token_buf.copy_(torch.randint(0, 100, runner.token_buf.shape, generator=gen))
        runner.block_table[:-1] = torch.randint(0, 16, runner.block_table[:-1].shape, generator=gen)
    kv, tokens, table = (t.clone() for t in (runner.kv_cache, runner.token_buf, runner.block_table))
    state = runner.sampler.generator.get_state()

    runner.warm_up()

    null_block, null_row = runner.null_block, runner.max_num_seqs
    assert torch.equal(runner.kv_cache[:, :, :null_block], kv[:, :, :null_block])
    assert torch.equal(runner.token_buf[:null_row], tokens[:null_row])
    assert torch.equal(runner.block_table[:null_row], table[:null_row])
    assert torch.equal(runner.sampler.generator.get_state(), state)


def test_a_launch_refuses_while_the_step_before_last_is_unwaited():
    """Steps alternate two sets of staging buffers, so a launch reuses the set of the step
    before last, whose copies the device may still be reading unless it was waited on.
    LLMEngine.step waits on each step before launching the one after next; a launch that
    finds it otherwise refuses, on the CPU too (where a race cannot show)."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=16, max_num_seqs=4))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    first = engine.launch(engine.scheduler.schedule())
    second = engine.launch(engine.scheduler.schedule())  # the other parity: fine
    with pytest.raises(RuntimeError, match="the step before last was never waited on"):
        engine.launch(engine.scheduler.schedule())
    first.handle.wait()
    second.handle.wait()
    engine.runner.launch(engine.scheduler.schedule(), engine.block_manager.block_table, [])
