"""The peer's side of every benchmark: transformers alone, in its own worker process.

Its prompt ids and pixels come from transformers' own processor for the checkpoint's
family, never from our engine; each task checks, at its start and at its end, that none of
our runtime (``edgeinfer.engine``, ``edgeinfer.backends``, ``edgeinfer.models``,
``edgeinfer.kv``) is loaded in the process.

Where a family's full processor needs torchvision for its video part (SmolVLM,
Qwen2-VL), the processor is transformers' image-only one for the same layout:
``Idefics3Processor`` (SmolVLM shares Idefics3's image layout) with ``image_seq_len`` from
the config, as SmolVLM's processor computes it; ``Qwen2VLProcessor`` without its video
processor. Tokenization, chat template and placeholder expansion stay the library's own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from edgeinfer.bench.common import (
    TokenClock,
    bench_image,
    environment,
    peak_memory_mb,
    peak_rss_mb,
    require_nothing_of_ours,
    sync,
)
from edgeinfer.bench.quiet import RunLog

IDEFICS3_FAMILIES = ("smolvlm", "idefics3")
QWEN2_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # Qwen3-VL expands images as Qwen2-VL does


def model_type(path: Path) -> str:
    return json.loads((Path(path) / "config.json").read_text())["model_type"]


def idefics3_image_seq_len(config: dict[str, Any]) -> int:
    """Image tokens per tile, as SmolVLM's and Idefics3's processors compute them from the config."""
    vision = config["vision_config"]
    return int(((vision["image_size"] // vision["patch_size"]) ** 2) / (config["scale_factor"] ** 2))


def peer_processor(path: Path):
    """transformers' processor for the checkpoint at ``path``, prompts padded on the left."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    family = model_type(path)
    if family in IDEFICS3_FAMILIES:
        from transformers import Idefics3Processor

        tokenizer = AutoTokenizer.from_pretrained(path)
        config = json.loads((Path(path) / "config.json").read_text())
        # Idefics3Processor names its image processor class; the checkpoint's is SmolVLM's (PIL).
        processor_cls = type("ImageOnlyIdefics3Processor", (Idefics3Processor,),
                             {"image_processor_class": "AutoImageProcessor"})
        processor = processor_cls(AutoImageProcessor.from_pretrained(path), tokenizer,
                                  image_seq_len=idefics3_image_seq_len(config), chat_template=tokenizer.chat_template)
    elif family in QWEN2_VL_FAMILIES:
        processor = _image_only_qwen2_vl(AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    else:
        processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    return processor


def _image_only_qwen2_vl(image_processor, tokenizer):
    """transformers' Qwen2VLProcessor without its video processor (which needs torchvision)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)

    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def user_turn(question: str, images: int = 1) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)),
                                         {"type": "text", "text": question}]}]


def peer_inputs(processor, path: Path, chats: list[list[dict]], images: list[list], device: str, dtype) -> dict:
    """Model inputs for a batch of chats, each with its pictures, on ``device`` (floats in ``dtype``)."""
    import torch

    texts = [processor.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]
    nested = model_type(path) in IDEFICS3_FAMILIES
    flat = [image for row in images for image in row]
    batch = processor(text=texts, images=images if nested else flat, padding=True, return_tensors="pt")
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def load_peer_model(path: Path, dtype: str, device: str):
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def _digest(ids) -> str:
    from edgeinfer.bench.gpu import prompt_digest

    return prompt_digest([int(i) for i in ids])


# --- CPU: time to first token, decode and whole request, one request at a time -------------------

def generate_peer(spec) -> dict[str, Any]:
    """``edgeinfer bench generate``'s peer: transformers' generate() with a token clock."""
    import torch

    from edgeinfer.bench.generate import QUESTION

    require_nothing_of_ours()
    torch.set_num_threads(spec.threads)
    model = load_peer_model(spec.model, spec.dtype, spec.device)
    processor = peer_processor(spec.model)
    dtype = getattr(torch, spec.dtype)
    log, prompt = RunLog(), None
    with torch.inference_mode():
        for i in range(spec.warmup + spec.repeats):
            image = bench_image(spec.image_size)
            timed = i >= spec.warmup
            with log.run(f"transformers #{i - spec.warmup}" if timed else f"transformers warm-up {i}", timed) as rec:
                started = time.perf_counter()
                inputs = peer_inputs(processor, spec.model, [user_turn(QUESTION)], [[image]], spec.device, dtype)
                clock = TokenClock()
                model.generate(**inputs, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
                               do_sample=False, streamer=clock)
                request_s = time.perf_counter() - started
                first, last = clock.times[0], clock.times[-1]
                rec.update(ttft_s=first - started, decode_tok_s=(len(clock.times) - 1) / (last - first),
                           request_s=request_s, request_tok_s=len(clock.times) / request_s, tokens=len(clock.times))
            prompt = inputs["input_ids"][0].tolist()
    require_nothing_of_ours()
    return {"runs": log.records, "peak_rss_mb": peak_rss_mb(), "prompt_tokens": len(prompt),
            "prompt_digest": _digest(prompt)}


# --- GPU: the same pairs of whole calls as ours, at every batch size ----------------------------------

def gpu_peer(spec, cache: str) -> dict[str, Any]:
    """``edgeinfer bench gpu``'s peer: ``generate()`` with a ``static`` (compiled) or ``dynamic`` cache."""
    import torch

    from edgeinfer.bench.gpu import QUESTION, SAMPLED_SETTINGS, measure

    require_nothing_of_ours()
    model = load_peer_model(spec.model, spec.dtype, spec.device)
    processor = peer_processor(spec.model)
    dtype = getattr(torch, spec.dtype)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    prompts: list[list[int]] = []

    def call(batch: int, new_tokens: int, images: list) -> tuple[float, float, int]:
        sync(spec.device)
        started = time.perf_counter()
        inputs = peer_inputs(processor, spec.model, [user_turn(QUESTION)] * batch, [[im] for im in images],
                             spec.device, dtype)
        if spec.sampled:
            torch.manual_seed(0)
        sampling = {"do_sample": True, **SAMPLED_SETTINGS, "top_k": 0} if spec.sampled else {"do_sample": False}
        clock = TokenClock()  # its first stamp: the first tokens copied to the host
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampling, **extra,
                             streamer=clock)
        sync(spec.device)
        seconds = time.perf_counter() - started
        generated = out.shape[1] - inputs["input_ids"].shape[1]
        if generated != new_tokens:
            raise RuntimeError(f"transformers generated {generated} tokens, not {new_tokens}")
        prompts.append(inputs["input_ids"][0].tolist())
        return seconds, clock.times[0] - started, batch  # the first stamp: every row's first token at once

    log = RunLog()
    with torch.inference_mode():
        measure(spec, f"transformers-{cache}", call, log)
    require_nothing_of_ours()
    return {"runs": log.records, "prompt_tokens": len(prompts[0]), "prompt_digest": _digest(prompts[0]),
            "peak_memory_mb": peak_memory_mb(spec.device), "cache": cache, "compiled": _compiled_graphs()}


def _compiled_graphs() -> int:
    """How many graphs ``torch.compile`` produced in this process (0: nothing was compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


# --- KV: transformers' offloading cache over the same scripted turns as ours --------------------

def offload_peer(data: dict[str, Any]) -> dict[str, Any]:
    """``edgeinfer bench kv``'s offloading peer: every round's turns batched through ``generate()``
    with ``DynamicCache(offloading=True)``; the turns and pictures are given, not generated. A
    warm-up round, then ``repeats`` timed passes over the rounds."""
    import torch
    from transformers import DynamicCache

    require_nothing_of_ours()
    path, device, new_tokens = Path(data["model"]), data["device"], data["new_tokens"]
    model = load_peer_model(path, data["dtype"], device)
    processor = peer_processor(path)
    dtype = getattr(torch, data["dtype"])
    images = [bench_image(data["image_size"], seed=seed) for seed in data["image_seeds"]]
    rounds, offloading = data["rounds"], data.get("offloading", True)  # off: a CPU check of this path
    log = RunLog()

    def one_round(chats: list, label: str, repeat: int, timed: bool) -> None:
        with log.run(label, timed) as rec:
            sync(device)
            started = time.perf_counter()
            inputs = peer_inputs(processor, path, chats, [[im] for im in images], device, dtype)
            cache = DynamicCache(config=model.config, offloading=offloading)
            out = model.generate(**inputs, past_key_values=cache,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            sync(device)
            rec.update(repeat=repeat, seconds=time.perf_counter() - started,
                       prompt_tokens=int(inputs["attention_mask"].sum()),
                       generated=int(out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1])))

    with torch.inference_mode():
        one_round(rounds[0], "offloading peer warm-up round 0", -1, timed=False)
        for repeat in range(data["repeats"]):
            for r, chats in enumerate(rounds):
                one_round(chats, f"offloading peer pass {repeat} round {r}", repeat, timed=True)
    require_nothing_of_ours()
    return {"runs": log.records, "peak_memory_mb": peak_memory_mb(device), "environment": environment(device)}
