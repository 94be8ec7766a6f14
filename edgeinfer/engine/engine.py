"""The engine: requests in, tokens out. A thin facade over its rooms.

``Engine.load`` builds everything once; ``submit`` turns a chat and images into a
sequence (:class:`Inputs`, then the :class:`VisionCache`); ``step`` runs one prefill chunk
or one batched decode step (:class:`Scheduler`, then the :class:`Runner`); ``generate`` and
``stream`` are loops over ``step`` for one request; :class:`Output` makes text and results.
``sleep`` releases the KV pool and the weights between requests (:mod:`edgeinfer.engine.sleep`);
``wake_up``, or the next ``submit``, builds them again. The torch backend's engines stay open
across a sleep (their compiled code and tuned kernels are the process's to keep): only their
captured graphs are dropped, and the wake captures them again over the new pool.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgeinfer.artifacts import prefix_cache_root
from edgeinfer.backends.base import CompilableVision, DecoderEngine, Engines, VisionEngine
from edgeinfer.backends.torch import compile_workers
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.inputs import Inputs, Message, PreparedPrompt, image_key
from edgeinfer.engine.output import GenerationResult, Output
from edgeinfer.engine.runner import Runner
from edgeinfer.engine.sampling import SamplingParams, SamplingRows
from edgeinfer.engine.scheduler import Scheduler
from edgeinfer.engine.sequence import FinishReason, Sequence, Status
from edgeinfer.engine.sleep import (
    DroppedWeights, FileStash, PinnedHostStash, SleepLevel, SleepReport, SleepStats, WeightsChanged,
    release_unused_memory, stash_weights,
)
from edgeinfer.engine.vision_cache import VisionCache
from edgeinfer.errors import RequestError
from edgeinfer.kv.manager import KVManager
from edgeinfer.kv.metrics import KVMetrics
from edgeinfer.kv.pool import BlockPool, KVCache
from edgeinfer.models.loader import LoadedModel, load_model
from edgeinfer.quant.packed import bytes_saved
from edgeinfer.preflight import ImageRules
from edgeinfer.profiles import ImageLimits

__all__ = ["Engine", "EngineConfig", "GenerationResult", "SleepLevel", "SleepReport", "image_key"]


@dataclass(frozen=True, slots=True)
class LoadRecipe:
    """How ``Engine.load`` opened an engine: what a wake from level 2 repeats."""

    path: Path
    backend: Any  # a registry Backend
    device_profile: Any
    engines_root: str | Path | None
    trust_remote_code: bool


@dataclass(frozen=True, slots=True)
class LoadTimings:
    """Where :meth:`Engine.load` spent its seconds: reading the checkpoint onto the device
    (``model_s``), opening the backend's engines (``engines_s``: on a GPU, compiling and timing
    the kernels' tiles, unless the tile cache holds them), building the engine and its KV pool
    (``engine_s``) and the profile's start-up graph captures, then letting go of torch.compile's
    compile workers on a GPU where it captured (``capture_s``;
    :mod:`edgeinfer.backends.torch.compile_workers`)."""

    model_s: float
    engines_s: float
    engine_s: float
    capture_s: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, engines: Engines, profile: Any = None,
                 recipe: LoadRecipe | None = None) -> None:
        """``engines``: what a backend opened for ``model``; ``profile``: the DeviceProfile the
        engine was sized from, when it was loaded from one (its image limits apply); ``recipe``:
        how it was loaded (``Engine.load`` gives it), which sleep level 2 needs to wake."""
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.profile = profile
        self.recipe = recipe
        self.sleep_stats = SleepStats()
        self.startup_capture: dict[str, float] | None = None  # what capture_graphs did at load
        self.load_timings: LoadTimings | None = None  # set by Engine.load
        self._stash: PinnedHostStash | FileStash | DroppedWeights | None = None
        self._carried: Counter[str] = Counter()  # counters of the parts a sleep dropped
        # On a GPU, pictures are encoded (and prompts' embeddings made) on a stream of their own:
        # ``submit`` queues the vision engine and returns, and the tower runs beside the decode steps.
        self.picture_stream = torch.cuda.Stream(config.device) if config.device.startswith("cuda") else None
        # Requests a server submits while prompts are pending: with a picture stream, the next
        # picture is encoded while a prompt is prefilled.
        self.prompts_ahead = 1 if self.picture_stream is not None else 0
        self._assemble(model, engines)

    def _assemble(self, model: LoadedModel, engines: Engines) -> None:
        """Build every part over ``model`` and ``engines``: at load, and again at each wake (with the
        same engines where they stayed open)."""
        config = self.config
        self.model = model
        self.adapter = model.adapter
        self.engines = engines
        self._backend = engines.backend
        cfg = model.decoder.cfg
        num_blocks = config.device_blocks(cfg)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv = KVCache(cfg.kv_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                          config.torch_dtype, config.device)
        self.kv_manager = KVManager(self.pool, self.kv, config.kv_manager_config(), self._fingerprint())
        self.scheduler = Scheduler(self.kv_manager, config.max_batch_size, config.prefill_chunk, config.max_context,
                                   lookahead=config.decode_burst if engines.bursts is not None else 1)
        self.inputs = Inputs(model, config)
        self.vision_cache = VisionCache(engines.vision, self.kv_manager.embeddings,
                                        config.vision_cache_entries, config.device)
        self.output = Output(self.adapter.tokenizer)
        self.runner = Runner(engines, self.kv, self.scheduler, self.output, config)
        self.vision_compile_error: str | None = None
        if config.vision_compile_sizes and config.device.startswith("cuda") and engines.compiler is not None:
            self._compile_vision(engines.compiler, config.vision_compile_sizes)

    @property
    def backend(self) -> str:
        return self._backend


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
        """Engine counters and the KV manager's (prefix hits, spills, restores, preemptions, recomputes),
        counted since load, across sleeps."""
        total = Counter(self._carried)
        if not self.is_sleeping:
            total.update(self._live_counters())
        return dict(total)

    def _live_counters(self) -> dict[str, int]:
        vision = {"vision_runs": self.vision_cache.runs, "vision_reused": self.vision_cache.reused}
        return {**vision, **self.runner.counters, **self.kv_manager.counters()}

    def _fingerprint(self) -> bytes:
        """The root of the prefix cache's keys: a different model never shares a block, nor does
        the same checkpoint run in another dtype, by another backend or from another build (other K/V)."""
        engines = self.engines
        build = "" if engines.backend == "torch" else f"{self.config.profile_name}|{engines.build_identity}"
        runs = f"{type(self.adapter).__name__}|{self.config.dtype}|{self.model.decoder.cfg}|{engines.backend}|{build}"
        return prefix_cache_root(self.adapter.checkpoint.path, runs)

    def kv_metrics(self) -> KVMetrics | None:
        """A snapshot of the KV tiers (also iterable as (name, labels, value) metric triples);
        None while asleep (there are no tiers then)."""
        return None if self.is_sleeping else self.kv_manager.metrics()

    def close(self) -> None:
        """Finish KV transfers and write the prefix cache through to disk (also done at exit)."""
        if not self.is_sleeping:
            self.kv_manager.close()

    # --- sleep -----------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.sleep_stats.level != SleepLevel.AWAKE

    @property
    def sleep_level(self) -> SleepLevel:
        return SleepLevel(self.sleep_stats.level)

    def sleep(self, level: int | SleepLevel = SleepLevel.OFFLOAD) -> SleepReport:
        """Release the KV pool and the weights; only between requests.

        The prefix cache goes through to the disk tier first (where the profile has one: a
        question after the wake reuses it). Level 1 keeps the weights in host memory (a file on a
        CPU); level 2 drops them. The torch backend's engines stay open, their captured graphs
        dropped; the weights' tensor objects stay too, only their storage goes. A backend other
        than torch holds its weights inside its runtime: its engines are closed and, at either
        level, opened again from the engines folder.
        Sleeping again deeper is allowed; sleeping while asleep at the same level is a no-op.
        """
        level = SleepLevel.parse(level)
        if level <= self.sleep_level:
            return SleepReport(int(self.sleep_level), 0.0, 0, 0, "unchanged")
        started = time.perf_counter()
        if self.is_sleeping:  # level 1 to level 2: drop what level 1 kept
            return self._deepen(started)
        self._require_idle()
        self._require_reloadable(level)
        if self.picture_stream is not None:  # a cancelled request's picture may still be encoding
            self.picture_stream.synchronize()
        persisted_before = self.kv_manager.stats.persisted_blocks
        freed = self.kv.k.nbytes + self.kv.v.nbytes
        self.kv_manager.close()  # flushes the prefix cache to disk and releases the cache folder
        persisted = self.kv_manager.stats.persisted_blocks - persisted_before
        self._carried.update(self._live_counters())
        weights = self._put_weights_away(level)
        self._drop_parts()
        release_unused_memory()
        self.sleep_stats.level = int(level)
        self.sleep_stats.sleeps[int(level)] += 1
        return SleepReport(int(level), time.perf_counter() - started, persisted, freed, weights)

    def wake_up(self) -> float:
        """Build the KV pool, bring the weights back and capture again the graphs the engines had;
        returns the seconds it took (0 when awake). The captures' share is in ``sleep_stats``."""
        if not self.is_sleeping:
            return 0.0
        started = time.perf_counter()
        # As at load, whatever the caller's mode (a request wakes the engine inside inference mode):
        # weights made there would be inference tensors, whose other dispatch keys fail the guards
        # of every compiled function that reads them, and each would compile again.
        with torch.inference_mode(False):
            model, engines = self._weights_back()
            self._assemble(model, engines)
        self._capture_again()
        if self.config.captures_at_start:
            compile_workers.release(self.config.device)
        seconds = time.perf_counter() - started
        stats = self.sleep_stats
        stats.level, stats.wakes = int(SleepLevel.AWAKE), stats.wakes + 1
        stats.wake_s_total += seconds
        stats.last_wake_s = seconds
        return seconds

    @property
    def _keeps_weights(self) -> bool:
        """The torch engines run on the model's own tensors: a sleep empties them and a wake refills
        them in place. Other backends hold their weights inside their runtimes."""
        return self.backend == "torch"

    @property
    def _keeps_engines(self) -> bool:
        """Engines over the model's own tensors stay open across a sleep, and what they compiled and
        tuned stays valid; a decoder that bursts from captured state must be able to drop it."""
        engines = self.engines
        return self._keeps_weights and (engines.bursts is None or engines.graphs is not None)

    def _require_idle(self) -> None:
        if self.has_work():
            running = len(self.scheduler.running) + len(self.scheduler.waiting)
            raise RequestError(f"cannot sleep with {running} requests in the engine; sleep between requests")

    def _require_reloadable(self, level: SleepLevel) -> None:
        if self.recipe is None and (level is SleepLevel.DISCARD or self.backend != "torch"):
            raise RequestError(f"sleep level {int(level)} on the {self.backend} backend reloads the model on "
                               f"wake, and this engine was not loaded from a folder (use Engine.load)")

    def _weight_modules(self) -> dict[str, torch.nn.Module]:
        return {"decoder": self.model.decoder, "vision": self.model.vision}

    def _put_weights_away(self, level: SleepLevel) -> str:
        if not self._keeps_weights:
            self.model = None  # type: ignore[assignment]
            return "dropped"
        if level is SleepLevel.OFFLOAD:
            self._stash = stash_weights(self._weight_modules(), self.config.device, self._stash_folder())
        else:
            self._stash = DroppedWeights.of(self._weight_modules())
        return self._stash.kind

    def _stash_folder(self) -> Path:
        from edgeinfer.kv.disk import default_cache_dir

        return Path(self.config.disk_dir).expanduser() if self.config.disk_dir else default_cache_dir()

    def _deepen(self, started: float) -> SleepReport:
        self._require_reloadable(SleepLevel.DISCARD)
        if self._stash is not None:  # the torch engines' tensors: from host memory to nothing
            self._stash = DroppedWeights(self._stash.slots)
        release_unused_memory()
        self.sleep_stats.level = int(SleepLevel.DISCARD)
        self.sleep_stats.sleeps[int(SleepLevel.DISCARD)] += 1
        return SleepReport(int(SleepLevel.DISCARD), time.perf_counter() - started, 0, 0, "dropped")

    def _drop_parts(self) -> None:
        """Let go of every part that holds device memory: pool, caches, and the engines' captured
        graphs (they hold the pool's and the weights' addresses), or the engines themselves where they
        close. The inputs (tokenizer, processor, limits) stay, so requests are checked while asleep."""
        if self._keeps_engines:
            if self.engines.graphs is not None:
                self.engines.graphs.release_captures()
            if self.engines.compiler is not None:
                self.engines.compiler.release_captures()
        else:
            self.engines = None  # type: ignore[assignment]
        for name in ("pool", "kv", "kv_manager", "scheduler", "vision_cache", "runner"):
            setattr(self, name, None)

    def _weights_back(self) -> tuple[LoadedModel, Engines]:
        """The model and engines to assemble: for torch the same model, its tensors refilled, and the
        same engines where they stayed open; else the model loaded again and its engines opened again."""
        stash, self._stash = self._stash, None
        if isinstance(stash, (PinnedHostStash, FileStash)):
            stash.restore()
            model = self.model
        else:
            recipe = self.recipe
            assert recipe is not None  # _require_reloadable made sure
            model = load_model(recipe.path, self.config.torch_dtype, self.config.device, recipe.trust_remote_code)
            if isinstance(stash, DroppedWeights):
                try:
                    stash.refill({"decoder": model.decoder, "vision": model.vision})
                    model = dataclasses.replace(model, decoder=self.model.decoder, vision=self.model.vision)
                except WeightsChanged as exc:
                    warnings.warn(f"the checkpoint changed while the engine slept, its engines open again: {exc}")
                    self.engines = None  # type: ignore[assignment]
        return model, self.engines if self.engines is not None else self._open_engines(model)

    def _open_engines(self, model: LoadedModel) -> Engines:
        from edgeinfer.backends.registry import Backend, open_engines

        recipe = self.recipe
        if recipe is None:  # a torch engine built by hand: the registry's torch engines
            return open_engines(Backend.TORCH, model, None, self.config)
        return open_engines(recipe.backend, model, recipe.device_profile, self.config, recipe.engines_root)

    @torch.inference_mode()  # as a step captures them
    def _capture_again(self) -> None:
        """Capture the decoder's graphs of before the sleep over the new pool, so that the wake, not
        the next request, pays for them."""
        graphs = self.engines.graphs
        started = time.perf_counter()
        captured = graphs.recapture(self.kv.k, self.kv.v) if graphs is not None else 0
        self.sleep_stats.last_wake_captures = captured
        self.sleep_stats.last_wake_capture_s = time.perf_counter() - started

    # --- construction ------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, profile: Any = None, backend: str = "auto", overrides: Seq[str] = (),
             config: EngineConfig | None = None, trust_remote_code: bool = False,
             engines_root: str | Path | None = None) -> "Engine":
        """Load a checkpoint folder. ``profile`` is a name, a YAML path, a DeviceProfile or None (auto).

        ``backend`` ``auto`` runs the fastest engines built and fresh for the profile under
        ``engines_root`` (None: ``$EDGEINFER_ENGINES``, else ``./engines``), else torch; a named
        backend must be installed (:mod:`edgeinfer.backends.registry` decides). The loaded model
        belongs to the engine: its backend may re-lay out or free the weights it replaces. A load
        that captures at start-up (``EngineConfig.captures_at_start``) starts torch.compile's compile
        workers as it begins and stops them once it ends
        (:mod:`edgeinfer.backends.torch.compile_workers`).
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
        marks = [time.perf_counter()]
        with compile_workers.around_load(config.device, config.captures_at_start):
            model = load_model(path, config.torch_dtype, config.device, trust_remote_code)
            marks.append(time.perf_counter())
            engines = open_engines(chosen, model, device_profile, config, engines_root)
            marks.append(time.perf_counter())
            if device_profile is not None and engines.backend == Backend.TORCH.value:
                # The profile's plan left room for dense weights: what packed ones save goes to the KV pool.
                config = config.grown_by(bytes_saved(model.decoder, config.torch_dtype))
            recipe = LoadRecipe(Path(path), chosen, device_profile, engines_root, trust_remote_code)
            engine = cls(model, config, engines, profile=device_profile, recipe=recipe)
            marks.append(time.perf_counter())
            engine.capture_graphs()
        marks.append(time.perf_counter())
        engine.load_timings = LoadTimings(*(b - a for a, b in zip(marks, marks[1:])))
        return engine

    # Sampler kinds a burst is captured for at start-up: greedy, sampled, penalized, both.
    _CAPTURED_SAMPLING = (SamplingParams(temperature=1.0), SamplingParams(presence_penalty=0.5),
                          SamplingParams(temperature=1.0, presence_penalty=0.5))

    def capture_graphs(self, progress: bool = True) -> dict[str, float] | None:
        """Capture every decode graph the profile's buckets allow, and the graph of a prompt's
        first chunk for each length bucket up to ``prefill_chunk``, within ``capture_budget_s``
        (a rich bar on stderr meanwhile): after it, live traffic compiles and captures nothing
        new in decode nor for a prompt's first chunk. None where the profile asks for none or the
        engines capture no graphs. What it did is kept in :attr:`startup_capture`."""
        capture_all = getattr(self.engines.bursts, "capture_all", None)
        if not self.config.captures_at_start or capture_all is None:
            return None
        from edgeinfer.progress import stderr_bars

        samplings = [None] + [SamplingRows((p,), (0,), ((),), ((),)) for p in self._CAPTURED_SAMPLING]
        with stderr_bars(transient=True, disable=not progress) as bar:
            task = bar.add_task("capturing graphs", total=None)
            report = capture_all(self.kv.k, self.kv.v, samplings, self.config.capture_budget_s,
                                 lambda done, total: bar.update(task, completed=done, total=total),
                                 prompt_chunk=self.config.prefill_chunk if self.config.prefill_graphs else 0)
        if report["captured"] < report["planned"]:
            warnings.warn(f"captured {report['captured']} of {report['planned']} graphs in the profile's "
                          f"capture_budget_s ({self.config.capture_budget_s:g} s); the rest are captured on "
                          "first use")
        self.startup_capture = report
        return report

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
        """Encode the images of a prepared request and hand its sequence to the scheduler; an engine
        asleep wakes first (the wake is in the sequence's timings). On a GPU the encoding is queued
        on the picture stream and this returns: the prompt's first chunk waits for it on the device."""
        started = time.perf_counter()
        wake_s = self.wake_up()
        stream = self.picture_stream
        main = None if stream is None else torch.cuda.current_stream(stream.device)
        with torch.cuda.stream(stream):  # (no stream: a no-op)
            embeds = [self.vision_cache.embeddings(key, image)
                      for key, image in zip(prompt_in.keys, prompt_in.images)]
            vision_s = time.perf_counter() - started
            seq = self.inputs.sequence(prompt_in, [e for e, _ in embeds], sampling, self.engines.decoder.embed,
                                       vision_reused=sum(reused for _, reused in embeds))
            if main is not None:
                seq.prompt_embeds.record_stream(main)  # read there: not reused before that is done
                seq.embeds_ready = torch.cuda.Event()
                seq.embeds_ready.record(stream)
        seq.timings.created = started
        seq.timings.wake_s = wake_s
        seq.timings.wake_capture_s = self.sleep_stats.last_wake_capture_s if wake_s else 0.0
        seq.timings.vision_s = vision_s - wake_s
        self.scheduler.add(seq)
        self.output.start(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.CANCELLED)
        seq.timings.finished = time.perf_counter()

    # --- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        if self.is_sleeping:
            return False
        return self.scheduler.has_work() or self.runner.burst_in_flight

    @property
    def ready_for_request(self) -> bool:
        """Whether a server should submit its next request now: once no submitted request waits for
        its prompt to be prefilled, or, with a picture stream, while one does (its picture is then
        encoded while that prompt is prefilled). A burst of requests so gets its first tokens one
        after another, never after every picture of the burst. Asleep: ready (a submit wakes it)."""
        return self.is_sleeping or self.scheduler.prompts_pending <= self.prompts_ahead

    @torch.inference_mode()
    def step(self, joining: int = 0) -> list[Sequence]:
        """Run one unit of work; returns the sequences that got a new token. ``joining``: requests
        a caller will submit before the next step (decoding goes step by step until they join)."""
        return self.runner.step(joining)

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
