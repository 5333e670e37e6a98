"""ModelRunner pieces that the engine tests do not isolate."""

from __future__ import annotations

import pytest
import torch

import kernels
from replica import EngineConfig, LLMEngine, SamplingParams
from replica.runner.step_handle import TokenStaging
from replica.runner.step_plan import arrange, completes_any
from replica.scheduler import ScheduledBatch
from replica.sequence import Sequence


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


def test_warm_up_of_the_graph_path_leaves_the_penalty_state_alone(monkeypatch):
    """On the graph path the warm-up also compiles kernels.penalties (both forms): it only
    reads the counts and the prompt mask, which requests own."""
    config = EngineConfig(model="gpt2-tiny", device="cpu", num_blocks=16, max_num_seqs=2)
    runner = LLMEngine(config, emulate_graphs_on_cpu=True).runner
    processors = runner.processors
    assert processors.fused
    gen = torch.Generator().manual_seed(3)
    processors.counts.copy_(torch.randint(0, 3, processors.counts.shape, generator=gen))
    processors.prompt_mask.copy_(torch.rand(processors.prompt_mask.shape, generator=gen) < 0.5)
    counts, mask = processors.counts.clone(), processors.prompt_mask.clone()
    forms = []
    apply = kernels.apply_penalties
    monkeypatch.setattr(kernels, "apply_penalties", lambda *a: forms.append(a[-1]) or apply(*a))

    runner.warm_up()

    assert forms == [False, True]  # compiled now, not on the first penalized step
    assert torch.equal(processors.counts, counts)
    assert torch.equal(processors.prompt_mask, mask)


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


def _seq(name: str, prompt_len: int, num_computed: int) -> Sequence:
    seq = Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4))
    seq.num_computed_tokens = num_computed
    return seq


def test_a_step_is_arranged_into_one_forward_where_it_can():
    """Prompt tokens up to mixed_prefill_tokens ride in the decode forward (mixed); longer
    ones take the decode sequences into the prefill forward, one token each, after the
    prompt chunks (decode_in_prefill), or leave them to a decode forward without it."""
    prompt, other = _seq("p", 10, 0), _seq("q", 10, 4)
    decodes = [_seq("d1", 3, 2), _seq("d2", 3, 2)]
    short = ScheduledBatch([prompt, other], [2, 3], decodes)
    assert arrange(short, 5, True) == ([prompt, other], [2, 3], decodes, True)
    long = ScheduledBatch([prompt, other], [4, 6], decodes)
    assert arrange(long, 5, True) == ([prompt, other, *decodes], [4, 6, 1, 1], [], False)
    assert arrange(long, 5, False) == ([prompt, other], [4, 6], decodes, False)
    assert arrange(ScheduledBatch([], [], decodes), 0, True) == ([], [], decodes, False)
    assert not completes_any(short) and completes_any(long)  # other's chunk ends its prompt


def test_token_staging_keeps_greedy_views_only_of_graph_outputs():
    """A greedy step's views of its argmax rows are kept per (mixed, size, rows, parity)
    where the argmax is a graph's output, which never moves: a later step of that shape
    reads the same tensor. Made afresh otherwise; a step without sampled rows yields none."""
    graph_out, moved = torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])
    for cache_views, want in ((True, [6, 7]), (False, [9, 10])):
        staging = TokenStaging(4, torch.device("cpu"), cache_views)
        assert staging.greedy_to_host(graph_out, False, 1, 3, 0).wait() == [6, 7]
        assert staging.greedy_to_host(moved, False, 1, 3, 0).wait() == want
        assert staging.greedy_to_host(moved, True, 1, 3, 0).wait() == [9, 10]  # mixed: its own
        assert staging.greedy_to_host(moved, False, 1, 3, 1).wait() == [9, 10]  # other parity
        assert staging.greedy_to_host(moved, False, 2, 2, 1).wait() == []
