"""The engine: requests in, tokens out. Owns the model, the KV pool and the scheduler.

``Engine.load`` builds everything once; ``submit`` turns a chat and images into a
sequence; ``step`` runs one prefill chunk or one batched decode step; ``generate`` and
``stream`` are loops over ``step`` for one request.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgeinfer.artifacts import prefix_cache_root
from edgeinfer.backends.base import Engines
from edgeinfer.engine.prompt import (
    Message, expand_images, merge_embeddings, normalize_messages, render_chat, tokenize, user_message,
)
from edgeinfer.engine.sampling import SamplingParams, draw, filtered_probs, make_generator
from edgeinfer.engine.scheduler import DecodeWork, PrefillWork, Scheduler
from edgeinfer.engine.sequence import FinishReason, Sequence, Status
from edgeinfer.errors import LimitExceeded, RequestError
from edgeinfer.kv.disk import default_cache_dir
from edgeinfer.kv.hashing import image_spans
from edgeinfer.kv.manager import KVManager, KVManagerConfig
from edgeinfer.kv.metrics import KVMetrics
from edgeinfer.kv.pool import BlockPool, BlockTable, KVCache
from edgeinfer.models.loader import LoadedModel, load_model
from edgeinfer.profiles import ImageLimits, parse_size
from edgeinfer.preflight import ImageRules, check_cost, content_hash, estimate_cost

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs to size itself; built once from a profile (+ overrides)."""

    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_budget_mb and the model's bytes per block
    kv_budget_mb: int = 512
    max_batch_size: int = 8
    prefill_chunk: int = 512
    max_context: int = 8192
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    vision_cache_entries: int = 16
    available_floor_mb: int = 0
    cuda_graphs: bool = False
    # Greedy decode steps replayed back to back between trips to the host (CUDA graphs only).
    decode_burst: int = 16
    # CUDA graphs: the decode step as fused Triton kernels where Triton is installed.
    fused_decode: bool = True
    # CUDA graphs: prompt-length buckets whose batch-1 prefill graphs are kept (0: prefill eagerly).
    prefill_graphs: int = 8
    # Image sizes (width, height) the torch vision tower is compiled for at load (CUDA only).
    vision_compile_sizes: tuple[tuple[int, int], ...] = ()
    profile_name: str = "custom"
    # KV tiers (profile: kv.* and memory.*). Sizes 0 turn a tier off; a bare config has none.
    host_precision: str = "full"
    host_tier_mb: int = 0
    disk_tier_mb: int = 0
    disk_dir: str | None = None  # None: $XDG_CACHE_HOME/edgeinfer/kv
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    kv_policy: str = "lru-k"
    prefix_cache: bool = True
    unified_memory: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("block_size", "max_batch_size", "prefill_chunk", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def kv_manager_config(self) -> KVManagerConfig:
        return KVManagerConfig(
            host_precision=self.host_precision, host_tier_mb=self.host_tier_mb, disk_tier_mb=self.disk_tier_mb,
            disk_dir=self.disk_dir, high_watermark=self.high_watermark, low_watermark=self.low_watermark,
            available_floor_mb=self.available_floor_mb, policy=self.kv_policy, prefix_cache=self.prefix_cache,
            pin_host=self.device.startswith("cuda") and not self.unified_memory and torch.cuda.is_available())

    @classmethod
    def from_profile(cls, profile) -> "EngineConfig":
        return cls(
            block_size=profile.kv.block_size,
            num_blocks=profile.kv.device_blocks,
            kv_budget_mb=profile.memory.kv_device_budget_mb,
            max_batch_size=profile.runtime.max_batch_size,
            prefill_chunk=profile.runtime.prefill_chunk_tokens,
            max_context=profile.runtime.max_context_tokens,
            dtype=profile.runtime.dtype,
            device=profile.runtime.device,
            threads=profile.runtime.threads,
            available_floor_mb=profile.memory.available_floor_mb,
            cuda_graphs=profile.runtime.cuda_graphs,
            prefill_graphs=profile.runtime.prefill_graphs,
            vision_compile_sizes=tuple(parse_size(v) for v in profile.runtime.vision_compile_sizes),
            profile_name=profile.name,
            host_precision=profile.kv.host_precision,
            host_tier_mb=profile.memory.host_tier_mb,
            disk_tier_mb=profile.memory.disk_tier_mb,
            disk_dir=profile.kv.disk_dir or str(default_cache_dir()),
            high_watermark=profile.memory.high_watermark,
            low_watermark=profile.memory.low_watermark,
            kv_policy=profile.kv.policy,
            unified_memory=profile.memory.unified,
        )


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    cache: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
            "usage": self.usage, "timings": self.timings, "cache": self.cache,
        }


@dataclass
class _Burst:
    """Greedy steps queued on the device whose tokens the host has not read yet."""

    seqs: tuple[Sequence, ...]
    ids: Any  # the decoder engine's handle: ``rows()`` -> [B][steps] ids, waiting for them
    steps: int


@dataclass
class _TextState:
    text: str = ""
    decoded: int = 0  # tokens ``text`` was decoded from
    emitted: int = 0
    stopped: bool = False


def image_key(image) -> tuple[Any, str]:
    """(PIL image, content hash); accepts a preflight PreparedImage or a PIL image."""
    if hasattr(image, "sha256") and hasattr(image, "image"):
        return image.image, image.sha256
    if not hasattr(image, "tobytes"):
        raise RequestError(f"images must be PIL images or prepared images, got {type(image).__name__}")
    rgb = image.convert("RGB")
    return rgb, content_hash(rgb)


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, engines: Engines, profile: Any = None) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model
        self.profile = profile  # the DeviceProfile this engine was sized from, when loaded from one
        self.adapter = model.adapter
        self.config = config
        # What runs, chosen by edgeinfer.backends.registry; its optional abilities are declared there.
        self.engines = engines
        self.backend = engines.backend
        self.decoder_engine, self.vision_engine = engines.decoder, engines.vision
        cfg = model.decoder.cfg
        num_blocks = pool_blocks(config, cfg)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                          config.torch_dtype, config.device)
        self.kv_manager = KVManager(self.pool, self.kv, config.kv_manager_config(), self._fingerprint())
        bursts = config.decode_burst if engines.bursts is not None else 1
        self.scheduler = Scheduler(self.kv_manager, config.max_batch_size, config.prefill_chunk, config.max_context,
                                   lookahead=bursts)
        self.stop_ids = frozenset(self.adapter.stop_token_ids())
        self._vision_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._text: dict[int, _TextState] = {}
        self._in_flight: _Burst | None = None  # a greedy burst whose tokens are not read yet
        self._counters = {"vision_runs": 0, "vision_reused": 0, "prefill_tokens": 0, "decode_steps": 0,
                          "decode_bursts": 0, "decode_bursts_ahead": 0}
        self.vision_compile_error: str | None = None
        if config.vision_compile_sizes and config.device.startswith("cuda") and engines.compiler is not None:
            self._compile_vision(config.vision_compile_sizes)

    def _compile_vision(self, sizes: Seq[tuple[int, int]]) -> None:
        """Compile the vision tower for pictures of ``sizes``, as the preprocessor shapes them; a
        compiler failure leaves the tower eager, with a warning."""
        from PIL import Image

        inputs = [self.adapter.process_image(Image.new("RGB", size)).tensors for size in sizes]
        try:
            self.engines.compiler.compile_for(inputs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager tower
            self.vision_compile_error = f"{type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"compiling the vision tower failed, it runs eagerly: {self.vision_compile_error}")

    @property
    def counters(self) -> dict[str, int]:
        """Engine counters and the KV manager's (prefix hits, spills, restores, preemptions, recomputes)."""
        return {**self._counters, **self.kv_manager.counters()}

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
    @torch.inference_mode()
    def submit(self, prompt: str | list[Message], images: Seq[Any] = (),
               sampling: SamplingParams = SamplingParams()) -> Sequence:
        messages, markers = (user_message(prompt, len(images)), len(images)) if isinstance(prompt, str) \
            else normalize_messages(prompt)
        if markers != len(images):
            raise RequestError(f"messages reference {markers} images but {len(images)} were given")
        started = time.perf_counter()
        keyed = [image_key(image) for image in images]
        processed = [self.adapter.process_image(pil) for pil, _ in keyed]
        text = expand_images(render_chat(self.adapter, messages), self.adapter.image_marker, processed)
        layout = tokenize(self.adapter, text, processed)
        self._check_request(layout, processed, sampling)
        embeds, reused = [], 0
        for (_, key), inputs in zip(keyed, processed):
            cached = self._vision_cache.get(key)
            if cached is None:
                cached = self.kv_manager.load_embedding(key)
                if cached is None:
                    cached = self.vision_engine.encode(inputs.tensors)
                    self._counters["vision_runs"] += 1
                    self.kv_manager.store_embedding(key, cached)
                else:
                    cached = cached.to(self.config.device)
                    self._counters["vision_reused"] += 1
                    reused += 1
                self._vision_cache[key] = cached
                while len(self._vision_cache) > self.config.vision_cache_entries:
                    self._vision_cache.popitem(last=False)
            else:
                self._vision_cache.move_to_end(key)
                self._counters["vision_reused"] += 1
                reused += 1
            if cached.shape[0] != inputs.num_tokens:
                raise RequestError(f"vision engine gave {cached.shape[0]} embeddings for {inputs.num_tokens} tokens")
            embeds.append(cached)
        vision_s = time.perf_counter() - started
        ids = torch.tensor(layout.token_ids)
        prompt_embeds = merge_embeddings(self.decoder_engine.embed(ids), layout.token_ids,
                                         layout.image_token_id, embeds)
        stop = self.stop_ids if sampling.stop_token_ids is None else frozenset(sampling.stop_token_ids)
        seq = Sequence(
            prompt_ids=layout.token_ids, prompt_embeds=prompt_embeds, prompt_positions=layout.position_ids,
            next_position=layout.next_position, sampling=sampling,
            stop_token_ids=frozenset() if sampling.ignore_eos else stop,
            block_table=BlockTable(self.config.block_size), generator=make_generator(sampling),
            image_tokens=sum(p.num_tokens for p in processed), vision_reused=reused,
            image_spans=image_spans(layout.token_ids, layout.image_token_id,
                                    [(key, p.num_tokens) for (_, key), p in zip(keyed, processed)]),
        )
        seq.timings.created = started
        seq.timings.vision_s = vision_s
        self.scheduler.add(seq)
        self._text[seq.seq_id] = _TextState()
        return seq

    def _check_request(self, layout, images, sampling: SamplingParams) -> None:
        """Refuse, before any vision work, a request over the context or memory limits."""
        total = len(layout.token_ids) + sampling.max_new_tokens
        if total > self.config.max_context:
            raise LimitExceeded("prompt + max_new_tokens", total, self.config.max_context,
                                "--set runtime.max_context_tokens=N", "context_length")
        cfg = self.model.decoder.cfg
        image_tokens = sum(p.num_tokens for p in images)
        estimate = estimate_cost(
            image_tokens, len(layout.token_ids) - image_tokens, sampling.max_new_tokens,
            vision_hidden=self.adapter.vision_hidden,
            vision_layers_tokens_per_image=max((self.adapter.vision_patches(p) for p in images), default=0),
            kv_bytes_per_token=cfg.kv_bytes_per_token * self.config.torch_dtype.itemsize,
            dtype_bytes=self.config.torch_dtype.itemsize)
        check_cost(estimate, self.config.kv_budget_mb * 2**20 + estimate.vision_activation_bytes,
                   self.config.available_floor_mb * 2**20)

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, FinishReason.CANCELLED)
        seq.timings.finished = time.perf_counter()

    # --- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one unit of work; returns the sequences that got a new token."""
        if self._in_flight is not None:
            return self._collect_burst()
        work = self.scheduler.schedule()
        if isinstance(work, PrefillWork):
            return self._run_prefill(work)
        if isinstance(work, DecodeWork):
            return self._run_decode(work)
        return []

    def _run_prefill(self, work: PrefillWork) -> list[Sequence]:
        seq, start, end = work.seq, work.start, work.end
        t0 = time.perf_counter()
        embeds = self._embeds(seq, start, end)[None]
        positions = seq.positions(start, end)[..., None, :]
        logits = self._forward(embeds, positions, [seq], [start])
        self._counters["prefill_tokens"] += end - start
        seq.timings.prefill_s += time.perf_counter() - t0
        if not work.samples:
            return []
        self._accept(seq, self._choose_tokens([seq], logits)[0])
        return [seq]

    def _run_decode(self, work: DecodeWork) -> list[Sequence]:
        seqs = work.seqs
        steps = self._burst_length(seqs)
        if steps > 1 and (ids := self._burst(seqs, steps)) is not None:
            self._in_flight = _Burst(seqs, ids, steps)
            return self._collect_burst()
        last, positions = _decode_inputs(seqs)
        embeds = self.decoder_engine.embed(last)[:, None]
        logits = self._forward(embeds, positions, list(seqs), [s.num_cached for s in seqs])
        self._counters["decode_steps"] += 1
        for seq, token in zip(seqs, self._choose_tokens(seqs, logits)):
            self._accept(seq, token)
        return list(seqs)

    def _burst_length(self, seqs: Seq[Sequence], ahead: int = 0) -> int:
        """How many greedy steps may run before the host looks again (1: step by step), after
        ``ahead`` steps already queued on the device whose tokens the host has not read.

        Only where the decoder engine can burst, every row is greedy and past its
        ``min_new_tokens``, no request waits to join, and within the blocks each sequence
        holds (the scheduler gives greedy rows room for a whole burst where it can), so the
        scheduler's accounting never runs behind.
        """
        burst = self.config.decode_burst
        if burst <= 1 or self.engines.bursts is None or self.scheduler.waiting:
            return 1
        made = [len(s.generated) + ahead for s in seqs]
        if any(not s.sampling.greedy or (n < s.sampling.min_new_tokens and s.stop_token_ids)
               for s, n in zip(seqs, made)):
            return 1
        room = min(len(s.block_table.blocks) * self.config.block_size - s.num_cached - ahead for s in seqs)
        left = max(s.sampling.max_new_tokens - n for s, n in zip(seqs, made))
        return max(1, min(burst, room, left))

    def _burst(self, seqs: Seq[Sequence], steps: int):
        last, positions = _decode_inputs(seqs)
        ids = self.engines.bursts.decode_burst(last, positions, self.kv.k, self.kv.v, _block_tables(seqs),
                                               torch.tensor([s.num_cached for s in seqs]), steps)
        if ids is not None:
            self._count_burst(steps)
        return ids

    def _count_burst(self, steps: int) -> None:
        self._counters["decode_steps"] += steps
        self._counters["decode_bursts"] += 1

    def _collect_burst(self) -> list[Sequence]:
        """Accept the tokens of the burst in flight, one by one as steps would, dropping those
        after a finish; the next burst of the same rows is queued first where it may be, so the
        device is not idle while the host reads these."""
        done, self._in_flight = self._in_flight, None
        self._in_flight = self._follow(done)
        got = []
        for seq, row in zip(done.seqs, done.ids.rows()):
            for token in row:
                if seq.status is Status.FINISHED:
                    break  # the rest of this burst (all of it, when the one before finished the row) is dropped
                seq.block_table.num_tokens += 1  # the K/V of the token before it is in the pool
                self._accept(seq, token)
                if not got or got[-1] is not seq:
                    got.append(seq)
        return got

    def _follow(self, done: _Burst) -> _Burst | None:
        """The next burst of ``done``'s rows, queued before ``done``'s tokens are read.

        Only where those tokens can change nothing but a stop: the same rows run and nobody
        waits to join, every row is still under its ``max_new_tokens`` and past its
        ``min_new_tokens`` after ``done``, and blank blocks hold both bursts' tokens. A row
        that stops inside ``done`` has the next burst's tokens dropped, as a burst drops those
        after a stop inside it (its slots are past its length, and its freed blocks are
        reused only by work queued behind).
        """
        bursts = self.engines.bursts
        seqs = done.seqs
        if bursts is None or tuple(self.scheduler.running) != seqs or \
                any(len(s.generated) + done.steps >= s.sampling.max_new_tokens for s in seqs):
            return None
        for seq in seqs:
            self.scheduler.reserve(seq, min(done.steps + self.config.decode_burst,
                                            seq.sampling.max_new_tokens - len(seq.generated)))
        steps = self._burst_length(seqs, ahead=done.steps)
        if steps < 2 or (ids := bursts.continue_burst(self.kv.k, self.kv.v, _block_tables(seqs), steps)) is None:
            return None
        self._count_burst(steps)
        self._counters["decode_bursts_ahead"] += 1
        return _Burst(seqs, ids, steps)

    def _embeds(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        if end <= seq.prompt_len:
            return seq.prompt_embeds[start:end]
        tail = torch.tensor(seq.generated[max(0, start - seq.prompt_len):end - seq.prompt_len])
        parts = [seq.prompt_embeds[start:seq.prompt_len]] if start < seq.prompt_len else []
        return torch.cat(parts + [self.decoder_engine.embed(tail)])

    def _forward(self, embeds, positions, seqs: list[Sequence], context: list[int]) -> torch.Tensor:
        """Run the decoder engine and write the new K/V at each sequence's slots."""
        t = embeds.shape[1]
        logits, new_k, new_v = self.decoder_engine.step(
            embeds, positions, self.kv.k, self.kv.v, _block_tables(seqs), torch.tensor(context))
        slots = torch.tensor([slot for s, c in zip(seqs, context) for slot in s.block_table.slots(c, t)])
        self.kv.write(slots, new_k, new_v)
        for s in seqs:
            s.block_table.num_tokens += t
        return logits.float()

    def _choose_tokens(self, seqs: Seq[Sequence], logits: torch.Tensor) -> list[int]:
        """Next token of each row; greedy rows in one argmax (one device sync for the batch).

        Sampled rows have their distribution (temperature, top-k, top-p) computed where the
        logits are, and draw from it on the CPU with the request's seeded generator, so a seed
        gives the same random numbers on every device.
        """
        for i, seq in enumerate(seqs):
            if len(seq.generated) < seq.sampling.min_new_tokens and seq.stop_token_ids:
                logits[i, list(seq.stop_token_ids)] = float("-inf")
        greedy = logits.argmax(-1).tolist()
        return [g if s.sampling.greedy else draw(filtered_probs(logits[i], s.sampling), s.generator)
                for i, (s, g) in enumerate(zip(seqs, greedy))]

    def _accept(self, seq: Sequence, token: int) -> None:
        params = seq.sampling
        seq.generated.append(token)
        if seq.timings.first_token is None:
            seq.timings.first_token = time.perf_counter()
        state = self._text[seq.seq_id]
        if params.stop:  # only stop strings need the text at every token
            self._decoded(seq)
        reason = None
        if token in seq.stop_token_ids:
            reason = FinishReason.STOP
        elif params.stop and any(s in state.text for s in params.stop) and len(seq.generated) >= params.min_new_tokens:
            cut = min(state.text.find(s) for s in params.stop if s in state.text)
            state.text, state.stopped, reason = state.text[:cut], True, FinishReason.STOP
        elif len(seq.generated) >= params.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.timings.finished = time.perf_counter()

    def _decoded(self, seq: Sequence) -> _TextState:
        """``seq``'s text state, decoded up to its last token (once per new token, on demand: a
        decode of the whole answer at every token would cost more than a GPU decode step)."""
        state = self._text[seq.seq_id]
        if not state.stopped and state.decoded != len(seq.generated):
            state.text = self.adapter.tokenizer.decode(seq.generated, skip_special_tokens=True)
            state.decoded = len(seq.generated)
        return state

    # --- one request at a time -------------------------------------------------------------
    def text_delta(self, seq: Sequence) -> str:
        """New text of ``seq`` since the last call, holding back what a stop string could still cut."""
        state = self._decoded(seq)
        safe = len(state.text)
        if seq.status is not Status.FINISHED:
            safe -= max((len(s) - 1 for s in seq.sampling.stop), default=0)
            while safe > state.emitted and state.text[safe - 1] == "\ufffd":
                safe -= 1  # an incomplete UTF-8 character
        delta = state.text[state.emitted:max(safe, state.emitted)]
        state.emitted += len(delta)
        return delta

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
        self.last_result = self.result(seq)

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

    def result(self, seq: Sequence) -> GenerationResult:
        state = self._decoded(seq) if seq.seq_id in self._text else _TextState()
        self._text.pop(seq.seq_id, None)
        t = seq.timings
        timings = {
            "vision_s": t.vision_s, "prefill_s": t.prefill_s, "ttft_s": t.ttft_s,
            "total_s": (t.finished or time.perf_counter()) - t.created,
            "decode_tokens_per_s": t.decode_tokens_per_s(len(seq.generated)),
        }
        usage = {"prompt_tokens": seq.prompt_len, "image_tokens": seq.image_tokens,
                 "completion_tokens": len(seq.generated), "total_tokens": seq.num_tokens}
        cache = {"prefix_tokens_reused": seq.prefix_tokens_reused, "vision_reused": seq.vision_reused,
                 "spilled_blocks": seq.spilled_blocks, "restored_blocks": seq.restored_blocks}
        reason = seq.finish_reason.value if seq.finish_reason else "running"
        return GenerationResult(state.text.strip(), list(seq.generated), reason, usage, timings, cache)


def _block_tables(seqs: Seq[Sequence]) -> torch.Tensor:
    """[B, widest table] block ids, shorter tables padded with block 0 (masked by context_lens)."""
    width = max(len(s.block_table.blocks) for s in seqs)
    return torch.tensor([s.block_table.blocks + [0] * (width - len(s.block_table.blocks)) for s in seqs])


def _decode_inputs(seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's last token id and its position, the input of the next decode step."""
    last = torch.tensor([s.generated[-1] for s in seqs])
    return last, torch.cat([s.position(s.num_tokens - 1) for s in seqs], dim=-1)[..., None]


def pool_blocks(config: EngineConfig, cfg) -> int:
    """Device KV blocks: the configured count, else the KV budget over one block's bytes."""
    bytes_per_block = 2 * cfg.num_layers * config.block_size * cfg.kv_size * config.torch_dtype.itemsize
    return config.num_blocks or max(4, config.kv_budget_mb * 2**20 // bytes_per_block)


def _profile(profile, overrides: Seq[str]):
    from edgeinfer import profiles

    if profile is None or isinstance(profile, (str, Path)):
        return profiles.load_profile(None if profile in (None, "auto") else str(profile), overrides)
    if overrides:
        raise RequestError("overrides apply to a profile name or file, not to a built profile")
    return profile
