"""A wake redoes no process-wide work: the engines stay open, nothing is compiled again.

The CUDA-graph decoder engine runs off the GPU too (its bursts and prompt chunks eagerly, its
layers compiled), so its sleep and wake are checked here on the CPU with a tiny checkpoint.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from edgeinfer.backends.base import Engines
from edgeinfer.backends.registry import Backend
from edgeinfer.engine import Engine, SamplingParams
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LoadRecipe
from edgeinfer.engine.sleep import DroppedWeights, WeightsChanged
from edgeinfer.models.loader import load_model
from tests.conftest import noise_image

QUESTION = "Describe the picture."
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture
def eager_compiler(monkeypatch):
    """torch.compile with its "eager" backend: dynamo traces and guards exactly as with inductor
    (what decides a recompile), without inductor's C++ build (half a minute on two cores)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


def graph_engine(path, tmp_path, declare_graphs: bool = True) -> Engine:
    from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine
    from edgeinfer.backends.torch.eager import TorchVisionEngine

    config = EngineConfig(num_blocks=64, max_batch_size=2, disk_dir=str(tmp_path))
    model = load_model(path, config.torch_dtype, config.device)
    decoder = CudaGraphDecoderEngine(model.decoder, config.max_batch_size, -(-config.max_context // config.block_size),
                                     take_decoder=True)
    vision = TorchVisionEngine(model.vision)
    engines = Engines(decoder, vision, "torch", "fp32", bursts=decoder, compiler=vision,
                      graphs=decoder if declare_graphs else None)
    return Engine(model, config, engines, recipe=LoadRecipe(path, Backend.TORCH, None, None, False))


def dynamo_graphs() -> int:
    """Graphs dynamo compiled in this process (first compilations and recompilations alike)."""
    return counters["stats"]["unique_graphs"]


def test_a_wake_keeps_the_engines_and_compiles_nothing_again(checkpoint, tmp_path, eager_compiler):
    engine = graph_engine(checkpoint("qwen2_vl"), tmp_path)
    picture = noise_image(64, 64)
    decoder = engine.decoder_engine
    weights = [id(p) for p in engine.model.decoder.parameters()]
    before = engine.generate(QUESTION, [picture], GREEDY)
    assert engine.counters["decode_bursts"] > 0  # the compiled layers ran
    graphs = decoder.capture_state()
    assert graphs["prefill_graphs"] > 0 and graphs["burst_graphs"] > 0
    compiled = dynamo_graphs()
    assert compiled > 0

    for level in (1, 2, 1):  # the first wake of the process, then later ones
        engine.sleep(level)
        assert decoder.capture_state()["burst_graphs"] == 0  # they held the pool that was freed
        after = engine.generate(QUESTION, [picture], GREEDY)
        assert after.token_ids == before.token_ids, f"level {level}"
        assert engine.decoder_engine is decoder and [id(p) for p in engine.model.decoder.parameters()] == weights
        assert engine.sleep_stats.last_wake_captures >= graphs["prefill_graphs"] + graphs["burst_graphs"]
        assert after.timings["wake_s"] >= after.timings["wake_capture_s"] > 0
        assert dynamo_graphs() == compiled, f"level {level}: dynamo compiled again after the wake"
    engine.close()


def test_level_1_then_2_refills_the_same_tensors(checkpoint, tmp_path, eager_compiler):
    engine = graph_engine(checkpoint("smolvlm"), tmp_path)
    before = engine.generate(QUESTION, [], GREEDY)
    engine.sleep(1)
    engine.sleep(2)
    assert all(p.numel() == 0 for p in engine.model.decoder.parameters())  # nothing kept, not even on the host
    assert engine.generate(QUESTION, [], GREEDY).token_ids == before.token_ids
    engine.close()


def test_a_bursting_decoder_that_cannot_drop_its_graphs_is_opened_again(checkpoint, tmp_path, eager_compiler):
    engine = graph_engine(checkpoint("smolvlm"), tmp_path, declare_graphs=False)
    decoder = engine.decoder_engine
    before = engine.generate(QUESTION, [], GREEDY)
    engine.sleep(1)
    assert engine.generate(QUESTION, [], GREEDY).token_ids == before.token_ids
    assert engine.decoder_engine is not decoder  # its bursts held the freed pool
    engine.close()


def test_dropped_weights_refuse_a_checkpoint_of_other_tensors(checkpoint):
    model = load_model(checkpoint("smolvlm"))
    dropped = DroppedWeights.of({"decoder": model.decoder})
    other = load_model(checkpoint("qwen2_vl"))
    with pytest.raises(WeightsChanged, match="tensors differ"):
        dropped.refill({"decoder": other.decoder})
    assert all(p.numel() == 0 for p in model.decoder.parameters())  # refused whole: nothing refilled
    same = load_model(checkpoint("smolvlm"))
    expected = [p.detach().clone() for p in same.decoder.parameters()]
    dropped.refill({"decoder": same.decoder})
    assert all(torch.equal(a, b) for a, b in zip(model.decoder.parameters(), expected))


def test_a_checkpoint_replaced_during_a_level_2_sleep_is_loaded_whole(checkpoint, tmp_path):
    import shutil

    from edgeinfer.profiles import load_profile

    folder = tmp_path / "model"
    shutil.copytree(checkpoint("smolvlm"), folder)
    profile = load_profile("cpu", ["kv.device_blocks=64", "memory.disk_tier_mb=0"])
    engine = Engine.load(folder, profile=profile, backend="torch")
    old_decoder, old_adapter = engine.model.decoder, engine.adapter
    engine.sleep(2)
    shutil.rmtree(folder)
    shutil.copytree(checkpoint("qwen2_vl"), folder)
    with pytest.warns(UserWarning, match="checkpoint changed while the engine slept"):
        engine.wake_up()
    assert engine.model.decoder is not old_decoder and type(engine.adapter) is not type(old_adapter)
    assert engine.generate(QUESTION, [], GREEDY).token_ids == load_and_generate(folder, profile)
    engine.close()


def load_and_generate(folder, profile) -> list[int]:
    engine = Engine.load(folder, profile=profile, backend="torch")
    ids = engine.generate(QUESTION, [], GREEDY).token_ids
    engine.close()
    return ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is false")
def test_on_a_gpu_the_wake_captures_and_the_question_after_it_compiles_nothing(checkpoint, tmp_path):
    """The first token after a wake: no compilation, no tile tuning, no capture (the wake did them)."""
    path = checkpoint("qwen2_vl")
    engine = Engine.load(path, config=EngineConfig(num_blocks=256, max_batch_size=2, device="cuda", cuda_graphs=True,
                                                   disk_dir=str(tmp_path)))
    picture = noise_image(64, 64)
    first = engine.generate(QUESTION, [picture], GREEDY)
    engine.generate(QUESTION, [picture], GREEDY)  # the prefix reused: as every question after a wake
    decoder = engine.decoder_engine
    state, compiled = decoder.capture_state(), dynamo_graphs()
    for level in (1, 2, 1):
        engine.sleep(level)
        assert all(p.numel() == 0 for p in engine.model.decoder.parameters()) and engine.kv is None
        assert decoder.capture_state()["prefill_graphs"] == decoder.capture_state()["burst_graphs"] == 0
        again = engine.generate(QUESTION, [picture], GREEDY)
        assert again.token_ids == first.token_ids, f"level {level}"
        assert engine.decoder_engine is decoder and engine.sleep_stats.last_wake_captures > 0
        after = decoder.capture_state()
        assert after["captures"] - state["captures"] == engine.sleep_stats.last_wake_captures  # all in the wake
        assert after["fused_tuned"] == state["fused_tuned"] and dynamo_graphs() == compiled
        state = after
    engine.close()
