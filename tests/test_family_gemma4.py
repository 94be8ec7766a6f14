"""Gemma 4 through our loader and decoder, token for token against transformers.

The tiny checkpoint (``edgeinfer.testing.checkpoints_gemma4``) has google/gemma-4-E2B's
structure: sliding windows of 8 tokens between global layers whose heads are twice as wide
and rotate a quarter of their angles, the last two layers reading earlier layers' K/V with
double-wide MLPs, per-layer input embeddings, layer scalars and a logit soft-cap. The
mutation tests show that each detail changes the 32 tokens, so the parity tests would see
it wrong. The same parity runs through ONNX Runtime at the end (one build per checkpoint,
its decoder graph also checked against the torch step). transformers' gemma4 modules are
imported inside the tests only.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.models import gemma4
from edgeinfer.models.gemma4 import Gemma4Adapter
from edgeinfer.testing.checkpoints_gemma4 import make_gemma4
from tests.conftest import noise_image
from tests.test_family_gemma3 import assert_static_steps_match, hf_generate, load_engine
from tests.test_family_gemma3 import onnx_engines  # noqa: F401  (the engines root of the ONNX tests, a fixture)

QUESTION = "how many circle are there ?"
FORCED = SamplingParams(max_new_tokens=32, min_new_tokens=32)
MIN_DISTINCT = 12
CASES = {
    "text": [],
    "one_image": [noise_image(120, 80, seed=1)],
    "two_images": [noise_image(120, 80, seed=1), noise_image(60, 100, seed=2)],
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These steps are a few kilobytes each: one intra-op thread runs them faster than two,
    which on a busy 2-core machine spin waiting for each other (about 10x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gemma4_path(tmp_path_factory):
    return make_gemma4(tmp_path_factory.mktemp("gemma4") / "model")


@pytest.fixture(scope="module")
def variant_path(tmp_path_factory):
    """The larger variants' options: keys as values with their own head count on global
    layers, and images attending to themselves on sliding layers."""
    types = [gemma4.SLIDING, gemma4.FULL] * 3  # global layer 3 owns K/V: layer 1's mask reaches the tokens
    return make_gemma4(tmp_path_factory.mktemp("gemma4_variant") / "model", seed=1, attention_k_eq_v=True,
                       num_global_key_value_heads=2, use_bidirectional_attention="vision", layer_types=types)


@pytest.fixture(scope="module")
def reference():
    """reference(path, case) -> transformers' greedy tokens on our prompt ids, computed once."""
    from transformers import AutoModelForImageTextToText

    done, models = {}, {}

    def get(path, case: str):
        if (path, case) not in done:
            if path not in models:
                models[path] = AutoModelForImageTextToText.from_pretrained(path).eval()
            engine = load_engine(path)
            prompt_ids = engine.submit(QUESTION, CASES[case], FORCED).prompt_ids
            done[path, case] = hf_generate(models[path], hf_inputs(engine, prompt_ids, CASES[case]))
        return done[path, case]

    return get


def hf_inputs(engine: Engine, prompt_ids: list[int], images) -> dict:
    ids = torch.tensor([prompt_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        adapter = engine.adapter
        processed = adapter.image_processor(images=images, return_tensors="pt")
        inputs |= {"pixel_values": processed["pixel_values"], "image_position_ids": processed["image_position_ids"],
                   "mm_token_type_ids": (ids == adapter.image_token_id).long()}
    return inputs


def generate(path, case: str, **config) -> list[int]:
    return load_engine(path, **config).generate(QUESTION, CASES[case], FORCED).token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(gemma4_path, reference, case):
    tokens = generate(gemma4_path, case)
    assert len(tokens) == 32
    assert len(set(tokens)) >= MIN_DISTINCT, "a near-constant sequence would make this comparison meaningless"
    assert tokens == reference(gemma4_path, case)


@pytest.mark.slow
def test_keys_as_values_and_images_seen_both_ways_match_transformers(variant_path, reference):
    engine = load_engine(variant_path, prefill_chunk=16)  # chunks stretched to the end of an image
    case = "two_images"
    assert engine.adapter.shape().layers[1].k_eq_v and engine.adapter.shape().layers[1].kv_heads == 2
    seq = engine.submit(QUESTION, CASES[case], FORCED)
    assert seq.attend_groups(0, seq.prompt_len) is not None
    assert engine.run_until_done([seq])[0].token_ids == reference(variant_path, case)


def test_logits_match_transformers_soft_cap_included(gemma4_path, tmp_path):
    """Greedy tokens cannot see the soft-cap (tanh keeps the order); the logits do. A cap of
    0.5 (the checkpoint's 30 barely bends its small logits) in a copy of the checkpoint."""
    from transformers import AutoModelForImageTextToText

    from edgeinfer.models.loader import load_model

    folder = tmp_path / "capped"
    shutil.copytree(gemma4_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    decoder = load_model(folder).decoder
    ids = torch.arange(40, 60)[None]
    cfg = decoder.cfg
    pool = torch.zeros(cfg.kv_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    hf = AutoModelForImageTextToText.from_pretrained(folder).eval()
    with torch.no_grad():
        ours = decoder(decoder.embed_tokens(ids), torch.arange(20)[None], pool, pool.clone(), torch.arange(2)[None],
                       torch.tensor([0]))[0]
        theirs = hf(input_ids=ids, use_cache=False).logits[:, -1]
    assert float(ours.abs().max()) < 0.5
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_shared_layers_read_their_source_layers_kv(gemma4_path):
    shape = Gemma4Adapter(load_engine(gemma4_path).adapter.checkpoint).shape()
    assert [layer.kv_source for layer in shape.layers] == [0, 1, 2, 3, 3, 2]
    assert [layer.head_dim for layer in shape.layers] == [16, 16, 32, 16, 16, 32]
    assert [layer.intermediate_size for layer in shape.layers] == [96] * 4 + [192] * 2


# --- the parity tests see each detail: a mutation of it changes the tokens -------------------

def _replace(**changes):
    return lambda cfg: dataclasses.replace(cfg, **{k: v(cfg) if callable(v) else v for k, v in changes.items()})


DECODER_MUTATIONS = {
    "window one token longer": _replace(sliding_window=lambda c: c.sliding_window + 1),
    "window one token shorter": _replace(sliding_window=lambda c: c.sliding_window - 1),
    "sliding layers see the whole past": _replace(sliding_window=4096),
    "head_dim attention scale": _replace(attn_scale=None),
}


@pytest.mark.parametrize("mutation", list(DECODER_MUTATIONS))
def test_a_wrong_decoder_detail_changes_tokens(gemma4_path, reference, monkeypatch, mutation):
    right = Gemma4Adapter.decoder_config
    monkeypatch.setattr(Gemma4Adapter, "decoder_config", lambda self: DECODER_MUTATIONS[mutation](right(self)))
    assert generate(gemma4_path, "text") != reference(gemma4_path, "text")


def _shape_mutation(change):
    def mutate(shape):
        return dataclasses.replace(shape, layers=tuple(change(i, layer) for i, layer in enumerate(shape.layers)))
    return mutate


SHAPE_MUTATIONS = {
    # layer 4 (sliding) reads sliding layer 0's K/V instead of layer 3's
    "shared layer reads an earlier layer's K/V": _shape_mutation(
        lambda i, layer: dataclasses.replace(layer, stores_kv=True) if i == 0
        else dataclasses.replace(layer, kv_source=0) if i == 4 else layer),
    "placeholder ids embedded as themselves": lambda shape: dataclasses.replace(shape, placeholder_ids=()),
}


@pytest.mark.parametrize("mutation", list(SHAPE_MUTATIONS))
def test_a_wrong_layer_shape_changes_tokens(gemma4_path, reference, monkeypatch, mutation):
    right = Gemma4Adapter.shape

    monkeypatch.setattr(Gemma4Adapter, "shape", lambda self: SHAPE_MUTATIONS[mutation](right(self)))
    assert generate(gemma4_path, "text") != reference(gemma4_path, "text")


def test_without_per_layer_inputs_tokens_change(gemma4_path, reference, monkeypatch):
    right = gemma4.Gemma4Decoder.per_layer_inputs
    monkeypatch.setattr(gemma4.Gemma4Decoder, "per_layer_inputs", lambda self, x, ids: right(self, x, ids) * 0)
    assert generate(gemma4_path, "text") != reference(gemma4_path, "text")


def test_ignoring_layer_scalars_changes_tokens(gemma4_path, reference, monkeypatch):
    right = Gemma4Adapter.build_decoder

    def unscaled(self, tensors, dtype):
        decoder = right(self, tensors, dtype)
        for layer in decoder.layers:
            layer.layer_scalar = torch.ones_like(layer.layer_scalar)
        return decoder

    monkeypatch.setattr(Gemma4Adapter, "build_decoder", unscaled)
    assert generate(gemma4_path, "text") != reference(gemma4_path, "text")


def test_full_rotation_on_global_layers_changes_tokens(gemma4_path, reference, monkeypatch):
    """Global layers rotate a quarter of their pairs ("proportional" RoPE); all of them is wrong."""
    right = Gemma4Adapter.build_decoder

    def fully_rotated(self, tensors, dtype):
        decoder = right(self, tensors, dtype)
        dim = decoder.inv_freq.shape[0] * 2
        decoder.inv_freq = 1.0 / (10.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return decoder

    monkeypatch.setattr(Gemma4Adapter, "build_decoder", fully_rotated)
    assert generate(gemma4_path, "text") != reference(gemma4_path, "text")


@pytest.mark.slow
def test_images_seen_both_ways_on_global_layers_changes_tokens(variant_path, reference, monkeypatch):
    """The variant's images attend to themselves on sliding layers only: on global ones too is wrong."""
    from edgeinfer.models import decoder as decoder_module

    def everywhere(self, inputs_embeds, position_ids, k_pool, v_pool, block_tables, context_lens, image_groups=None):
        tokens = inputs_embeds.shape[1]
        slots, mask = decoder_module.past_slots_and_mask(block_tables, context_lens, k_pool.shape[2], tokens)
        mask, window = decoder_module.layer_masks(self.cfg, mask, context_lens, slots.shape[1], tokens, image_groups)
        return self.run_layers(inputs_embeds, position_ids, decoder_module.past_reader(k_pool, v_pool, slots), mask,
                               window_mask=window)

    monkeypatch.setattr(gemma4.Gemma4Decoder, "forward", everywhere)
    assert generate(variant_path, "two_images") != reference(variant_path, "two_images")


@pytest.mark.slow
def test_causal_images_change_tokens(variant_path, reference, monkeypatch):
    right = Gemma4Adapter.layout
    monkeypatch.setattr(Gemma4Adapter, "layout",
                        lambda self, ids, images: dataclasses.replace(right(self, ids, images), attend_groups=None))
    assert generate(variant_path, "two_images") != reference(variant_path, "two_images")


# --- the processor ---------------------------------------------------------------------------

def image_only_processor(image_processor, tokenizer):
    """transformers' Gemma4Processor without its video and audio parts (the video processor
    needs torchvision). Expansion and tokenization stay the library's own
    (``ProcessorMixin.__call__`` with ``Gemma4Processor.replace_image_token``)."""
    from transformers import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyGemma4Processor(Gemma4Processor):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            self.image_token_id, self.image_token = tokenizer.image_token_id, tokenizer.image_token
            self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
            self.boa_token, self.eoa_token, self.audio_token = tokenizer.boa_token, tokenizer.eoa_token, None
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)

    return ImageOnlyGemma4Processor(image_processor, tokenizer)


def test_prompt_ids_match_transformers_processor(gemma4_path):
    engine = load_engine(gemma4_path)
    adapter = engine.adapter
    images = CASES["two_images"] + [noise_image(64, 64, seed=3)]
    seq = engine.submit(QUESTION, images, SamplingParams(max_new_tokens=1))
    processor = image_only_processor(adapter.image_processor, adapter.tokenizer)
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": QUESTION}]
    text = adapter.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 chat_template=adapter.checkpoint.chat_template, tokenize=False,
                                                 add_generation_prompt=True)
    expected = processor(text=[text], images=[images], return_tensors="pt")
    assert seq.prompt_ids == expected["input_ids"][0].tolist()
    per_image = [adapter.process_image(image).num_tokens for image in images]
    assert seq.image_tokens == sum(per_image) == seq.prompt_ids.count(adapter.image_token_id)
    assert len(set(per_image)) > 1, "images of different shapes should give different token counts"


def test_stop_tokens_include_end_of_turn(gemma4_path):
    adapter = load_engine(gemma4_path).adapter
    assert set(adapter.stop_token_ids()) == set(adapter.tokenizer.convert_tokens_to_ids(["<eos>", "<turn|>"]))


# --- the prefix cache keys on image content --------------------------------------------------

def test_a_second_question_about_the_same_image_reuses_its_blocks(gemma4_path, reference):
    image = CASES["one_image"]
    engine = load_engine(gemma4_path)
    engine.generate("what is in the image ?", image, FORCED)
    second = engine.generate(QUESTION, image, FORCED)
    image_end = max(s.end for s in engine.submit("x", image).image_spans)
    assert second.cache["vision_reused"] == 1 and second.cache["prefix_tokens_reused"] >= image_end // 16 * 16
    assert second.token_ids == reference(gemma4_path, "one_image")
    other = engine.generate(QUESTION, [noise_image(120, 80, seed=5)], FORCED)
    assert other.cache["vision_reused"] == 0
    assert other.cache["prefix_tokens_reused"] <= min(s.start for s in engine.submit("x", image).image_spans)


# --- the KV pool ----------------------------------------------------------------------------

def test_the_pool_keeps_only_the_layers_that_own_k_v(gemma4_path):
    """Layers 4 and 5 attend to layers 3's and 2's K/V: the pool keeps layers 0-3 only, each in
    pool layers of the narrowest layer's width (a global layer's wider head takes two), a step
    returns exactly those, and every pool layer is read (large values there change the logits)."""
    from edgeinfer.models.loader import load_model

    decoder = load_model(gemma4_path).decoder
    cfg = decoder.cfg
    shape = decoder.shape
    assert shape.kv_owners == (0, 1, 2, 3) and cfg.num_layers == 6
    widths = [shape.layers[i].kv_heads * shape.layers[i].head_dim for i in shape.kv_owners]
    assert cfg.num_kv_heads * cfg.head_dim == min(widths) and cfg.kv_layers == sum(widths) // min(widths) > 4
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(cfg.kv_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v_pool = torch.randn(k_pool.shape, generator=gen)
    table = torch.randperm(8, generator=gen)[None]
    x = decoder.embed_tokens(torch.tensor([[40, 41]]))
    step = (torch.tensor([[21, 22]]), k_pool, v_pool, table, torch.tensor([21]))
    with torch.no_grad():
        want = decoder(x, *step)
        assert want[1].shape[0] == want[2].shape[0] == cfg.kv_layers
        for layer in range(cfg.kv_layers):
            saved = k_pool[layer].clone()
            k_pool[layer] = 1e4
            assert not torch.equal(decoder(x, *step)[0], want[0]), f"layer {layer}'s past was not read"
            k_pool[layer] = saved


def test_the_pool_overhead_docs_state_for_an_e2b_shape():
    """docs/families.md: the pool holds exactly the K/V the E2B shape's 15 owning layers need
    (3.9x that when all 35 layers had a slot of the widest layer's shape)."""
    from edgeinfer.testing.checkpoints_gemma4 import gemma4_config

    shape = gemma4.Gemma4Shape.from_hf(gemma4_config("gemma-4-e2b").text_config)
    assert shape.kv_values_per_token() == (12 * 256 + 3 * 512,) * 2 == (4608, 4608)
    assert shape.pool_slot == 256 and sum(len(span) for span in shape.pool_spans()) == 18


# --- the CUDA-graph engine's static shapes, run eagerly off the GPU ---------------------------

def test_cuda_graph_static_steps_match_the_decoder(gemma4_path):
    """Whole blocks under the window masks (what the graphs capture) give ``Decoder.forward``'s
    logits and K/V, for contexts inside and well past the sliding window."""
    from edgeinfer.models.loader import load_model

    decoder = load_model(gemma4_path).decoder
    assert_static_steps_match(decoder, lambda tokens, gen: decoder.embed_tokens(
        torch.randint(20, 500, (1, tokens), generator=gen)))


def test_the_fused_triton_step_refuses_gemma4_layers(gemma4_path):
    from edgeinfer.backends.torch import triton_decode
    from edgeinfer.models.loader import load_model

    with pytest.raises(ValueError, match="sandwich_norms"):
        triton_decode.FusedDecode(load_model(gemma4_path).decoder)


# --- what is not run is refused, with what it lacks ------------------------------------------

def test_mixture_of_experts_variants_are_refused_with_what_they_use(gemma4_path, tmp_path):
    from edgeinfer.errors import ModelLoadError
    from edgeinfer.models.loader import load_model

    folder = tmp_path / "moe"
    shutil.copytree(gemma4_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"] |= {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                              "moe_intermediate_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mixture-of-experts blocks"):
        load_model(folder)




def test_a_quantized_checkpoint_loads_dequantized_where_products_would_stay_packed(gemma4_path, tmp_path):
    """On a GPU a quantized checkpoint's products stay packed for the shared decoder's kernels;
    Gemma 4's layers dequantize them and give the dense load's logits."""
    from edgeinfer.models.loader import load_model
    from edgeinfer.testing.quantized import quantize_compressed_tensors

    folder = quantize_compressed_tensors(gemma4_path, tmp_path / "int8", bits=8, group_size=None)
    packed, dense = (load_model(folder, keep_packed=keep).decoder for keep in (True, False))
    ids = torch.arange(40, 60)[None]
    pool = torch.zeros(dense.cfg.kv_layers, 2, 16, dense.cfg.num_kv_heads, dense.cfg.head_dim)
    step = (torch.arange(20)[None], pool, pool.clone(), torch.arange(2)[None], torch.tensor([0]))
    with torch.no_grad():
        assert torch.equal(packed(packed.embed_tokens(ids), *step)[0], dense(dense.embed_tokens(ids), *step)[0])


# --- ONNX Runtime ------------------------------------------------------------------------------

ORT_CONFIG = dict(block_size=16, num_blocks=256, prefill_chunk=16)


def built_engines(path):
    """The ONNX Runtime build that ``Engine.load(path, backend="onnxruntime", ...ORT_CONFIG)``
    opens, made once per module (the ``onnx_engines`` root) and then skipped."""
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.models.loader import load_model

    model = load_model(path)
    return model, build_engines(model, BuildSpec.custom(block_size=ORT_CONFIG["block_size"]), progress=False)


def assert_graph_matches_the_torch_step(decoder, graph_path, image_groups: bool) -> None:
    """The decoder graph against ``Gemma4Decoder.forward`` on shapes other than the export's:
    prompts inside and past the sliding window, a batched decode step, block sizes 4 and 8,
    and (where the graph takes them) two image runs with text between them."""
    from edgeinfer.backends.onnx.export import cpu_session
    from edgeinfer.backends.onnx.graphs import decoder_example

    session = cpu_session(graph_path)
    for case in (dict(batch=1, tokens=9, context=[0], block_size=4, num_blocks=8),
                 dict(batch=2, tokens=5, context=[13, 2], block_size=4, num_blocks=40),
                 dict(batch=3, tokens=1, context=[17, 4, 30], block_size=8, num_blocks=40)):
        inputs = decoder_example(decoder, **case)
        if image_groups and case["tokens"] > 1:
            inputs["image_groups"] = torch.tensor([-1, 0, 0, 0, -1, 1, 1, 1, -1][:case["tokens"]]).expand(
                case["batch"], -1).contiguous()
        with torch.no_grad():
            expected = decoder(**inputs)
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.from_numpy(g), e, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("onnx_engines")
def test_decoder_graph_matches_the_torch_step(gemma4_path):
    from edgeinfer.backends.onnx.export import DECODER_FILE

    model, built = built_engines(gemma4_path)
    assert [name for name in built.manifest.engines if built.manifest.engine(name).runtime == "onnxruntime"] == \
        ["vision", "decoder"]
    assert_graph_matches_the_torch_step(model.decoder, built.folder / DECODER_FILE, image_groups=False)


@pytest.mark.usefixtures("onnx_engines")
@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_tokens_match_transformers(gemma4_path, reference, case):
    engine = Engine.load(gemma4_path, backend="onnxruntime", config=EngineConfig(**ORT_CONFIG))
    assert engine.backend == "onnxruntime" and type(engine.vision_engine).__name__ == "OrtVisionEngine"
    assert engine.generate(QUESTION, CASES[case], FORCED).token_ids == reference(gemma4_path, case)


@pytest.mark.slow
@pytest.mark.usefixtures("onnx_engines")
def test_variant_through_onnxruntime_matches_the_torch_step_and_transformers(variant_path, reference):
    """Keys as values with their own head count on global layers, and the ``image_groups``
    input of a checkpoint whose images see themselves on sliding layers (prompt chunks
    stretched to the end of an image, as on torch)."""
    from edgeinfer.backends.onnx.export import DECODER_FILE

    model, built = built_engines(variant_path)
    assert_graph_matches_the_torch_step(model.decoder, built.folder / DECODER_FILE, image_groups=True)
    engine = Engine.load(variant_path, backend="onnxruntime", config=EngineConfig(**ORT_CONFIG))
    assert engine.decoder_engine.image_groups
    assert engine.generate(QUESTION, CASES["two_images"], FORCED).token_ids == reference(variant_path, "two_images")


# The tiny checkpoint's weight matrices, each a MatMul weight of the decoder graph (q and k|v as two slices of
# qkv_t in the layers that own K/V, joined back by dequantized_weights; the sharing layers 4 and 5 have q only).
GEMMA4_WEIGHTS = {f"decoder.layers.{i}.{name}" for i in range(6)
                  for name in ("qkv_t", "o_t", "gate_up_t", "down_t", "ple_gate_t", "ple_proj_t")} | \
                 {"decoder.ple_model_proj_t", "decoder.lm_head_t"}


@pytest.fixture(scope="module")
def quantized_build(gemma4_path, tmp_path_factory):
    """quantized_build(precision) -> (engines root, folder) of the tiny checkpoint's int4 (accuracy
    level 0: float32 activations) or int8 ONNX Runtime build, made once per precision."""
    from edgeinfer.backends.onnx.build import BuildSpec, build_engines
    from edgeinfer.backends.onnx.quantize import Int4Options
    from edgeinfer.models.loader import load_model

    root, built = tmp_path_factory.mktemp("quantized"), {}

    def get(precision: str):
        if precision not in built:
            int4 = Int4Options(accuracy_level=0) if precision == "int4" else None
            spec = BuildSpec.custom(precision, ORT_CONFIG["block_size"], precision, int4=int4)
            built[precision] = build_engines(load_model(gemma4_path), spec, root, progress=False).folder
        return root, built[precision]

    return get


def quantized_engine(path, root, precision: str) -> Engine:
    engine = Engine.load(path, backend="onnxruntime", config=EngineConfig(profile_name=precision, **ORT_CONFIG),
                         engines_root=root)
    assert (engine.engines.backend, engine.engines.precision) == ("onnxruntime", precision)
    return engine


def torch_tokens(engine: Engine) -> dict[str, list[int]]:
    return {case: engine.generate(QUESTION, images, FORCED).token_ids for case, images in CASES.items()}


def test_int4_engine_gives_the_tokens_of_torch_on_the_dequantized_weights(gemma4_path, quantized_build):
    """Accuracy level 0: the ORT int4 engine and the torch engine running the very weights the
    graph holds (``dequantized_weights``, every one mapped onto the torch parameter it is) give
    the same 32 tokens for text, one image and two images. The torch engine on the checkpoint's
    float weights gives other tokens: that is where 4 bits show, and what this comparison sees."""
    from edgeinfer.backends.onnx.export import DECODER_FILE
    from tests.test_onnx_int4 import first_divergence, load_dequantized

    root, folder = quantized_build("int4")
    got = torch_tokens(quantized_engine(gemma4_path, root, "int4"))
    assert all(len(set(tokens)) >= MIN_DISTINCT for tokens in got.values())
    reference = Engine.load(gemma4_path, backend="torch", config=EngineConfig(**ORT_CONFIG))
    weights = load_dequantized(reference.engines.decoder.decoder, folder / DECODER_FILE, len(GEMMA4_WEIGHTS))
    assert set(weights) == GEMMA4_WEIGHTS
    assert got == torch_tokens(reference)
    fp32 = torch_tokens(Engine.load(gemma4_path, backend="torch", config=EngineConfig(**ORT_CONFIG)))
    divergence = {case: first_divergence(got[case], fp32[case]) for case in CASES}
    print("int4 vs fp32 weights, first divergence per question:", divergence)
    assert any(at is not None for at in divergence.values())


def test_int8_graph_holds_the_float_weights_rounded_per_column(gemma4_path, quantized_build):
    """The int8 build (``quantize_dynamic``) also quantizes each product's activations per step,
    to uint8 with one scale per tensor, which the torch engine does not: its tokens legitimately
    differ from torch's on the same weights (on this tiny checkpoint from the first token or
    two; the first divergence is printed, not asserted). What is checked is the weights: every
    weight MatMul of the graph is a MatMulInteger, each maps by name onto the torch parameter it
    is (the q and k|v slices joined), and each is that parameter rounded to the nearest step of
    its column's scale (``max |w| / 127``), exactly what the torch reference is given."""
    import onnx

    from edgeinfer.backends.onnx.export import DECODER_FILE
    from edgeinfer.models.loader import load_model
    from tests.test_onnx_int4 import first_divergence, load_dequantized

    root, folder = quantized_build("int8")
    nodes = onnx.load(str(folder / DECODER_FILE)).graph.node
    assert sum(n.op_type == "MatMulInteger" for n in nodes) == len(GEMMA4_WEIGHTS) + 4  # 4 layers' k|v slices
    floats = load_model(gemma4_path).decoder
    reference = Engine.load(gemma4_path, backend="torch", config=EngineConfig(**ORT_CONFIG))
    weights = load_dequantized(reference.engines.decoder.decoder, folder / DECODER_FILE, len(GEMMA4_WEIGHTS))
    assert set(weights) == GEMMA4_WEIGHTS
    for name, weight in weights.items():
        original = floats.get_parameter(name.removeprefix("decoder.")).detach()
        step = original.abs().amax(dim=0) / 127
        error = (torch.from_numpy(weight) - original).abs()
        assert bool((error <= 0.5 * step * (1 + 1e-5)).all()) and float(error.max()) > 0, name
    got = torch_tokens(quantized_engine(gemma4_path, root, "int8"))
    want = torch_tokens(reference)
    print("int8 vs torch on its weights, first divergence per question:",
          {case: first_divergence(got[case], want[case]) for case in CASES})


def test_tensorrt_refuses_gemma4_before_building(gemma4_path):
    """TensorRT builds from the same graphs, but its runtime does not drive Gemma decoders yet:
    refused before any export, pointing at the onnxruntime backend."""
    from edgeinfer.backends.tensorrt.build import check_decoder_supported
    from edgeinfer.errors import EngineBuildError
    from edgeinfer.models.loader import load_model

    with pytest.raises(EngineBuildError, match="per_layer_shapes.*fix: --backend onnxruntime"):
        check_decoder_supported(load_model(gemma4_path).decoder.cfg)
