"""The engine: requests in, tokens out. A thin facade over its rooms.

``Engine.load`` builds everything once; ``submit`` turns a chat and images into a
sequence (:class:`Inputs`, then the :class:`VisionCache`); ``step`` runs one prefill chunk
or one batched decode step (:class:`Scheduler`, then the :class:`Runner`); ``generate`` and
``stream`` are loops over ``step`` for one request; :class:`Output` makes text and results.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from edgeinfer.artifacts import prefix_cache_root
from edgeinfer.backends.base import CompilableVision, DecoderEngine, Engines, VisionEngine
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.inputs import Inputs, Message, PreparedPrompt, image_key
from edgeinfer.engine.output import GenerationResult, Output
from edgeinfer.engine.runner import Runner
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.scheduler import Scheduler
from edgeinfer.engine.sequence import FinishReason, Sequence, Status
from edgeinfer.engine.vision_cache import VisionCache
from edgeinfer.errors import RequestError
from edgeinfer.kv.manager import KVManager
from edgeinfer.kv.metrics import KVMetrics
from edgeinfer.kv.pool import BlockPool, KVCache
from edgeinfer.models.loader import LoadedModel, load_model
from edgeinfer.preflight import ImageRules
from edgeinfer.profiles import ImageLimits

__all__ = ["Engine", "EngineConfig", "GenerationResult", "image_key"]


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, engines: Engines, profile: Any = None) -> None:
        """``engines``: what a backend opened for ``model``; ``profile``: the DeviceProfile the
        engine was sized from, when it was loaded from one (its image limits apply)."""
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model
        self.adapter = model.adapter
        self.config = config
        self.engines = engines
        self.profile = profile
        cfg = model.decoder.cfg
        num_blocks = config.device_blocks(cfg)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                          config.torch_dtype, config.device)
        self.kv_manager = KVManager(self.pool, self.kv, config.kv_manager_config(), self._fingerprint())
        self.scheduler = Scheduler(self.kv_manager, config.max_batch_size, config.prefill_chunk, config.max_context,
                                   lookahead=config.decode_burst if engines.bursts is not None else 1)
        self.inputs = Inputs(model, config, engines.decoder.embed)
        self.vision_cache = VisionCache(engines.vision, self.kv_manager.embeddings,
                                        config.vision_cache_entries, config.device)
        self.output = Output(self.adapter.tokenizer)
        self.runner = Runner(engines, self.kv, self.scheduler, self.output, config)
        self.vision_compile_error: str | None = None
        if config.vision_compile_sizes and config.device.startswith("cuda") and engines.compiler is not None:
            self._compile_vision(engines.compiler, config.vision_compile_sizes)

    @property
    def backend(self) -> str:
        return self.engines.backend

    @property
    def decoder_engine(self) -> DecoderEngine:
        return self.engines.decoder

    @property
    def vision_engine(self) -> VisionEngine:
        return self.engines.vision

    def _compile_vision(self, compiler: CompilableVision, sizes: Seq[tuple[int, int]]) -> None:
        """Compile the vision tower for pictures of ``sizes``, as the preprocessor shapes them; a
        compiler failure leaves the tower eager, with a warning."""
        from PIL import Image

        inputs = [self.adapter.process_image(Image.new("RGB", size)).tensors for size in sizes]
        try:
            compiler.compile_for(inputs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager tower
            self.vision_compile_error = f"{type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"compiling the vision tower failed, it runs eagerly: {self.vision_compile_error}")

    @property
    def counters(self) -> dict[str, int]:
        """Engine counters and the KV manager's (prefix hits, spills, restores, preemptions, recomputes)."""
        vision = {"vision_runs": self.vision_cache.runs, "vision_reused": self.vision_cache.reused}
        return {**vision, **self.runner.counters, **self.kv_manager.counters()}

    def _fingerprint(self) -> bytes:
        """The root of the prefix cache's keys: a different model never shares a block, nor does
        the same checkpoint run in another dtype, by another backend or from another build (other K/V)."""
        engines = self.engines
        build = "" if engines.backend == "torch" else f"{self.config.profile_name}|{engines.build_identity}"
        runs = f"{type(self.adapter).__name__}|{self.config.dtype}|{self.model.decoder.cfg}|{engines.backend}|{build}"
        return prefix_cache_root(self.adapter.checkpoint.path, runs)

    def kv_metrics(self) -> KVMetrics:
        """A snapshot of the KV tiers (also iterable as (name, labels, value) metric triples)."""
        return self.kv_manager.metrics()

    def close(self) -> None:
        """Finish KV transfers and write the prefix cache through to disk (also done at exit)."""
        self.kv_manager.close()

    # --- construction ------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, profile: Any = None, backend: str = "auto", overrides: Seq[str] = (),
             config: EngineConfig | None = None, trust_remote_code: bool = False,
             engines_root: str | Path | None = None) -> "Engine":
        """Load a checkpoint folder. ``profile`` is a name, a YAML path, a DeviceProfile or None (auto).

        ``backend`` ``auto`` runs the fastest engines built and fresh for the profile under
        ``engines_root`` (None: ``$EDGEINFER_ENGINES``, else ``./engines``), else torch; a named
        backend must be installed (:mod:`edgeinfer.backends.registry` decides). The loaded model
        belongs to the engine: its backend may re-lay out or free the weights it replaces.
        """
        from edgeinfer.backends.registry import Backend, open_engines, require_backend

        chosen = require_backend(backend)  # an unknown or missing backend fails before the model loads
        device_profile = None
        if config is None:
            device_profile = _profile(profile, overrides)
            config = EngineConfig.from_profile(device_profile)
        elif chosen is not Backend.TORCH and profile is not None:
            from dataclasses import replace

            # An explicit config keeps its sizes and runs the engines built for ``profile``.
            device_profile = _profile(profile, overrides)
            config = replace(config, profile_name=device_profile.name)
        model = load_model(path, config.torch_dtype, config.device, trust_remote_code)
        engines = open_engines(chosen, model, device_profile, config, engines_root)
        return cls(model, config, engines, profile=device_profile)

    def image_rules(self) -> ImageRules:
        """Preflight rules for this engine: the stricter of the profile's and the model's limits."""
        limits = self.adapter.image_limits()
        images = self.profile.images if self.profile is not None else ImageLimits(
            max_side=2048, max_pixels=2048 * 2048, max_images=4, max_file_mb=20)
        return ImageRules.from_profile(images, model_max_side=limits.get("max_side"),
                                       model_max_pixels=limits.get("max_pixels"),
                                       model_min_side=limits.get("min_side"))

    # --- requests ------------------------------------------------------------------------
    def prepare(self, prompt: str | list[Message], images: Seq[Any] = (),
                sampling: SamplingParams = SamplingParams()) -> PreparedPrompt:
        """Render, tokenize and check a request against every limit, before any vision work.

        It reads no engine state that a step changes, so a server may call it off the engine thread."""
        return self.inputs.prepare(prompt, images, sampling)

    @torch.inference_mode()
    def submit(self, prompt: str | list[Message], images: Seq[Any] = (),
               sampling: SamplingParams = SamplingParams()) -> Sequence:
        return self.submit_prepared(self.prepare(prompt, images, sampling), sampling)

    @torch.inference_mode()
    def submit_prepared(self, prompt_in: PreparedPrompt, sampling: SamplingParams = SamplingParams()) -> Sequence:
        """Encode the images of a prepared request and hand its sequence to the scheduler."""
        started = time.perf_counter()
        embeds = [self.vision_cache.embeddings(key, image) for key, image in zip(prompt_in.keys, prompt_in.images)]
        vision_s = time.perf_counter() - started
        seq = self.inputs.sequence(prompt_in, [e for e, _ in embeds], sampling,
                                   vision_reused=sum(reused for _, reused in embeds))
        seq.timings.created = started
        seq.timings.vision_s = vision_s
        self.scheduler.add(seq)
        self.output.start(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.CANCELLED)
        seq.timings.finished = time.perf_counter()

    # --- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.runner.burst_in_flight

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one unit of work; returns the sequences that got a new token."""
        return self.runner.step()

    def text_delta(self, seq: Sequence) -> str:
        """New text of ``seq`` since the last call, holding back what a stop string could still cut."""
        return self.output.text_delta(seq)

    def result(self, seq: Sequence) -> GenerationResult:
        return self.output.result(seq)

    # --- one request at a time -------------------------------------------------------------
    def stream(self, prompt: str | list[Message], images: Seq[Any] = (),
               sampling: SamplingParams = SamplingParams()) -> Iterator[str]:
        seq = self.submit(prompt, images, sampling)
        try:
            while seq.status is not Status.FINISHED:
                if seq in self.step():
                    delta = self.text_delta(seq)
                    if delta:
                        yield delta
            tail = self.text_delta(seq)
            if tail:
                yield tail
        finally:
            if seq.status is not Status.FINISHED:
                self.cancel(seq)
            self.result(seq)  # drops its text state

    def generate(self, prompt: str | list[Message], images: Seq[Any] = (),
                 sampling: SamplingParams = SamplingParams()) -> GenerationResult:
        seq = self.submit(prompt, images, sampling)
        while seq.status is not Status.FINISHED:
            self.step()
        return self.result(seq)

    def run_until_done(self, seqs: Seq[Sequence]) -> list[GenerationResult]:
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return [self.result(s) for s in seqs]


def _profile(profile, overrides: Seq[str]):
    from edgeinfer import profiles

    if profile is None or isinstance(profile, (str, Path)):
        return profiles.load_profile(None if profile in (None, "auto") else str(profile), overrides)
    if overrides:
        raise RequestError("overrides apply to a profile name or file, not to a built profile")
    return profile
