"""Gemma 3 through our loader and decoder, token for token against transformers.

The tiny checkpoint (``edgeinfer.testing.checkpoints.GEMMA3_SIZES``) has sliding windows of 6
tokens between global layers, two fast-turning RoPE bases, 16 tokens per picture and
Gemma's ``1 + w`` norms; the mutation tests show that each of those details changes the
32 tokens, so the parity tests would see it wrong.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.engine.sequence import Sequence
from edgeinfer.models.gemma3 import Gemma3Adapter, image_runs
from tests.conftest import noise_image

QUESTION = "how many circle are there ?"
FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
MIN_DISTINCT = 12
CASES = {
    "text": [],
    "one_image": [noise_image(120, 80, seed=1)],
    "two_images": [noise_image(120, 80, seed=1), noise_image(60, 100, seed=2)],
}
# Pan-and-scan as transformers' processor does it when called with these arguments; the
# checkpoint folder asks for it in processor_config.json.
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 2,
                "pan_and_scan_min_ratio_to_activate": 1.2}


@pytest.fixture(scope="module")
def gemma3(checkpoint):
    return checkpoint("gemma3")


@pytest.fixture(scope="module")
def pan_and_scan(gemma3, tmp_path_factory):
    """The tiny checkpoint with pan-and-scan asked for in its processor_config.json."""
    folder = tmp_path_factory.mktemp("gemma3_pan_and_scan") / "model"
    shutil.copytree(gemma3, folder)
    config = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps(config | PAN_AND_SCAN))
    return folder


@pytest.fixture(scope="module")
def reference(hf_model):
    """reference(path, case) -> transformers' greedy tokens on our prompt ids, computed once."""
    done = {}

    def get(path, case: str):
        if (path, case) not in done:
            engine = load_engine(path)
            prompt_ids = engine.submit(QUESTION, CASES[case], FORCED).prompt_ids
            done[path, case] = hf_generate(hf_model(path), hf_inputs(engine, prompt_ids, CASES[case]))
        return done[path, case]

    return get


def load_engine(path, prefill_chunk: int = 512, **config) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=256, prefill_chunk=prefill_chunk,
                                                 **config))


def hf_inputs(engine: Engine, prompt_ids: list[int], images) -> dict:
    ids = torch.tensor([prompt_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        adapter = engine.adapter
        processed = adapter.image_processor(images=images, return_tensors="pt", **adapter.image_kwargs())
        inputs |= {"pixel_values": processed["pixel_values"],
                   "token_type_ids": (ids == adapter.image_token_id).long()}
    return inputs


def hf_generate(model, inputs: dict, new_tokens: int = 32) -> list[int]:
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def generate(path, case: str, **config) -> list[int]:
    return load_engine(path, **config).generate(QUESTION, CASES[case], FORCED).token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(gemma3, reference, case):
    tokens = generate(gemma3, case)
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == reference(gemma3, case)


@pytest.mark.parametrize("case", ["one_image", "two_images"])
def test_pan_and_scan_crops_match_transformers(pan_and_scan, reference, case):
    engine = load_engine(pan_and_scan)
    seq = engine.submit(QUESTION, CASES[case], FORCED)
    assert len(image_runs(seq.prompt_ids, engine.adapter.image_token_id).unique()) - 1 > len(CASES[case])  # crops
    assert engine.run_until_done([seq])[0].token_ids == reference(pan_and_scan, case)


def test_prefill_chunks_never_cut_an_image(gemma3, reference):
    """16-token chunks would end inside the images; each chunk is stretched to the end of the
    image it reaches, so every image token still sees its whole image."""
    engine = load_engine(gemma3, prefill_chunk=16)
    seq = engine.submit(QUESTION, CASES["two_images"], FORCED)
    assert seq.chunk_end(10) > 10 + 6, "the test needs a chunk end inside an image"
    assert engine.run_until_done([seq])[0].token_ids == reference(gemma3, "two_images")


def test_batched_rows_keep_their_own_masks(gemma3, reference):
    engine = load_engine(gemma3, prefill_chunk=16)
    seqs = [engine.submit(QUESTION, CASES[case], FORCED) for case in CASES]
    assert [r.token_ids for r in engine.run_until_done(seqs)] == [reference(gemma3, case) for case in CASES]


# --- the parity tests see each detail: a mutation of it changes the tokens -------------------

def _replace(**changes):
    return lambda cfg: dataclasses.replace(cfg, **{k: v(cfg) if callable(v) else v for k, v in changes.items()})


DECODER_MUTATIONS = {
    "window one token longer": _replace(sliding_window=lambda c: c.sliding_window + 1),
    "window one token shorter": _replace(sliding_window=lambda c: c.sliding_window - 1),
    "window one block longer": _replace(sliding_window=lambda c: c.sliding_window + 16),
    "no sliding layers": _replace(sliding_layers=lambda c: (False,) * c.num_layers),
    "norm without + 1": _replace(norm_offset=0.0),
    "head_dim attention scale": _replace(attn_scale=None),
    "unscaled embeddings": _replace(embed_scale=1.0),
}


@pytest.mark.parametrize("mutation", list(DECODER_MUTATIONS))
def test_a_wrong_decoder_detail_changes_tokens(gemma3, reference, monkeypatch, mutation):
    right = Gemma3Adapter.decoder_config
    monkeypatch.setattr(Gemma3Adapter, "decoder_config", lambda self: DECODER_MUTATIONS[mutation](right(self)))
    assert generate(gemma3, "two_images") != reference(gemma3, "two_images")


def test_causal_image_attention_changes_tokens(gemma3, reference, monkeypatch):
    right = Gemma3Adapter.layout
    monkeypatch.setattr(Gemma3Adapter, "layout",
                        lambda self, ids, images: dataclasses.replace(right(self, ids, images), attend_groups=None))
    assert generate(gemma3, "one_image") != reference(gemma3, "one_image")


def test_global_rope_on_sliding_layers_changes_tokens(gemma3, reference, monkeypatch):
    right = Gemma3Adapter.build_decoder

    def one_rope(self, tensors, dtype):
        decoder = right(self, tensors, dtype)
        decoder.local_inv_freq = decoder.inv_freq.clone()
        return decoder

    monkeypatch.setattr(Gemma3Adapter, "build_decoder", one_rope)
    assert generate(gemma3, "text") != reference(gemma3, "text")


def test_a_chunk_cutting_an_image_changes_tokens(gemma3, reference, monkeypatch):
    monkeypatch.setattr(Sequence, "chunk_end", lambda self, end: end)
    assert generate(gemma3, "two_images", prefill_chunk=16) != reference(gemma3, "two_images")


# --- the processor ---------------------------------------------------------------------------

@pytest.mark.parametrize("crops", [False, True])
def test_prompt_ids_match_transformers_processor(gemma3, pan_and_scan, crops):
    from transformers import AutoProcessor

    path = pan_and_scan if crops else gemma3
    engine = load_engine(path)
    images = CASES["two_images"] + [noise_image(64, 64, seed=3)]
    seq = engine.submit(QUESTION, images, SamplingParams(max_new_tokens=1))
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = processor(text=[text], images=[images], return_tensors="pt", **(PAN_AND_SCAN if crops else {}))
    assert seq.prompt_ids == expected["input_ids"][0].tolist()
    groups = image_runs(seq.prompt_ids, engine.adapter.image_token_id)
    assert torch.equal(groups >= 0, expected["token_type_ids"][0].bool())
    assert seq.image_tokens == engine.adapter.tokens_per_picture * expected["pixel_values"].shape[0]


def test_stop_tokens_include_end_of_turn(gemma3):
    adapter = load_engine(gemma3).adapter
    ids = adapter.tokenizer.convert_tokens_to_ids(["<eos>", "<end_of_turn>"])
    assert set(adapter.stop_token_ids()) == set(ids)


# --- the prefix cache keys on image content --------------------------------------------------

def test_a_second_question_about_the_same_image_reuses_its_blocks(gemma3):
    image = CASES["one_image"]
    cold = load_engine(gemma3).generate("how many shapes ?", image, FORCED)
    engine = load_engine(gemma3)
    engine.generate("what is in the image ?", image, FORCED)
    second = engine.generate("how many shapes ?", image, FORCED)
    image_end = max(s.end for s in engine.submit("x", image).image_spans)
    assert second.cache["vision_reused"] == 1 and second.cache["prefix_tokens_reused"] >= image_end // 16 * 16
    assert second.token_ids == cold.token_ids


def test_a_different_image_behind_the_same_tokens_never_matches(gemma3):
    engine = load_engine(gemma3)
    engine.generate("what is in the image ?", CASES["one_image"], FORCED)
    other = engine.generate("what is in the image ?", [noise_image(120, 80, seed=5)], FORCED)
    first_image_token = min(s.start for s in engine.submit("x", CASES["one_image"]).image_spans)
    assert other.cache["prefix_tokens_reused"] <= first_image_token
    assert other.cache["vision_reused"] == 0


# --- the CUDA-graph engine's static shapes, run eagerly off the GPU ---------------------------

def test_cuda_graph_static_steps_match_the_decoder(gemma3):
    """Whole blocks under the window masks (what the graphs capture) give ``Decoder.forward``'s
    logits and K/V, for contexts inside and well past the sliding window."""
    from edgeinfer.models.loader import load_model

    decoder = load_model(gemma3).decoder
    assert_static_steps_match(decoder, lambda tokens, gen: torch.randn(1, tokens, decoder.cfg.hidden_size,
                                                                       generator=gen))


def assert_static_steps_match(decoder, inputs) -> None:
    """The CUDA-graph engine's static steps, run eagerly, against ``decoder.forward`` on a scattered
    pool; ``inputs(tokens, generator)`` makes the [1, tokens, width] inputs."""
    from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine

    engine = CudaGraphDecoderEngine(decoder, 4, 8, compile_layers=False)
    cfg = decoder.cfg
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v_pool = torch.randn(k_pool.shape, generator=gen)
    table = torch.randperm(16, generator=gen)[:8][None]
    for context, tokens in ((0, 5), (3, 1), (13, 1), (13, 4), (27, 1)):
        x = inputs(tokens, gen)
        positions = (context + torch.arange(tokens))[None]
        lens = torch.tensor([context])
        with torch.no_grad():
            want = decoder(x, positions, k_pool, v_pool, table, lens)
            if tokens == 1:
                got = engine._static_step(x, positions, k_pool, v_pool, table, lens)
            else:
                got = engine._prefill_step(x, positions, k_pool, v_pool, table, lens, torch.tensor([tokens - 1]),
                                           past=context > 0)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_decode_bursts_give_the_step_by_step_tokens(gemma3):
    from edgeinfer.backends.base import Engines
    from edgeinfer.backends.torch.cuda_graphs import CudaGraphDecoderEngine
    from edgeinfer.backends.torch.eager import TorchVisionEngine
    from edgeinfer.models.loader import load_model

    config = EngineConfig(block_size=16, num_blocks=256, max_batch_size=4)
    model = load_model(gemma3)
    decoder = CudaGraphDecoderEngine(model.decoder, 4, -(-config.max_context // 16), compile_layers=False)
    engine = Engine(model, config, Engines(decoder, TorchVisionEngine(model.vision), "torch", "fp32", bursts=decoder))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # bursts start past min_new_tokens
    plain = load_engine(gemma3)
    expected = plain.run_until_done([plain.submit(QUESTION, CASES[case], params) for case in CASES])
    results = engine.run_until_done([engine.submit(QUESTION, CASES[case], params) for case in CASES])
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert engine.counters["decode_bursts"] > 0


def test_the_fused_triton_step_refuses_gemma_layers(gemma3):
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.models.loader import load_model

    with pytest.raises(ValueError, match="norm_offset.*sliding_layers"):
        triton_decode.FusedDecode(load_model(gemma3).decoder)


# --- the KV blocks a sliding layer no longer reads ---------------------------------------------

def test_sliding_layers_never_read_blocks_outside_their_window(gemma3):
    """Blocks past a sliding layer's window are counted, then overwritten with large values in
    the sliding layers only: the step's logits and new K/V stay exactly the same, so nothing
    reads them, and a pool that freed them would lose nothing. (This pool keeps them: every
    layer of a block is allocated together.)"""
    from edgeinfer.kv.sizing import blocks_outside_window, sliding_window_saving
    from edgeinfer.models.loader import load_model

    decoder = load_model(gemma3).decoder
    cfg, block_size, context = decoder.cfg, 4, 41
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(cfg.num_layers, 16, block_size, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v_pool = torch.randn(k_pool.shape, generator=gen)
    table = torch.randperm(16, generator=gen)[:11][None]
    x = torch.randn(1, 1, cfg.hidden_size, generator=gen)
    step = (torch.tensor([[context]]), k_pool, v_pool, table, torch.tensor([context]))
    with torch.no_grad():
        want = decoder(x, *step[:1], *step[1:])
        unread = blocks_outside_window(context, block_size, cfg.sliding_window)
        assert unread == 9  # tokens 0..35: the next query, token 41, sees 36..41
        sliding = [i for i in range(cfg.num_layers) if cfg.is_sliding(i)]
        for layer in sliding:
            k_pool[layer, table[0, :unread]] = 1e4
            v_pool[layer, table[0, :unread]] = -1e4
        got = decoder(x, *step[:1], *step[1:])
        k_pool[[i for i in range(cfg.num_layers) if not cfg.is_sliding(i)][0], table[0, 0]] = 1e4
        global_changed = decoder(x, *step[:1], *step[1:])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert not torch.equal(global_changed[0], want[0]), "the global layers do read the whole past"
    saving = sliding_window_saving(context, block_size, cfg.sliding_window, len(sliding), cfg.num_layers)
    print(f"sliding layers leave {unread} of {-(-context // block_size)} blocks unread: "
          f"{saving:.0%} of this sequence's KV bytes")
    assert saving == pytest.approx(9 * 2 / (11 * 4))


# --- ONNX Runtime ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def onnx_engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEINFER_ENGINES", str(root))
        yield root


def test_decoder_graph_matches_the_torch_step(gemma3, onnx_engines):
    """Image runs, windows and contexts past the window, on shapes other than the export's."""
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.backends.onnx.export import DECODER_FILE, cpu_session
    from edgeinfer.backends.onnx.graphs import decoder_example
    from edgeinfer.models.loader import load_model

    model = load_model(gemma3)
    folder = build_engines(model, BuildSpec.custom("export"), onnx_engines, progress=False).folder
    session = cpu_session(folder / DECODER_FILE)
    for case in (dict(batch=1, tokens=9, context=[0], block_size=4, num_blocks=8),
                 dict(batch=2, tokens=5, context=[13, 2], block_size=4, num_blocks=40),
                 dict(batch=3, tokens=1, context=[17, 4, 30], block_size=8, num_blocks=40)):
        inputs = decoder_example(model.decoder, **case)
        if case["tokens"] > 1:  # two image runs and text between them
            inputs["image_groups"] = torch.tensor([-1, 0, 0, 0, -1, 1, 1, 1, -1][:case["tokens"]]).expand(
                case["batch"], -1).contiguous()
        with torch.no_grad():
            expected = model.decoder(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.from_numpy(g), e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_tokens_match_transformers(gemma3, reference, onnx_engines, case):
    engine = Engine.load(gemma3, backend="onnxruntime",
                         config=EngineConfig(block_size=16, num_blocks=256, prefill_chunk=16))
    assert engine.backend == "onnxruntime" and type(engine.vision_engine).__name__ == "OrtVisionEngine"
    assert engine.generate(QUESTION, CASES[case], FORCED).token_ids == reference(gemma3, case)


def test_tensorrt_refuses_gemma_decoders_before_building(gemma3):
    from edgeinfer.backends.tensorrt.build import check_decoder_supported
    from edgeinfer.errors import EngineBuildError
    from edgeinfer.models.loader import load_model

    with pytest.raises(EngineBuildError, match="sliding_layers.*Gemma 3"):
        check_decoder_supported(load_model(gemma3).decoder.cfg)


def test_attention_softcap_is_ignored_as_transformers_ignores_it(gemma3, reference, tmp_path):
    """transformers' Gemma 3 attention never passes ``attn_logit_softcapping`` on, in any of its
    attention paths (eager included); with a cap of 1.5 in the config both give the uncapped tokens.
    Should transformers start applying it, this test fails and the decoder needs the cap."""
    from transformers import AutoModelForImageTextToText

    folder = tmp_path / "capped"
    shutil.copytree(gemma3, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["attn_logit_softcapping"] = 1.5
    (folder / "config.json").write_text(json.dumps(config))
    engine = load_engine(folder)
    seq = engine.submit(QUESTION, CASES["one_image"], FORCED)
    hf = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    expected = hf_generate(hf, hf_inputs(engine, seq.prompt_ids, CASES["one_image"]))
    assert expected == reference(gemma3, "one_image")
    assert engine.run_until_done([seq])[0].token_ids == expected
