"""The CUDA path: same tokens as the CPU path, CUDA graphs equal to eager. Needs a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from edgeinfer import tile_cache
from edgeinfer.backends.torch import triton_decode
from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.testing.checkpoints_gemma4 import make_gemma4
from tests.conftest import first_divergence, noise_image

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is false"),
]
FORCED = SamplingParams(max_new_tokens=32, ignore_eos=True)  # fixed length; greedy rows burst
REQUESTS = [("what is in the image ?", [noise_image(128, 96, seed=1)]), ("describe this picture", []),
            ("color", [noise_image(80, 128, seed=7), noise_image(64, 96, seed=8)])]


def tokens(path, **config):
    engine = Engine.load(path, config=EngineConfig(num_blocks=512, max_batch_size=4, **config))
    seqs = [engine.submit(q, images, FORCED) for q, images in REQUESTS]
    return [r.token_ids for r in engine.run_until_done(seqs)], engine


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl", "llava", "qwen3_vl", "internvl", "gemma3", "gemma4"])
def test_cuda_fp32_with_graphs_matches_cpu(checkpoint, family, tmp_path):
    """Three requests decoding together (a batch of 3): on a machine with Triton every step
    attends with the paged kernel (Gemma's layers excepted: compiled layers)."""
    path = make_gemma4(tmp_path / family) if family == "gemma4" else checkpoint(family)
    cpu, _ = tokens(path)
    cuda, engine = tokens(path, device="cuda", cuda_graphs=True)
    assert engine.decoder_engine.captures > 0, "decode steps must run from CUDA graphs"
    assert engine.counters["decode_bursts"] > 0, "greedy rows must decode in bursts"
    assert engine.decoder_engine.prefill_replays > 0, engine.decoder_engine.prefill_error
    assert engine.decoder_engine.capture_state()["compiled_prompt_layers"], engine.decoder_engine.prompt_compile_error
    if triton_decode.triton is not None and not engine.decoder_engine.decoder.cfg.gemma_features():
        assert engine.decoder_engine.kernel_report["fused"], engine.decoder_engine.kernel_report
    assert cuda == cpu


def test_seeded_sampling_on_cuda_gives_the_cpu_tokens(checkpoint):
    """The sampler runs on the device, in the bursts; its random numbers, keyed by seed and step, have
    the same bits on every device."""
    path = checkpoint("qwen2_vl")
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=7)

    def sampled(**config):
        engine = Engine.load(path, config=EngineConfig(num_blocks=512, **config))
        return [engine.generate(q, images, params).token_ids for q, images in REQUESTS[:2]]

    cuda = sampled(device="cuda", cuda_graphs=True)
    assert cuda == sampled()
    assert len(set(map(tuple, cuda))) == 2


def test_qwen2_vl_tower_replays_from_a_cuda_graph(checkpoint):
    path = checkpoint("qwen2_vl")
    sizes = ((128, 96), (80, 128))
    cpu, _ = tokens(path)
    cuda, engine = tokens(path, device="cuda", cuda_graphs=True, vision_compile_sizes=sizes)
    tower = engine.vision_engine
    assert len(tower.captured_signatures) == 2, tower.capture_error
    assert cuda == cpu
    for seed, size in enumerate(sizes):
        inputs = engine.adapter.process_image(noise_image(*size, seed=seed)).tensors
        replayed = tower.encode(inputs)
        assert tower.compile_error is None  # the graphs hold the compiled tower
        torch.testing.assert_close(replayed, tower._run(tower._compiled, inputs), rtol=0, atol=1e-6)
        torch.testing.assert_close(replayed, tower._run(tower.module, inputs), rtol=1e-4, atol=1e-4)
        assert tower.encode(engine.adapter.process_image(noise_image(*size, seed=9)).tensors).data_ptr() \
            != replayed.data_ptr()  # each replay's output is the caller's own


def test_a_prompt_waits_on_the_device_for_its_picture_stream(checkpoint):
    """``submit`` queues the tower and the embeddings' merge on the picture stream and returns without
    waiting for them; the prompt's first chunk waits for them on the device. The picture stream is
    held busy first, so a chunk that did not wait would read the embeddings before they are made."""
    path = checkpoint("qwen2_vl")
    cpu, _ = tokens(path)
    engine = Engine.load(path, config=EngineConfig(num_blocks=512, max_batch_size=4, device="cuda", cuda_graphs=True,
                                                   vision_compile_sizes=((128, 96), (80, 128))))
    stream = engine.picture_stream
    assert stream is not None and stream != torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of the stream's time
    seqs = [engine.submit(q, images, FORCED) for q, images in REQUESTS]
    assert not stream.query(), "submit waited for the picture stream"
    assert all(s.embeds_ready is not None for s in seqs)
    assert [r.token_ids for r in engine.run_until_done(seqs)] == cpu
    assert all(s.embeds_ready is None for s in seqs)


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_bursts_equal_single_graph_steps(checkpoint, family):
    path = checkpoint(family)
    single, _ = tokens(path, device="cuda", dtype="bfloat16", cuda_graphs=True, decode_burst=1)
    burst, engine = tokens(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    assert engine.counters["decode_bursts"] > 0
    assert burst == single


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_cuda_graphs_agree_with_eager_in_bf16(checkpoint, family):
    """In bf16 the graphed engine and the eager one part late on a random checkpoint, at the
    same positions whether decode runs fused or compiled (so it enters before decode, most likely
    in prompt chunks replayed from padded-length graphs, which round differently); the first divergence
    is printed and the first token must agree. fp32 graphs equal the CPU exactly (above)."""
    path = checkpoint(family)
    eager, _ = tokens(path, device="cuda", dtype="bfloat16")
    graphed, _ = tokens(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    positions = [first_divergence(a, b) for a, b in zip(eager, graphed)]
    print(f"{family}: first divergence graphed vs eager per request (None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions)


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_bf16_divergence_from_fp32_is_reported(checkpoint, family, record_property):
    path = checkpoint(family)
    reference, _ = tokens(path)
    bf16, _ = tokens(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    positions = [first_divergence(a, b) for a, b in zip(reference, bf16)]
    record_property("bf16_first_divergence", positions)
    print(f"{family}: first bf16 divergence per request (None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions), "the first token must agree"


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_fused_kernels_agree_with_compiled_layers(checkpoint, family):
    """bf16: the fused Triton step and the compiled layers round differently inside attention, so
    tokens may part late on a random checkpoint; the first divergence is printed, the first token must agree."""
    if triton_decode.triton is None:
        pytest.skip("needs Triton (`import triton` failed)")
    path = checkpoint(family)
    compiled, _ = tokens(path, device="cuda", dtype="bfloat16", cuda_graphs=True, fused_decode=False)
    fused, engine = tokens(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    report = engine.decoder_engine.kernel_report
    assert report["fused"]
    # the tiles were chosen by whole-step time too, and the step ran with the ones it kept
    step = report["step"]
    print(f"{family}: tiles chosen in the step: {step}")
    assert step["trials"] > 0 and step["in_step_us"] <= step["alone_us"]
    kept = {name: p["config"] for name, p in report["products"].items()}
    assert kept == {name: triton_decode._config_name(c) for name, c in engine.decoder_engine._fused.configs.items()}
    positions = [first_divergence(a, b) for a, b in zip(compiled, fused)]
    print(f"{family}: first divergence fused vs compiled per request (None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions)


def alone(path, **config):
    """Each request on its own: batch 1, where a machine with Triton runs the fused step."""
    engine = Engine.load(path, config=EngineConfig(num_blocks=512, max_batch_size=4, **config))
    return [engine.generate(q, images, FORCED).token_ids for q, images in REQUESTS], engine


def _needs_triton():
    if triton_decode.triton is None:
        pytest.skip("needs Triton (`import triton` failed)")


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl", "llava"])
def test_batch_one_fused_step_in_fp32_matches_cpu(checkpoint, family):
    _needs_triton()
    path = checkpoint(family)
    cpu, _ = alone(path)
    cuda, engine = alone(path, device="cuda", cuda_graphs=True)
    report = engine.decoder_engine.kernel_report
    assert report["fused"] and report["fused_replays"] > 0, report
    assert cuda == cpu


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_batch_one_fused_bursts_equal_fused_single_steps(checkpoint, family):
    _needs_triton()
    path = checkpoint(family)
    single, _ = alone(path, device="cuda", dtype="bfloat16", cuda_graphs=True, decode_burst=1)
    burst, engine = alone(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    assert engine.counters["decode_bursts"] > 0 and engine.decoder_engine.fused_replays > 0
    assert burst == single


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_batch_one_fused_step_against_eager_in_bf16_is_reported(checkpoint, family):
    """The fused kernels round inside attention and the products in another order than eager
    torch: tokens may part late on a random checkpoint. The first divergence is printed; the
    first token must agree."""
    _needs_triton()
    path = checkpoint(family)
    eager, _ = alone(path, device="cuda", dtype="bfloat16")
    fused, _ = alone(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    positions = [first_divergence(a, b) for a, b in zip(eager, fused)]
    print(f"{family}: first divergence batch-1 fused vs eager per request (None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions)


def test_tiles_one_engine_timed_are_taken_by_the_next_with_the_same_tokens(checkpoint, monkeypatch, tmp_path):
    """The fused step's tiles are kept in the tile cache: a second engine (as a second process would,
    its reads of the file forgotten) takes them, times nothing and gives the same tokens."""
    _needs_triton()
    monkeypatch.setenv(tile_cache.TILE_CACHE_ENV, str(tmp_path / "tiles"))
    path = checkpoint("qwen2_vl")
    first, engine = alone(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    timed = engine.decoder_engine.kernel_report
    assert timed["fused"] and timed["tiles"] == "timed", timed
    assert list((tmp_path / "tiles").glob("*.json")), "the choices were written"
    tile_cache.forget_reads()
    monkeypatch.setattr(triton_decode, "graph_time_us", lambda calls: pytest.fail("timed a tile the cache holds"))
    second, engine = alone(path, device="cuda", dtype="bfloat16", cuda_graphs=True)
    kept = engine.decoder_engine.kernel_report
    assert kept["tiles"] == "cache" and kept["products"] == timed["products"] and kept["step"] == timed["step"]
    assert second == first


def test_the_fused_step_compiles_its_tiles_ahead_and_its_timings_compile_nothing(checkpoint, monkeypatch):
    """Every candidate tile is compiled on threads before the timings (``kernels.compile_ahead``):
    with the kernels' own caches emptied and no tile cache, no timing compiles a kernel."""
    _needs_triton()
    from collections import defaultdict

    from edgeinfer.testing.triton_compile import binaries

    monkeypatch.setenv(tile_cache.TILE_CACHE_ENV, "off")
    jitted = [triton_decode._gemv_kernel, triton_decode._packed_gemv_kernel]
    for kernel in jitted:
        monkeypatch.setattr(kernel, "device_caches", defaultdict(kernel.create_binder))
    timings, real = [], triton_decode.graph_time_us

    def graph_time_us(calls):
        before = binaries(jitted)
        us = real(calls)
        timings.append(binaries(jitted) - before)
        return us

    monkeypatch.setattr(triton_decode, "graph_time_us", graph_time_us)
    _, engine = alone(checkpoint("qwen2_vl"), device="cuda", dtype="bfloat16", cuda_graphs=True)
    ahead = engine.decoder_engine.kernel_report["compiled_ahead"]
    print(f"compiled ahead: {ahead}")
    assert timings and binaries(jitted) > 0 and ahead["compiles"] > 0
    assert not any(timings), f"kernels compiled during the timings: {timings}"
    products = engine.decoder_engine.kernel_report["products"]  # every tile passed its check against torch
    assert all("wrong_outputs" not in report for report in products.values()), products


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])
def test_graphs_captured_at_start_up_leave_nothing_to_capture_on_live_traffic(checkpoint, family):
    """With a capture budget, every decode graph is captured at load: greedy, sampled and
    penalized rows in batches of 1 to 4 then capture nothing, and give the tokens of an engine
    that captured them on first use. A budget too small to finish says so and captures the rest later."""
    path = checkpoint(family)
    params = [FORCED, SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, seed=5),
              SamplingParams(max_new_tokens=32, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.7, top_p=0.9, seed=9)]

    def run(engine):
        out = []
        for n in (1, 2, 3, 4):
            seqs = [engine.submit(q, images, p) for (q, images), p in zip(REQUESTS * 2, params[:n])]
            out.append([r.token_ids for r in engine.run_until_done(seqs)])
        return out

    config = EngineConfig(num_blocks=512, max_batch_size=4, max_context=512, device="cuda", cuda_graphs=True)
    eager_capture = Engine.load(path, config=config)
    expected = run(eager_capture)
    engine = Engine.load(path, config=replace(config, capture_budget_s=600.0))
    report = engine.startup_capture
    assert report is not None and report["captured"] == report["planned"] > 0
    def graphs():  # a prompt's first chunk is captured at load too; chunks after a cached prefix on first use
        decoder = engine.decoder_engine
        return set(decoder._graphs), set(decoder._bursts), {key for key in decoder._prefills if key[1] == 0}

    before = graphs()
    assert before[2], "no prompt chunk was captured at load"
    assert run(engine) == expected
    assert graphs() == before, "live traffic captured a decode graph or a prompt's first chunk"
    with pytest.warns(UserWarning, match="capture_budget_s"):
        short = Engine.load(path, config=replace(config, capture_budget_s=1e-9))
    assert short.startup_capture["captured"] < short.startup_capture["planned"]
