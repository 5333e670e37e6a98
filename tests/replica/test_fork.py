"""n samples of one prompt: one prefill, then each sample forks from sample 0's blocks
(LLMEngine.add_request with n > 1, Scheduler.fork_samples). Every run checks the engine's
invariants after every step and ends with every block free or cached."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from replica import SamplingParams
from replica.sampling_params import sample_request_id
from replica.sequence import SequenceStatus
from tests.replica.test_engine_hf import (
    assert_no_leak,
    hf_greedy,
    make_engine,
    random_prompts,
    save_checkpoint,
)

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # num_cached_tokens at the end
    num_prefill_tokens: int = 0


def drive(engine, run: Run | None = None, max_steps: int = 500) -> Run:
    """Step until nothing is in flight, checking the invariants after every step."""
    run = run or Run()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        step(engine, run)
    assert not engine.has_unfinished(), "the engine stopped making progress"
    assert_no_leak(engine)
    return run


def step(engine, run: Run) -> None:
    """One engine step, its outputs and prefill tokens recorded, the invariants checked."""
    for out in engine.step():
        assert out.request_id not in run.reasons, f"{out.request_id}: output after its end"
        run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            run.reasons[out.request_id] = out.finish_reason
            run.cached[out.request_id] = out.num_cached_tokens
    run.num_prefill_tokens += engine.last_step.num_prefill_tokens
    engine.check_invariants()


def ids(request_id: str, n: int) -> list[str]:
    return [sample_request_id(request_id, i) for i in range(n)]


@pytest.mark.parametrize(  # the emulated graph path once: ~30 s under the interpreter
    ("prompt_len", "emulate_graphs"),
    [(2 * BLOCK_SIZE, False), (2 * BLOCK_SIZE + 5, False), (2 * BLOCK_SIZE + 5, True)],
)
def test_seeded_samples_are_distinct_reproducible_and_prefilled_once(
    checkpoint, prompt_len, emulate_graphs
):
    """n=3 with a seed: three distinct samples, the same on a second engine, each the one
    an n=1 request with seed + i gives alone; the prompt is prefilled once, and the other
    samples count it as cached, in their outputs and the stats' prefix counters."""
    path, _ = checkpoint
    [prompt] = random_prompts(3, [prompt_len])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(path, BLOCK_SIZE, emulate_graphs)
        engine.add_request("r", prompt, params)
        assert engine.stats().num_waiting == 3
        runs.append(drive(engine))
    run = runs[0]
    samples = [run.tokens[i] for i in ids("r", 3)]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) == 3, "the samples are not distinct"
    assert samples == [runs[1].tokens[i] for i in ids("r", 3)], "not reproducible"
    assert run.num_prefill_tokens == prompt_len, "the prompt was prefilled more than once"
    assert [run.cached[i] for i in ids("r", 3)] == [0, prompt_len - 1, prompt_len - 1]
    stats = engine.stats()
    assert stats.prefix_query_tokens == 3 * prompt_len
    assert stats.prefix_hit_tokens == 2 * (prompt_len - 1)
    # The n=1 requests run one at a time on the second engine, not on one new engine each
    # (an emulated engine takes ~10 s to build): a seeded row's draws depend on its seed
    # and positions alone, and a salt of its own keeps each off the cached prompt, so it
    # prefills the whole prompt as on a fresh engine.
    for i, sample in enumerate(samples):
        one = SamplingParams(
            max_tokens=12, temperature=1.0, seed=11 + i, ignore_eos=True, cache_salt=f"alone-{i}"
        )
        [alone] = engine.generate([prompt], one)
        assert alone.num_cached_tokens == 0, f"sample {i}: not prefilled alone"
        assert alone.token_ids == sample, f"sample {i}"


@pytest.mark.parametrize("emulate_graphs", [False, True])
def test_greedy_samples_are_transformers_greedy_and_generate_orders_them(
    checkpoint, emulate_graphs
):
    """Greedy n=2 beside an n=1 prompt: generate gives the n=1 prompt's output, then the
    two samples (ids sample_request_id), each transformers' greedy tokens."""
    path, hf_model = checkpoint
    prompts = random_prompts(5, [9, 2 * BLOCK_SIZE, 13])
    engine = make_engine(path, BLOCK_SIZE, emulate_graphs)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    params = [greedy, SamplingParams(max_tokens=10, temperature=0.0, n=2), greedy]
    outs = engine.generate(prompts, params)
    assert [o.request_id for o in outs] == ["gen-0", "gen-1", "gen-1#1", "gen-2"]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    assert [o.token_ids for o in outs] == [expected[0], expected[1], expected[1], expected[2]]
    assert [o.prompt_token_ids for o in outs] == [prompts[0], prompts[1], prompts[1], prompts[2]]
    assert outs[2].num_cached_tokens == 2 * BLOCK_SIZE - 1
    assert_no_leak(engine)


def test_chunked_prompt_forks_after_its_last_chunk(checkpoint):
    """A prompt prefilled in chunks: the samples wait (num_waiting) until its last chunk
    launches, then all run, with transformers' greedy tokens."""
    path, hf_model = checkpoint
    [prompt] = random_prompts(6, [37])
    engine = make_engine(path, BLOCK_SIZE, max_num_batched_tokens=16)
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, n=3))
    run = Run()
    step(engine, run)  # the first chunk
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 2)
    drive(engine, run)
    assert run.num_prefill_tokens == 37
    expected = hf_greedy(hf_model, prompt, 8)
    assert [run.tokens[i] for i in ids("r", 3)] == [expected] * 3


def test_forked_samples_survive_preemption_in_a_tiny_pool(checkpoint):
    """A pool too small for the samples' outputs: forked samples are preempted and
    recomputed from prompt + their own outputs, and still give transformers' tokens."""
    path, hf_model = checkpoint
    prompts = random_prompts(7, [21, 11])
    engine = make_engine(path, BLOCK_SIZE, num_blocks=10)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=20, temperature=0.0, n=3))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=20, temperature=0.0, n=2))
    run = drive(engine)
    assert engine.stats().num_preempted_total > 0, "the pool did not force a preemption"
    for request_id, prompt, n in (("a", prompts[0], 3), ("b", prompts[1], 2)):
        expected = hf_greedy(hf_model, prompt, 20)
        assert [run.tokens[i] for i in ids(request_id, n)] == [expected] * n, request_id


def test_samples_without_a_slot_queue_as_their_own_requests(checkpoint):
    """max_num_seqs=2 and n=3: sample 1 forks, sample 2 finds no slot and queues at the
    head of the waiting queue, where the prefix cache serves its full prompt blocks."""
    path, hf_model = checkpoint
    [prompt] = random_prompts(8, [2 * BLOCK_SIZE + 3])
    engine = make_engine(path, BLOCK_SIZE, max_num_seqs=2)
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, n=3))
    run = Run()
    step(engine, run)  # sample 0's whole prompt
    s0, s1, s2 = (engine.requests[i] for i in ids("r", 3))
    assert engine.scheduler.running == [s0, s1]
    assert list(engine.scheduler.waiting) == [s2] and not engine.scheduler.awaiting_fork
    assert s1.block_ids == s0.block_ids and not s2.block_ids
    drive(engine, run)
    assert [run.tokens[i] for i in ids("r", 3)] == [hf_greedy(hf_model, prompt, 6)] * 3
    assert run.cached["r#1"] == len(prompt) - 1
    assert run.cached["r#2"] == 2 * BLOCK_SIZE  # its full blocks, from the prefix cache
    # The prompt once, then sample 2's tokens after its cached blocks.
    assert run.num_prefill_tokens == len(prompt) + len(prompt) - 2 * BLOCK_SIZE


def test_samples_without_blocks_to_spare_queue_too(checkpoint):
    """A pool whose free blocks run out at fork time: the samples that find no block for
    their copy queue as their own requests, and all finish with the same tokens."""
    path, hf_model = checkpoint
    [prompt] = random_prompts(9, [4 * BLOCK_SIZE - 2])  # 4 blocks, the last shared
    engine = make_engine(path, BLOCK_SIZE, num_blocks=7)
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0, n=4))
    run = Run()
    step(engine, run)
    # 3 free blocks: the family's next step may take one for each sequence sharing the
    # last block (sample 0 and each fork), so two samples fork and the third queues.
    assert [s.request_id for s in engine.scheduler.running] == ["r", "r#1", "r#2"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["r#3"]
    step(engine, run)
    assert engine.stats().num_preempted_total == 0, "the forks preempted"
    drive(engine, run)
    assert [run.tokens[i] for i in ids("r", 4)] == [hf_greedy(hf_model, prompt, 2)] * 4


@pytest.mark.parametrize("when", [0, 1, 3])  # steps before the abort: awaiting, forked, later
def test_abort_of_sample_0_ends_the_family_and_frees_every_block(checkpoint, when):
    path, _ = checkpoint
    [prompt] = random_prompts(10, [2 * BLOCK_SIZE + 1])
    engine = make_engine(path, BLOCK_SIZE)
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, seed=1, n=3))
    engine.add_request("other", prompt[:5], SamplingParams(max_tokens=4))
    run = Run()
    for _ in range(when):
        step(engine, run)
    family = [engine.requests[i] for i in ids("r", 3)]
    assert engine.abort("r")
    assert all(s.status is SequenceStatus.FINISHED for s in family)
    assert all(i not in engine.requests for i in ids("r", 3)) and not engine.families
    assert not engine.scheduler.awaiting_fork and engine.scheduler.num_awaiting_fork == 0
    engine.check_invariants()
    assert not engine.abort("r") and not engine.abort("r#1")
    drive(engine, run)
    assert set(run.tokens) <= {"r", "r#1", "r#2", "other"} and run.reasons["other"] == "length"
    assert len(run.tokens["other"]) == 4


def test_abort_of_one_sample_leaves_the_others(checkpoint):
    """Aborting sample 1 (awaiting its fork) and sample 2 (running) alone: sample 0 runs
    to its end; the family's entry goes once every sample has ended."""
    path, hf_model = checkpoint
    [prompt] = random_prompts(11, [20])
    engine = make_engine(path, BLOCK_SIZE)
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, n=4))
    assert engine.abort("r#1")
    engine.check_invariants()
    assert engine.stats().num_waiting == 3
    run = Run()
    step(engine, run)
    step(engine, run)
    assert engine.abort("r#2")
    engine.check_invariants()
    drive(engine, run)
    expected = hf_greedy(hf_model, prompt, 8)
    assert run.tokens["r"] == run.tokens["r#3"] == expected
    assert "r#1" not in run.tokens and len(run.tokens.get("r#2", [])) < 8
    assert not engine.families


def test_sample_0_ended_alone_before_its_prompt_leaves_no_sample_waiting(checkpoint):
    """abort_sample of sample 0 before its prompt is computed: the samples that awaited
    it are queued as their own requests and finish."""
    path, hf_model = checkpoint
    [prompt] = random_prompts(12, [15])
    engine = make_engine(path, BLOCK_SIZE)
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, temperature=0.0, n=3))
    assert engine.abort_sample("r")
    engine.check_invariants()
    assert not engine.scheduler.awaiting_fork
    assert [s.request_id for s in engine.scheduler.waiting] == ["r#1", "r#2"]
    run = drive(engine)
    assert run.tokens == {"r#1": hf_greedy(hf_model, prompt, 5), "r#2": run.tokens["r#1"]}
    assert not engine.families


def test_n_is_all_or_nothing(checkpoint):
    """A sample id already in flight, or a bad field, refuses the whole request."""
    path, _ = checkpoint
    engine = make_engine(path, BLOCK_SIZE)
    engine.add_request("r#2", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"request_id 'r#2' is already in flight"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=2, n=3))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("s", [5] * 8, SamplingParams(max_tokens=engine.max_model_len, n=3))
    assert sorted(engine.requests) == ["r#2"] and not engine.families
    assert engine.stats().num_waiting == 1
    engine.check_invariants()
    drive(engine)


def test_seeds_wrap_below_2_to_the_63(checkpoint):
    path, _ = checkpoint
    engine = make_engine(path, BLOCK_SIZE)
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=1, seed=2**63 - 1, n=3))
    seeds = [engine.requests[i].params.seed for i in ids("r", 3)]
    assert seeds == [2**63 - 1, 0, 1]
    assert all(engine.requests[i].params.n == 1 for i in ids("r", 3))
    drive(engine)
