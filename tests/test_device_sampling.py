"""The sampler as device tensor ops: its draws follow the filtered softmax, its random numbers
are keyed by (seed, step), and sampled rows burst with greedy ones and keep their tokens."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from edgeinfer.engine import SamplingParams
from edgeinfer.engine.sampling import SamplingRows, filtered_probs
from edgeinfer.engine.sampling_rng import as_int64, mix64, reference_uniform, uniforms
from tests.test_engine import QUESTIONS, bursting_engine, engine_for

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -1.0, -2.0])
ROWS, STEPS = 10_000, 10  # 100k draws: ten thousand seeds, ten steps each
DRAWS = ROWS * STEPS
ACCEPT, REJECT = 1e-3, 1e-6  # p-values: a right sampler passes above ACCEPT, a wrong one falls below REJECT

# A row's history for the penalty cases: the prompt saw tokens 2 and 5, the answer so far 0, 0, 0, 3.
PROMPT, GENERATED = (2, 5), (0, 0, 0, 3)
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6)


@pytest.fixture
def one_thread():
    """Small tensor ops run faster on one thread than on two that wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the reference, in numpy
def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_probs(params: SamplingParams, prompt=(), generated=()) -> np.ndarray:
    """The documented filters, written out plainly in float64, one row."""
    logits = LOGITS.double().numpy().copy()
    counts = np.bincount(np.array(generated, dtype=int), minlength=logits.size)
    seen = counts > 0
    seen[list(prompt)] = True
    r = params.repetition_penalty
    logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    logits = logits / params.temperature
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(logits.size, bool)
    keep[order[:params.top_k or logits.size]] = True
    probs = softmax(np.where(keep, logits, -np.inf))
    keep &= probs >= params.min_p * probs.max()
    probs = softmax(np.where(keep, logits, -np.inf))
    mass = 0.0
    for token in order:  # most likely first; the token that brings the mass to top_p is kept
        if not keep[token]:
            continue
        if mass > params.top_p and params.top_p < 1.0:
            keep[token] = False
        mass += probs[token]
    return softmax(np.where(keep, logits, -np.inf))


def sampled_ids(params: SamplingParams, prompt=(), generated=(), device="cpu") -> np.ndarray:
    """DRAWS ids for the same logits and history through the device sampler: ROWS rows, each
    with its own seed, over STEPS steps (the history held still: only the draw's counter moves)."""
    rows = SamplingRows((params,) * ROWS, tuple(range(ROWS)), (prompt,) * ROWS, (generated,) * ROWS)
    state = rows.state(LOGITS.numel(), device)
    logits = LOGITS.to(device).expand(ROWS, -1).contiguous()
    ids = []
    for _ in range(STEPS):
        ids.append(state.choose(logits))
        state.counters.add_(1)
    return torch.cat(ids).cpu().numpy()


def chi_square_p(ids: np.ndarray, expected: np.ndarray) -> float:
    """p-value of the draws under ``expected``; 0 where a token of probability 0 was drawn.
    Tokens expected fewer than 5 times are pooled into one cell."""
    observed = np.bincount(ids, minlength=expected.size)
    if observed[expected == 0].any():
        return 0.0
    counts = expected * len(ids)
    big = counts >= 5
    obs, exp = list(observed[big]), list(counts[big])
    if (~big & (expected > 0)).any():
        obs.append(observed[~big].sum())
        exp.append(counts[~big].sum())
    if len(obs) == 1:
        return 1.0  # one possible token: nothing to test beyond the support
    return float(stats.chisquare(obs, np.array(exp) * (sum(obs) / sum(exp))).pvalue)


CASES = {
    "temperature": (dict(temperature=0.7), dict(temperature=0.75)),
    "top_k": (dict(temperature=1.0, top_k=4), dict(temperature=1.0, top_k=3)),
    # 0.7 keeps four tokens (the fourth crosses it); 0.65 one fewer.
    "top_p": (dict(temperature=1.0, top_p=0.7), dict(temperature=1.0, top_p=0.65)),
    "min_p": (dict(temperature=1.0, min_p=0.2), dict(temperature=1.0, min_p=0.25)),
    "all_filters": (dict(temperature=0.8, top_k=7, min_p=0.05, top_p=0.9),
                    dict(temperature=0.8, top_k=7, min_p=0.05, top_p=0.8)),
    "penalties": (dict(temperature=1.0, **PENALTIES), dict(temperature=1.0, **PENALTIES | {"presence_penalty": 0.45})),
    "repetition": (dict(temperature=1.0, repetition_penalty=1.5), dict(temperature=1.0, repetition_penalty=1.35)),
}


@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_filtered_softmax_and_a_mutated_filter_is_rejected(case, one_thread):
    right, wrong = (SamplingParams(seed=0, **kw) for kw in CASES[case])
    history = (PROMPT, GENERATED) if right.penalized else ((), ())
    expected = reference_probs(right, *history)
    assert chi_square_p(sampled_ids(right, *history), expected) > ACCEPT
    # The same statistic, on draws whose filter is off by one token or a few percent, rejects them.
    assert chi_square_p(sampled_ids(wrong, *history), expected) < REJECT


def test_the_top_p_mutation_keeps_exactly_one_token_fewer():
    right, wrong = (reference_probs(SamplingParams(temperature=1.0, **kw)) for kw in (dict(top_p=0.7), dict(top_p=0.65)))
    assert (right > 0).sum() == 4 and (wrong > 0).sum() == 3


def test_filtered_probs_match_the_reference():
    for right, _ in CASES.values():
        params = SamplingParams(**right)
        if not params.penalized:
            np.testing.assert_allclose(filtered_probs(LOGITS, params).double().numpy(), reference_probs(params),
                                       rtol=1e-5, atol=1e-7)


def test_greedy_rows_take_the_argmax_of_the_penalized_logits_beside_sampled_rows():
    greedy, penalized_greedy = SamplingParams(), SamplingParams(frequency_penalty=2.0)
    sampled, top_1 = SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=5.0, top_k=1)
    rows = SamplingRows((greedy, sampled, penalized_greedy, sampled, top_1), (0, 1, 2, 3, 4), ((),) * 5,
                        ((), (), GENERATED, (), ()))
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))
    ids = rows.state(10, "cpu").choose(logits.clone())
    penalized = logits[2].clone()
    penalized[0] -= 2.0 * 3
    penalized[3] -= 2.0
    assert ids[0] == logits[0].argmax() and ids[2] == penalized.argmax() and ids[4] == logits[4].argmax()


# --------------------------------------------------------------------------- the random numbers
def test_the_counter_hash_is_splitmix64_with_the_same_bits_as_plain_python():
    # SplitMix64 from state 0: its first output (the published test value).
    assert int(mix64(torch.tensor([as_int64(0x9E3779B97F4A7C15)]))) & (2**64 - 1) == 0xE220A8397B1DCDAF
    seeds = [0, 1, 7, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567890]
    counters = [0, 1, 5, 2**31, 2**40, 3, 1000]
    got = uniforms(torch.tensor([as_int64(s) for s in seeds]), torch.tensor(counters))
    assert got.tolist() == [reference_uniform(s, c) for s, c in zip(seeds, counters)]


def test_the_uniforms_of_one_seed_over_steps_and_of_one_step_over_seeds_are_uniform(one_thread):
    steps = uniforms(torch.full((DRAWS,), as_int64(42)), torch.arange(DRAWS))
    seeds = uniforms(torch.arange(DRAWS), torch.zeros(DRAWS, dtype=torch.long))
    for u in (steps, seeds):
        assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
        assert stats.chisquare(np.histogram(u.numpy(), bins=100, range=(0, 1))[0]).pvalue > ACCEPT
    # Neighbouring seeds do not give shifted copies of one stream.
    a = uniforms(torch.full((64,), 1), torch.arange(64))
    b = uniforms(torch.full((64,), 2), torch.arange(64))
    assert not set(a.tolist()[1:]) & set(b.tolist())


# --------------------------------------------------------------------------- through the engine
SAMPLED = SamplingParams(max_new_tokens=20, temperature=1.2, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
# Three rows in a bucket of four: greedy (penalized), sampled, sampled with every filter and penalty.
MIXED = [SamplingParams(max_new_tokens=20, ignore_eos=True, presence_penalty=1.0), SAMPLED,
         replace(SAMPLED, seed=12, min_p=0.02, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)]


def test_a_seeded_request_gives_its_tokens_alone_in_a_mixed_batch_and_bursting(checkpoint):
    path = checkpoint("smolvlm")
    question, images = QUESTIONS[1]
    single = engine_for(path)
    alone = single.generate(question, images, SAMPLED).token_ids
    assert alone != single.generate(question, images, replace(SAMPLED, seed=12)).token_ids

    plain = engine_for(path, max_batch_size=4)
    stepped = [r.token_ids for r in plain.run_until_done(
        [plain.submit(q, im, p) for (q, im), p in zip(QUESTIONS, MIXED)])]
    assert stepped[1] == alone

    engine = bursting_engine(path, block_size=16)
    burst = [r.token_ids for r in engine.run_until_done(
        [engine.submit(q, im, p) for (q, im), p in zip(QUESTIONS, MIXED)])]
    assert engine.counters["decode_bursts"] > 0, "sampled and penalized rows must burst with greedy ones"
    assert burst == stepped
    assert engine.pool.num_free == engine.pool.num_blocks


def test_penalties_change_the_greedy_answer_and_an_unseeded_request_can_be_replayed(checkpoint):
    engine = engine_for(checkpoint("smolvlm"))
    question, images = QUESTIONS[0]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    plain = engine.generate(question, images, params).token_ids
    assert repeats(plain) > 0  # tiny random models repeat themselves
    assert repeats(engine.generate(question, images, replace(params, presence_penalty=2.0)).token_ids) < repeats(plain)

    unseeded = replace(params, temperature=1.0)
    seqs = [engine.submit(question, images, unseeded) for _ in range(2)]
    first, second = (r.token_ids for r in engine.run_until_done(seqs))
    assert seqs[0].seed != seqs[1].seed and first != second  # each drew its own seed at admission
    # replayed as they ran, two rows together: a batch of one need not round its logits as a batch of two does
    # (docs/architecture.md), and a near tie between two tokens would then be drawn the other way
    replayed = engine.run_until_done([engine.submit(question, images, replace(unseeded, seed=s.seed)) for s in seqs])
    assert [r.token_ids for r in replayed] == [first, second]


def test_a_stop_string_inside_a_sampled_burst_cuts_the_answer_where_step_by_step_does(checkpoint):
    path = checkpoint("smolvlm")
    question, images = QUESTIONS[0]
    params = replace(SAMPLED, max_new_tokens=32)
    plain = engine_for(path)
    free = plain.generate(question, images, params)
    words = free.text.split()
    assert len(words) > 3
    stopped = replace(params, stop=(words[2],))
    expected = plain.generate(question, images, stopped)
    engine = bursting_engine(path, block_size=64)
    result = engine.generate(question, images, stopped)
    assert engine.counters["decode_bursts"] > 0
    assert (result.token_ids, result.text, result.finish_reason) == \
        (expected.token_ids, expected.text, expected.finish_reason)
    assert result.finish_reason == "stop" and len(result.token_ids) < len(free.token_ids)


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.parametrize("case", CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is false")
def test_cuda_draws_inside_a_captured_graph_are_the_cpu_draws(case):
    """Same logits, seeds and counters: a replayed CUDA graph of the sampler picks the CPU's ids,
    so they pass the same chi-square test."""
    params = SamplingParams(seed=0, **CASES[case][0])
    history = (PROMPT, GENERATED) if params.penalized else ((), ())
    rows = SamplingRows((params,) * ROWS, tuple(range(ROWS)), (history[0],) * ROWS, (history[1],) * ROWS)
    state = rows.state(LOGITS.numel(), "cuda")
    logits = LOGITS.cuda().expand(ROWS, -1).contiguous()
    state.choose(logits)  # warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = state.choose(logits)
        state.counters.add_(1)
    replayed = []
    for _ in range(STEPS):
        graph.replay()
        replayed.append(ids.clone())
    cuda = torch.cat(replayed).cpu().numpy()
    np.testing.assert_array_equal(cuda, sampled_ids(params, *history))
    assert chi_square_p(cuda, reference_probs(params, *history)) > ACCEPT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is false")
def test_sampled_rows_burst_inside_cuda_graphs_with_the_step_by_step_tokens(checkpoint):
    from edgeinfer.engine import Engine, EngineConfig

    path = checkpoint("smolvlm")

    def run(**config):
        engine = Engine.load(path, config=EngineConfig(num_blocks=512, max_batch_size=4, device="cuda",
                                                       cuda_graphs=True, **config))
        seqs = [engine.submit(q, im, p) for (q, im), p in zip(QUESTIONS, MIXED)]
        return [r.token_ids for r in engine.run_until_done(seqs)], engine

    burst, engine = run()
    stepped, _ = run(decode_burst=1)
    assert engine.counters["decode_bursts"] > 0 and engine.decoder_engine.captures > 0
    assert burst == stepped


def test_the_chat_api_passes_the_penalties_and_min_p_to_the_sampler():
    pytest.importorskip("fastapi", reason="the chat API needs fastapi (the daemon's dependency)")
    from edgeinfer.errors import RequestError
    from edgeinfer.server.chat import parse_chat
    from edgeinfer.server.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.7, min_p=0.1,
                                 frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.1)
    params = parse_chat(body, 16).sampling
    assert (params.min_p, params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == \
        (0.1, 0.5, -0.25, 1.1)
    with pytest.raises(RequestError, match="frequency_penalty must be in"):
        SamplingParams(frequency_penalty=2.5)
