"""The engine loop: batching, block sizes, chunked prefill, cancellation, sampling, streaming."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.engine.sampling import SamplingRows
from edgeinfer.engine.sequence import Status
from edgeinfer.errors import RequestError
from tests.conftest import noise_image

FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
QUESTIONS = [
    ("what is in the image ?", [noise_image(128, 96, seed=1)]),
    ("describe this picture", []),
    ("how many red circle are there in the top left of the image ?", [noise_image(64, 64, seed=5)]),
    ("color", [noise_image(80, 128, seed=7), noise_image(64, 96, seed=8)]),
]


def engine_for(path, **config):
    config.setdefault("num_blocks", 512)
    return Engine.load(path, config=EngineConfig(**config))


def alone(path, block_size=16, prefill_chunk=512):
    tokens = []
    for question, images in QUESTIONS:
        engine = engine_for(path, block_size=block_size, num_blocks=4096 // block_size, prefill_chunk=prefill_chunk)
        tokens.append(engine.generate(question, images, FORCED).token_ids)
    return tokens


@pytest.fixture(scope="module")
def reference(checkpoint):
    return alone(checkpoint("smolvlm"))


def test_prompts_have_different_lengths(checkpoint):
    engine = engine_for(checkpoint("smolvlm"))
    lengths = {engine.submit(q, im, FORCED).prompt_len for q, im in QUESTIONS}
    assert len(lengths) == len(QUESTIONS)


def test_four_sequences_decoded_together_match_each_alone(checkpoint, reference):
    engine = engine_for(checkpoint("smolvlm"), max_batch_size=4)
    seqs = [engine.submit(q, im, FORCED) for q, im in QUESTIONS]
    batch_sizes = []
    while engine.has_work():
        stepped = engine.step()
        batch_sizes.append(len(stepped))
    assert max(batch_sizes) == 4, "the four sequences must share decode steps"
    assert [engine.result(s).token_ids for s in seqs] == reference


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_sizes_give_identical_tokens(checkpoint, reference, block_size):
    assert alone(checkpoint("smolvlm"), block_size=block_size) == reference


def test_chunked_prefill_gives_identical_tokens(checkpoint, reference):
    assert alone(checkpoint("smolvlm"), prefill_chunk=7) == reference


def test_cancel_returns_every_block(checkpoint):
    engine = engine_for(checkpoint("smolvlm"), num_blocks=64, block_size=4)
    free_before = engine.pool.num_free
    keep = engine.submit(*QUESTIONS[1], FORCED)
    doomed = engine.submit(*QUESTIONS[0], FORCED)
    for _ in range(8):
        engine.step()
    assert doomed.status is Status.RUNNING and doomed.block_table.blocks
    owned = list(doomed.block_table.blocks)
    engine.cancel(doomed)
    assert doomed.finish_reason.value == "cancelled"
    assert all(engine.pool.refcount(b) == 0 for b in owned)
    engine.run_until_done([keep])
    assert engine.pool.num_free == free_before


def test_preemption_under_a_small_pool_keeps_tokens(checkpoint, reference):
    # 4-token blocks, 40 blocks: the four sequences cannot all stay resident.
    engine = engine_for(checkpoint("smolvlm"), block_size=4, num_blocks=40, max_batch_size=4)
    seqs = [engine.submit(q, im, FORCED) for q, im in QUESTIONS]
    results = engine.run_until_done(seqs)
    assert engine.scheduler.preemptions > 0
    assert [r.token_ids for r in results] == reference
    assert engine.pool.num_free == engine.pool.num_blocks


def test_seeded_sampling_is_reproducible_and_varies(checkpoint):
    engine = engine_for(checkpoint("smolvlm"))
    params = SamplingParams(max_new_tokens=24, min_new_tokens=24, temperature=1.5, top_p=0.9, top_k=50, seed=3)
    a = engine.generate(*QUESTIONS[1], params).token_ids
    b = engine.generate(*QUESTIONS[1], params).token_ids
    c = engine.generate(*QUESTIONS[1], replace(params, seed=4)).token_ids
    assert a == b
    assert a != c


def test_the_sampled_distribution_keeps_top_k_and_the_token_that_crosses_top_p():
    from edgeinfer.engine.sampling import filtered_probs

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: (filtered_probs(logits, SamplingParams(temperature=1.0, **kw)) > 0).tolist()  # noqa: E731
    assert kept() == [True] * 4
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.6) == [True, True, False, False]  # 0.5 < 0.6: the second token crosses it
    assert kept(top_p=0.45) == [True, False, False, False]
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_stream_concatenates_to_the_answer_and_stop_strings_cut(checkpoint):
    engine = engine_for(checkpoint("smolvlm"))
    full = engine.generate(*QUESTIONS[0], FORCED)
    words = full.text.split()
    assert len(words) > 3
    streamed = "".join(engine.stream(*QUESTIONS[0], FORCED))
    assert streamed.strip() == full.text
    stop_word = words[2]
    cut = engine.generate(*QUESTIONS[0], SamplingParams(max_new_tokens=32, stop=(stop_word,)))
    assert cut.finish_reason == "stop"
    assert stop_word not in cut.text
    assert full.text.startswith(cut.text)


def test_stop_token_ends_generation(checkpoint):
    engine = engine_for(checkpoint("smolvlm"))
    full = engine.generate(*QUESTIONS[0], FORCED)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    result = engine.generate(*QUESTIONS[0], SamplingParams(max_new_tokens=32, stop_token_ids=(stop_id,)))
    assert result.finish_reason == "stop"
    assert result.token_ids == full.token_ids[:first + 1]


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)])
def test_bad_sampling_values_are_typed_errors(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad)


def test_image_count_mismatch_is_a_request_error(checkpoint):
    engine = engine_for(checkpoint("smolvlm"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color"}]}]
    with pytest.raises(RequestError):
        engine.submit(messages, [], FORCED)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_request_over_the_memory_budget_is_refused_before_vision(checkpoint):
    from edgeinfer.errors import PreflightError

    engine = engine_for(checkpoint("smolvlm"), kv_budget_mb=0)
    with pytest.raises(PreflightError) as caught:
        engine.submit(*QUESTIONS[0], FORCED)
    assert caught.value.reason == "memory"
    assert engine.counters["vision_runs"] == 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_request_over_the_context_limit_names_it(checkpoint):
    from edgeinfer.errors import LimitExceeded

    engine = engine_for(checkpoint("smolvlm"), max_context=40)
    with pytest.raises(LimitExceeded) as caught:
        engine.submit(*QUESTIONS[0], FORCED)
    assert caught.value.limit == 40 and "max_context_tokens" in caught.value.override


# --------------------------------------------------------------------------- greedy bursts
# The CUDA graph engine's burst step (ids in, K/V written into the pool, argmax fed back)
# runs eagerly off the GPU, so its bookkeeping is checked here against step-by-step decoding.


def bursting_engine(path, take_decoder: bool = True, **config):
    from edgeinfer.backends.base import Engines
    from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine
    from edgeinfer.backends.torch.eager import TorchVisionEngine
    from edgeinfer.models.loader import load_model

    config = EngineConfig(**{"num_blocks": 512, "max_batch_size": 4, **config})
    model = load_model(path, config.torch_dtype, config.device)
    # Handed the decoder, it lays the weights out for the fused step, which runs in Triton's CPU
    # interpreter where TRITON_INTERPRET=1 (its inputs, layers and greedy choice as on a GPU).
    decoder = CudaGraphDecoderEngine(model.decoder, config.max_batch_size, -(-config.max_context // config.block_size),
                                     compile_layers=False, take_decoder=take_decoder)
    return Engine(model, config, Engines(decoder, TorchVisionEngine(model.vision), "torch", "fp32", bursts=decoder))


def test_the_cuda_graph_engine_changes_no_global_torch_setting(checkpoint):
    """The compiled layers get room for many variants only inside their own calls."""
    import torch

    from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine, _recompile_limit_name
    from edgeinfer.models.loader import load_model

    name = _recompile_limit_name()
    before = getattr(torch._dynamo.config, name)
    decoder = load_model(checkpoint("smolvlm")).decoder
    strides = [p.stride() for p in decoder.parameters()]
    engine = CudaGraphDecoderEngine(decoder, 4, 64)  # layers compiled, not handed the decoder
    assert getattr(torch._dynamo.config, name) == before
    assert [p.stride() for p in decoder.parameters()] == strides and engine.weight_layout is None


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])  # 1-D positions and M-RoPE
def test_decode_bursts_give_the_step_by_step_tokens(checkpoint, family):
    path = checkpoint(family)
    # Three rows in a bucket of four; two finish inside a burst, one of them inside a burst that
    # was queued before the one ahead of it was read.
    lengths = [64, 60, 19]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    questions = QUESTIONS[:3]

    plain = engine_for(path, max_batch_size=4)
    expected = plain.run_until_done([plain.submit(q, im, p) for (q, im), p in zip(questions, params)])

    engine = bursting_engine(path, block_size=16)
    results = engine.run_until_done([engine.submit(q, im, p) for (q, im), p in zip(questions, params)])
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert engine.counters["decode_bursts"] > 0 and engine.counters["decode_steps"] > engine.counters["decode_bursts"]
    assert engine.counters["decode_bursts_ahead"] > 0
    assert engine.pool.num_free == engine.pool.num_blocks  # every block back
    if engine.decoder_engine.kernel_report["fused"]:  # Triton's CPU interpreter (TRITON_INTERPRET=1)
        assert engine.decoder_engine.fused_replays > 0


def test_a_stop_token_inside_a_burst_ends_the_answer_there(checkpoint):
    path = checkpoint("smolvlm")
    question, images = QUESTIONS[0]
    free = engine_for(path).generate(question, images, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    # A token that first shows up a few steps in (tiny random models repeat themselves).
    stop = next(t for t in free if free.index(t) >= 5)
    cut = free[: free.index(stop) + 1]
    engine = bursting_engine(path, block_size=64)
    result = engine.generate(question, images, SamplingParams(max_new_tokens=24, stop_token_ids=(stop,)))
    assert result.token_ids == cut and result.finish_reason == "stop"
    # The second burst was queued before the first was read; the stop in the first drops all of it.
    assert engine.counters["decode_bursts"] == 2 and engine.counters["decode_bursts_ahead"] == 1
    if engine.decoder_engine.kernel_report["fused"]:  # Triton's CPU interpreter (TRITON_INTERPRET=1)
        assert engine.decoder_engine.fused_replays > 0
    # A follow-up in the same engine (the dropped tail of the burst left no trace) matches a fresh engine.
    again = engine.generate(question, images, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    assert again == free


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_prompt_chunks_padded_to_their_bucket_give_the_exact_tokens(checkpoint, family):
    """Prompt chunks run on the prefill graphs' static shapes (padded to a length bucket; eagerly
    off the GPU): first chunks with no past, later chunks and a cached image's follow-up over
    whole blocks under a mask. The padding must change no token."""
    path = checkpoint(family)
    question, images = QUESTIONS[0]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [question, question + " and why ?"]  # the second reuses the first's image blocks
    plain = engine_for(path, prefill_chunk=24)
    expected = [plain.generate(q, images, params).token_ids for q in prompts]
    engine = bursting_engine(path, prefill_chunk=24)
    assert [engine.generate(q, images, params).token_ids for q in prompts] == expected
    graphs = engine.decoder_engine
    assert graphs.prefill_replays >= 3  # two chunks of the first prompt, one of the follow-up
    assert {width > 0 for _, width, _, _ in graphs._prefills} == {False, True}, list(graphs._prefills)


def test_rows_decode_step_by_step_while_a_caller_has_requests_about_to_join(checkpoint):
    path = checkpoint("smolvlm")
    question, images = QUESTIONS[0]
    engine = bursting_engine(path)
    seq = engine.submit(question, images, SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # the prompt
    for _ in range(5):
        assert len(engine.step(joining=1)) == 1  # one token a step, no burst queued
    assert engine.counters["decode_bursts"] == 0 and not engine.runner.burst_in_flight
    engine.step()
    assert engine.counters["decode_bursts"] >= 1 and len(seq.generated) > 7  # bursts again once nobody joins
    engine.cancel(seq)


def test_rows_decode_single_steps_between_the_chunks_of_a_new_prompt(checkpoint):
    path = checkpoint("smolvlm")
    chunk = 16  # the new prompt runs in several chunks
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    (short, no_images), (long_question, images) = QUESTIONS[1], QUESTIONS[0]
    plain = engine_for(path, prefill_chunk=chunk)
    expected = [plain.generate(q, im, params).token_ids for q, im in ((short, no_images), (long_question, images))]
    engine = bursting_engine(path, prefill_chunk=chunk)
    first = engine.submit(short, no_images, params)
    engine.step()  # its prompt, one chunk
    second = engine.submit(long_question, images, params)
    chunks = -(-second.prompt_len // chunk)
    assert chunks >= 3
    while not second.generated:
        assert len(engine.step()) <= 1 and engine.counters["decode_bursts"] == 0, "a burst ran beside a prompt"
    assert len(first.generated) == chunks  # its first token, then one step after each chunk but the last
    assert [r.token_ids for r in engine.run_until_done([first, second])] == expected
    assert engine.counters["decode_bursts"] > 0  # and bursts again once no prompt is in progress


def test_a_request_cancelled_with_a_burst_in_flight_leaves_no_trace(checkpoint):
    path = checkpoint("smolvlm")
    question, images = QUESTIONS[0]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    expected = engine_for(path).generate(question, images, params).token_ids
    # Not the fused step: in the interpreter its one-row head over SmolVLM's 49k ids takes minutes
    # for these 145 tokens, and the burst tests above run it.
    engine = bursting_engine(path, take_decoder=False)
    seq = engine.submit(question, images, params)
    while len(seq.generated) < 17:  # the first token, then a burst of 16 read with the next one queued
        engine.step()
    assert engine.counters["decode_bursts_ahead"] == 1
    engine.cancel(seq)
    assert engine.has_work()  # the queued burst is still to be read
    assert engine.step() == [] and not engine.has_work()
    assert len(seq.generated) == 17 and engine.pool.num_free == engine.pool.num_blocks
    assert engine.generate(question, images, params).token_ids == expected


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])  # 1-D positions and M-RoPE
def test_the_start_up_capture_plan_holds_every_burst_live_traffic_asks_for(checkpoint, family):
    """What ``capture_graphs`` captures at load must be what decode looks up later: run greedy,
    sampled and penalized rows in batches of 1 to 3 and find each burst's key in the plan; run
    prompts of several lengths and find each first chunk's key there too."""
    from edgeinfer.backends.torch.cuda_graphs import prefill_bucket

    # Not the fused step: the plan's keys are the same either way, and in the interpreter its
    # kernels would take minutes over these rows (the burst tests above run them).
    engine = bursting_engine(checkpoint(family), take_decoder=False, max_context=256)
    decoder = engine.decoder_engine
    samplings = [None] + [SamplingRows((p,), (0,), ((),), ((),)) for p in Engine._CAPTURED_SAMPLING]
    plan = decoder.capture_plan(samplings)
    assert len(plan) == len(decoder.batch_buckets) * len(decoder.width_buckets) * 5
    # With the profile's prompt chunk, the first chunk of a prompt of any length is in the plan too.
    with_prompts = decoder.capture_plan(samplings, prompt_chunk=engine.config.prefill_chunk)  # 512 tokens
    first_chunks = {key for what, key, _ in with_prompts if what == "prefill"}
    assert with_prompts[len(first_chunks):] == plan
    assert sorted(key[0] for key in first_chunks) == [16, 32, 64, 128, 256, 512]
    long_chunks = [key[0] for what, key, _ in decoder.capture_plan(samplings, prompt_chunk=4096) if what == "prefill"]
    assert long_chunks == [2304 + 256 * i for i in range(decoder.prefill_graphs)]  # as many as are kept, the longest
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True),
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_new_tokens=20, ignore_eos=True, frequency_penalty=0.4)]
    for n in (1, 2, 3):
        seqs = [engine.submit("what is in the image ?", [], p) for p in params[:n]]
        engine.run_until_done(seqs)
    used = set(decoder._bursts)
    assert len(used) >= 3 and used <= {key for what, key, _ in plan if what == "burst"}
    fresh = bursting_engine(checkpoint(family), take_decoder=False, max_context=256,
                            prefix_cache=False)  # every prompt from its start
    lengths = set()
    for words in (1, 20, 50, 150):  # prompts of several length buckets
        seq = fresh.submit(" ".join(["image"] * words), [], params[0])
        fresh.run_until_done([seq])
        lengths.add(prefill_bucket(seq.prompt_len))
    started = set(fresh.decoder_engine._prefills)
    assert len(lengths) >= 3 and {key[0] for key in started} == lengths and started <= first_chunks
    assert engine.capture_graphs() is None  # no CUDA: nothing to capture at load
