"""GPU benchmark: ours against transformers' generate() at batch 1, 4 and 16, over the same spans.

One run; every engine in its own worker process (the peer's holds nothing of ours):

- ours: the torch backend, CUDA graphs, the tower readied for the picture's size;
- ``transformers-static``: ``generate()`` with ``cache_implementation="static"``, which
  compiles its decode step with ``torch.compile`` (mode ``reduce-overhead``);
- ``transformers-dynamic``: ``generate()`` with its default dynamic cache, eager.

Every engine answers the same requests: ``b`` different pictures of the same size (so each
request pays for its own vision encoder, and no engine reuses another request's), the same
question, exactly ``new_tokens`` tokens (EOS ignored). Ours has no prefix cache and its
vision cache is cleared before every call. Each repeat times two whole calls with the
device synchronised: ``T_n`` (``new_tokens`` tokens) and ``T_1`` (one token: preprocessing,
vision, prefill and the first token). Both sides get the same figures:

- whole request: ``b * new_tokens / T_n``;
- decode only: ``b * (new_tokens - 1) / (T_n - T_1)``;
- decode in the call: the tokens the ``T_n`` call made after ``F_n`` over ``T_n - F_n``, ``F_n``
  when its last row got its first token to the host: ``(b * new_tokens - M_n) / (T_n - F_n)``,
  ``M_n`` the tokens its rows had made by then. transformers' batched ``generate()`` hands every
  row's first token at once (``M_n = b``); ours prefills the rows one after another and decodes
  the rows it has between them, so its first rows have several tokens by ``F_n``;
- time to first token (batch 1): ``T_1``.

A ratio is ours over the *fastest* peer configuration at that batch size and span. The
roofline uses the best of three bandwidth probes (copy, sum, GEMV), each in the raw file, and
the decode rate in the call (:func:`roofline_span`).

Weight formats (``weights``): ours runs the checkpoint as it is (``bf16``) and, in the same
run, at the same batch sizes with the same prompt and pictures, each quantized format asked
for (``w8a16``, ``w4a16``: the checkpoint quantized once by ``edgeinfer quantize``'s round to
nearest, see :mod:`.weights`). Ours on a quantized checkpoint is recorded as ``ours-w4a16``;
the peers run the checkpoint as it is only. Every engine's record states its checkpoint's
weight bytes, and each of ours gets its own byte roofline: the decoder bytes a step reads as
stored in that format (:func:`edgeinfer.quant.footprint.decode_weight_bytes`) plus the K/V of
every sequence. A Jetson projection (:mod:`.jetson`) scales each measured share to the boards'
bandwidths.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import bench_image, environment, peak_memory_mb, sync
from edgeinfer.bench.jetson import BOARDS, projection, projection_label
from edgeinfer.bench.quiet import (
    QUIET_LOAD,
    LoadTracker,
    RunLog,
    judge,
    refuse_if_noisy,
)
from edgeinfer.bench.roofline import Probe, best_bandwidth_gbs, roofline, step_bytes
from edgeinfer.bench.stats import Spread, ratio, spread
from edgeinfer.bench.weights import (
    check_weights,
    dense_format,
    format_checkpoint,
    is_quantized,
)

QUESTION = "Describe this image."
OURS = "ours"
# How each request chooses its tokens (``sampling``): the argmax, or the draw the table
# names (temperature 0.7, top-p 0.9, a seed per request), on both sides.
GREEDY, SAMPLED = "greedy", "sampled"
SAMPLED_SETTINGS = {"temperature": 0.7, "top_p": 0.9}
PEERS = ("transformers-static", "transformers-dynamic")
KINDS = (OURS, *PEERS)
SPAN_NAMES = {"decode_in_call_tok_s": "decode in the call", "decode_tok_s": "decode only"}


@dataclass(frozen=True)
class GpuBenchSpec:
    model: Path
    image_size: tuple[int, int] = (1024, 768)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    new_tokens: int = 64
    repeats: int = 3
    # Untimed calls per batch size. One suffices: its decode steps call the compiled step
    # dozens of times, so compilation and CUDA graph recording are over when timing starts.
    warmup: int = 1
    # With any warm-up, the first batch size's go on until this many seconds have passed since
    # they began: after a load of under 20 s the host's preprocessing ran 5x slower for up to
    # 3.8 s on an H100 machine, while torch.compile's compile workers started beside it
    # (docs/results/probes/h100-compile-workers), and a run's timed calls used to fall inside that.
    # Our engine's load here captures nothing at start-up, so it leaves them to torch, which starts
    # them at the first compile, as a peer that compiles does: both keep the warm-up.
    warmup_s: float = 5.0
    bandwidth_mib: int = 1024  # buffer size of each bandwidth probe
    dtype: str = "bfloat16"
    device: str = "cuda"
    kinds: tuple[str, ...] = KINDS
    # Weight formats ours runs (see .weights); empty: the checkpoint as it is, in ``dtype``.
    weights: tuple[str, ...] = ()
    group_size: int = 128  # input columns per scale of the quantized formats
    sampling: tuple[str, ...] = (GREEDY,)  # every engine runs once per entry
    # Seconds each engine's worker may take, load and compilation included (None: no limit); one
    # that takes longer is killed and recorded under ``errors``, and the others' figures are kept.
    engine_timeout_s: float | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be >= 2: decode is timed as T(new_tokens) - T(1)")
        check_weights(self.formats, self.dtype)
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, not {self.group_size}")
        if not self.sampling or set(self.sampling) - {GREEDY, SAMPLED}:
            raise ValueError(f"sampling must name {GREEDY} and/or {SAMPLED}, not {list(self.sampling)}")
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must be >= 0, not {self.warmup_s}")
        if self.engine_timeout_s is not None and self.engine_timeout_s <= 0:
            raise ValueError(f"engine_timeout_s must be > 0, not {self.engine_timeout_s}")

    @property
    def sampled(self) -> bool:
        """Whether a worker's engine samples (a worker's spec names one mode)."""
        return self.sampling == (SAMPLED,)

    @property
    def dense(self) -> str:
        """The checkpoint as it is: the format the peers run."""
        return dense_format(self.dtype)

    @property
    def formats(self) -> tuple[str, ...]:
        return self.weights or (self.dense,)

    def engines(self) -> list[tuple[str, str, str, str]]:
        """(label, kind, weight format, sampling) of every engine run, in order: ours once per format
        (``ours`` on the checkpoint as it is, ``ours-w4a16`` ...), each peer once, as it is; each
        of those once per sampling mode (``-sampled`` appended to a sampled engine's label)."""
        out = []
        for kind in self.kinds:
            formats = self.formats if kind == OURS else (self.dense,)
            out += [(engine_label(kind, fmt, self.dense) + ("-sampled" if mode == SAMPLED else ""), kind, fmt, mode)
                    for fmt in formats for mode in self.sampling]
        return out

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": str(self.model)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GpuBenchSpec":
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        return cls(**{**data, "model": Path(data["model"]), "image_size": tuple(data["image_size"]),
                      "batch_sizes": tuple(data["batch_sizes"]), "kinds": tuple(data["kinds"]),
                      "weights": tuple(data.get("weights", ())),
                      "sampling": tuple(data.get("sampling", (GREEDY,)))})


def engine_label(kind: str, fmt: str, dense: str) -> str:
    """``ours`` on the checkpoint as it is (the name earlier raw files use), ``ours-w4a16`` on a quantized one."""
    return kind if fmt == dense else f"{kind}-{fmt}"


def prompt_digest(ids: list[int]) -> str:
    """A short digest of prompt ids, so both sides can be shown to have run the same prompt."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


# --- the measurement, the same for every engine -----------------------------------------------

# (batch, new tokens, pictures) -> seconds of the whole call, seconds until every row of it had its
# first token on the host, and the tokens its rows had made by then, all together
Call = Callable[[int, int, list], tuple[float, float, int]]


def measure(spec: GpuBenchSpec, kind: str, call: Call, log: RunLog,
            clock: Callable[[], float] = time.perf_counter) -> None:
    """Warm-ups, then ``repeats`` timed pairs (``T_n``, ``T_1``) at every batch size, into ``log``;
    when the ``T_n`` call's last row had its first token is kept too (``full_first_s``), and how many
    tokens its rows had made by then (``full_first_tokens``). Each batch size has
    ``warmup`` warm-up pairs; the first one's go on until ``warmup_s`` seconds have passed since
    they began (every one is in ``log``, untimed)."""
    def pair(batch: int, images: list, label: str, timed: bool) -> None:
        with log.run(label, timed=timed) as record:
            full, full_first, made = call(batch, spec.new_tokens, images)
            first, _, _ = call(batch, 1, images)
            record.update(batch=batch, full_s=full, first_s=first, full_first_s=full_first, full_first_tokens=made)

    for n, batch in enumerate(spec.batch_sizes):
        images = [bench_image(spec.image_size, seed=i) for i in range(batch)]
        started, i = clock(), 0
        while i < spec.warmup or (n == 0 and spec.warmup and clock() - started < spec.warmup_s):
            pair(batch, images, f"{kind} b={batch} warm-up {i}", timed=False)
            i += 1
        for i in range(spec.repeats):
            pair(batch, images, f"{kind} b={batch} #{i}", timed=True)


def run_figures(record: dict[str, Any], new_tokens: int) -> dict[str, float | None]:
    """One timed pair's figures: whole-request and decode-only tokens/s, time to first token.

    ``decode_tok_s`` is the full call less the one-token call, so a one-token call that ran long
    or short moves it; ``decode_in_call_tok_s`` takes the tokens the full call made after its last
    row's first token over the time that took (None for records made before it was kept; and at
    batch > 1 for records made before the tokens made by then were kept, ``full_first_tokens``:
    those counted ``b * (new_tokens - 1)``, more than ours makes in that span)."""
    b, full, first = record["batch"], record["full_s"], record["first_s"]
    decode = b * (new_tokens - 1) / (full - first) if full > first else None
    own_first = record.get("full_first_s")
    made = record.get("full_first_tokens", 1 if b == 1 else None)
    in_call = (b * new_tokens - made) / (full - own_first) \
        if own_first is not None and made is not None and full > own_first else None
    return {"request_tok_s": b * new_tokens / full, "decode_tok_s": decode, "decode_in_call_tok_s": in_call,
            "first_token_s": first}


def roofline_span(figures: dict[str, Spread]) -> tuple[str, float]:
    """The decode rate a roofline share is taken from, and its span: decode in the call where
    every timed run recorded its full call's first tokens (the call's own span, which a one-token
    call that ran long or short does not move), else decode only."""
    in_call, only = figures["decode_in_call_tok_s"], figures["decode_tok_s"]
    if in_call.n and in_call.n >= only.n:
        return "decode_in_call_tok_s", in_call.median
    return "decode_tok_s", only.median


def summarize(records: list[dict[str, Any]], new_tokens: int) -> dict[int, dict[str, Spread]]:
    """Per batch size: median, min and max of every timed run's figures."""
    out: dict[int, dict[str, Spread]] = {}
    for batch in sorted({r["batch"] for r in records if r.get("timed")}):
        runs = [run_figures(r, new_tokens) for r in records if r.get("timed") and r["batch"] == batch]
        out[batch] = {key: spread(run[key] for run in runs) for key in runs[0]}
    return out


def compare(summaries: dict[str, dict[int, dict[str, Spread]]]) -> dict[int, dict[str, Any]]:
    """Per batch size and span: ours over the fastest peer configuration measured in this run."""
    peers = {k: v for k, v in summaries.items() if k in PEERS}
    ours = summaries.get(OURS, {})
    out: dict[int, dict[str, Any]] = {}
    for batch, figures in ours.items():
        row: dict[str, Any] = {}
        for key, faster in (("decode_tok_s", max), ("decode_in_call_tok_s", max), ("request_tok_s", max),
                            ("first_token_s", min)):
            candidates = {k: s[batch][key].median for k, s in peers.items() if batch in s and s[batch][key].n}
            if not candidates:
                continue
            best = faster(candidates, key=candidates.get)
            # Speed-up: a rate over a rate; for the first token, the peer's time over ours.
            value = ratio(figures[key].median, candidates[best]) if key != "first_token_s" else \
                ratio(candidates[best], figures[key].median)
            row[key] = {"fastest_peer": best, "peer": candidates[best], "ours": figures[key].median, "speedup": value}
        out[batch] = row
    return out


def compare_weights(summaries: dict[str, dict[int, dict[str, Spread]]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per quantized engine of ours and batch size: its figures over ours on the checkpoint as it is."""
    dense = summaries.get(OURS, {})
    return {label: {batch: _over(figures, dense[batch]) for batch, figures in per_batch.items() if batch in dense}
            for label, per_batch in summaries.items() if label.startswith(f"{OURS}-")}


def _over(figures: dict[str, Spread], base: dict[str, Spread]) -> dict[str, float]:
    """Rates over the base's rates; for the first token, the base's time over this one's (above 1: faster)."""
    return {"decode_tok_s": ratio(figures["decode_tok_s"].median, base["decode_tok_s"].median),
            "decode_in_call_tok_s": ratio(figures["decode_in_call_tok_s"].median,
                                          base["decode_in_call_tok_s"].median),
            "request_tok_s": ratio(figures["request_tok_s"].median, base["request_tok_s"].median),
            "first_token_s": ratio(base["first_token_s"].median, figures["first_token_s"].median)}


# --- the checkpoints of each weight format -------------------------------------------------------

def prepare_weights(spec: GpuBenchSpec, cache: Path, steps=None,
                    log: Callable[[str], None] = print) -> dict[str, Path]:
    """The checkpoint of every weight format ours runs: the model itself for the format it is in,
    a quantized copy (written once under ``cache``, see :mod:`.weights`) for each other one.
    ``steps`` receives the quantizer's progress."""
    checkpoints = {spec.dense: spec.model}
    if OURS not in spec.kinds:
        return checkpoints
    for fmt in filter(is_quantized, spec.formats):
        checkpoints[fmt] = format_checkpoint(spec.model, fmt, cache, spec.group_size, spec.dtype, steps, log)
    return checkpoints


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def weight_record(fmt: str, checkpoint: Path, peer: bool, dtype: str) -> dict[str, Any]:
    """What an engine's raw record says of the weights it ran: format, folder, bytes as stored,
    and the decoder bytes one decode step reads when it runs in ``dtype`` (dense tensors are
    converted to it at load; quantized ones stay as stored)."""
    from edgeinfer.quant.footprint import decode_weight_bytes, weight_footprint

    footprint = weight_footprint(checkpoint)
    record = {"weights": fmt, "checkpoint": str(checkpoint), "weight_format": footprint.format,
              "weight_bytes": footprint.total_bytes, "quantized_weight_bytes": footprint.quantized_bytes,
              "decode_weight_bytes": decode_weight_bytes(checkpoint, DTYPE_BYTES[dtype]).to_dict()}
    if peer:
        record["weights_note"] = f"transformers runs the {fmt} checkpoint only"
    return record


# --- ours ----------------------------------------------------------------------------------------

def ours_config(dtype: str, device: str, image_size: tuple[int, int], max_batch: int):
    """The engine configuration ours runs in (the GPU profiling and probe scripts load it too).

    The picture's size is named as a profile names its cameras' (runtime.vision_compile_sizes),
    so the tower is ready for it at load. No prefix cache: every request pays for its prefill.
    64 MB of KV per row (with 1 GB at least): a 1024x768 picture's prompt and its answer in a 2B
    model's pool at every batch size, so that no row is preempted while timed."""
    from edgeinfer.engine import EngineConfig

    cuda = device.startswith("cuda")
    return EngineConfig(dtype=dtype, device=device, max_batch_size=max_batch, block_size=16,
                        kv_budget_mb=max(1024, 64 * max_batch), max_context=4096, prefill_chunk=4096,
                        vision_cache_entries=1, cuda_graphs=cuda, prefix_cache=False,
                        vision_compile_sizes=(image_size,) if cuda else ())


def run_ours(spec: GpuBenchSpec) -> dict[str, Any]:
    from edgeinfer.bench.serve import counting
    from edgeinfer.engine import Engine, SamplingParams

    engine = Engine.load(spec.model, config=ours_config(spec.dtype, spec.device, spec.image_size,
                                                        max(spec.batch_sizes)))
    prompts: list[list[int]] = []
    parts: list[dict[str, float]] = []  # each call's host-side parts, in the order of the calls

    def call(batch: int, new_tokens: int, images: list) -> tuple[float, float, int]:
        settings = SAMPLED_SETTINGS if spec.sampled else {}
        params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=i if spec.sampled else None,
                                 **settings) for i in range(len(images))]
        engine.vision_cache.clear()
        sync(spec.device)
        counted: dict[str, Any] = {}
        with counting(engine, counted):
            started = time.perf_counter()
            seqs = [engine.submit(QUESTION, [image], p) for image, p in zip(images, params)]
            submitted = time.perf_counter()
            while any(not s.generated for s in seqs):  # the first rows decode while the later ones prefill
                engine.step()
            made = sum(len(s.generated) for s in seqs)
            results = engine.run_until_done(seqs)
            sync(spec.device)
            seconds = time.perf_counter() - started
        if any(len(r.token_ids) != new_tokens for r in results):
            raise RuntimeError(f"ours generated {[len(r.token_ids) for r in results]} tokens, not {new_tokens}")
        prompts.append(seqs[0].prompt_ids)
        first = max(s.timings.first_token for s in seqs) - started  # stamped as the host takes it
        parts.append({"submit_s": submitted - started, "first_token_s": first,
                      "vision_s": max(s.timings.vision_s for s in seqs),
                      "prefill_s": max(s.timings.prefill_s for s in seqs), "during": counted["during"]})
        return seconds, first, made

    log = RunLog()
    measure(spec, OURS, call, log)
    # Where each call's first token went (a diagnostic): ``submit_s`` the host's submits (each
    # row's preprocessing and prompt, then its vision launched), ``vision_s`` the slowest row's
    # vision launch alone, ``prefill_s`` the slowest row's prefill, its waits for the device
    # included; ``during`` what the call compiled, captured and tuned (``serve.compile_state``:
    # the engine loads without start-up captures, so a batch size's first call does that work).
    for record, full, one in zip(log.records, parts[::2], parts[1::2], strict=True):
        record["parts"] = {"full": full, "one": one}
    decoder = engine.model.decoder
    return {"runs": log.records, "prompt_tokens": len(prompts[0]), "prompt_digest": prompt_digest(prompts[0]),
            "peak_memory_mb": peak_memory_mb(spec.device),
            "text_weight_bytes": sum(p.numel() * p.element_size() for n, p in decoder.named_parameters()
                                     if n != "embed"),  # a tied head is lm_head_t, read every step
            # What the decoder holds on the device (parameters and buffers, packed weights included):
            # above the stored bytes, the weights ran in a wider form than the checkpoint keeps them.
            "loaded_text_bytes": sum(t.numel() * t.element_size()
                                     for n, t in (*decoder.named_parameters(), *decoder.named_buffers())
                                     if n != "embed"),
            "kv_bytes_per_token": engine.kv.bytes_per_block // engine.config.block_size,
            "diagnostics": _diagnostics(engine)}


def _diagnostics(engine) -> dict[str, Any]:
    """What ran: graphs, bursts, compile or capture failures (reported, never used for control)."""
    decoder, vision = engine.decoder_engine, engine.vision_engine
    counters = engine.counters
    return {"decode_steps": counters.get("decode_steps"), "decode_bursts": counters.get("decode_bursts"),
            "decode_bursts_ahead": counters.get("decode_bursts_ahead"),
            "cuda_graph_captures": getattr(decoder, "captures", None),
            "prefill_replays": getattr(decoder, "prefill_replays", None),
            "compile_error": getattr(decoder, "compile_error", None),
            "prompt_compile_error": getattr(decoder, "prompt_compile_error", None),
            "vision_captured": bool(getattr(vision, "captured_signatures", None)),
            "vision_compiled": bool(getattr(vision, "compiled_signatures", None)),
            "vision_capture_error": getattr(vision, "capture_error", None),
            "vision_graph_compile_error": getattr(vision, "compile_error", None),
            "vision_compile_error": getattr(engine, "vision_compile_error", None),
            # The fused step's tile per product with its timed speed, and the packed kernels' tiles.
            "kernels": getattr(decoder, "kernel_report", None), "packed_tiles": _packed_tiles()}


def _packed_tiles() -> list[dict]:
    from edgeinfer.quant.kernels import tuned_choices

    return tuned_choices()


def run_bandwidth(spec: GpuBenchSpec) -> dict[str, Any]:
    from edgeinfer.bench.roofline import measure_probes

    probes = measure_probes(spec.device, mib=spec.bandwidth_mib, dtype=spec.dtype)
    return {"probes": [p.to_dict() for p in probes], "environment": environment(spec.device)}


# --- the run ---------------------------------------------------------------------------------------

@dataclass
class GpuReport:
    spec: GpuBenchSpec
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    probes: list[Probe] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)  # read in a worker: this process stays off the GPU

    @classmethod
    def from_raw(cls, data: dict[str, Any]) -> "GpuReport":
        """The report a raw file was written from (its spec, runs, records and probes), so that
        its summary can be derived again by the present method."""
        results = {label: {**record, "runs": data["runs"][label]} for label, record in data["results"].items()}
        probes = [Probe(p["name"], p["bytes"], p["seconds"]) for p in data["bandwidth"]["probes"]]
        return cls(GpuBenchSpec.from_json(data["spec"]), results, dict(data.get("errors", {})), probes,
                   data.get("environment", {}))

    def summaries(self) -> dict[str, dict[int, dict[str, Spread]]]:
        return {kind: summarize(r["runs"], self.spec.new_tokens) for kind, r in self.results.items()}

    def same_prompt(self) -> bool:
        return len({r["prompt_digest"] for r in self.results.values()}) <= 1

    def rooflines(self) -> dict[str, dict[int, dict[str, float]]]:
        """Each of our engines' own byte roofline per batch size: the bytes a step reads (its
        checkpoint's decoder as stored, plus every sequence's K/V), the roofline rate and the
        share of it measured."""
        if not self.probes:
            return {}
        bandwidth, out = best_bandwidth_gbs(self.probes), {}
        for label, result in self.results.items():
            if result.get("kind") != OURS:
                continue
            spans = {b: roofline_span(s) for b, s in summarize(result["runs"], self.spec.new_tokens).items()}
            context = result["prompt_tokens"] + self.spec.new_tokens / 2
            weights, kv = result["decode_weight_bytes"]["per_step"], result["kv_bytes_per_token"]
            rates = {b: rate for b, (_, rate) in spans.items()}
            out[label] = {b: {**row, "span": spans[b][0], "step_bytes": step_bytes(weights, kv, context, b),
                              "weight_bytes": weights}
                          for b, row in roofline(rates, bandwidth, weights, kv, context).items()}
        return out

    def roofline(self) -> dict[int, dict[str, float]]:
        """Ours on the checkpoint as it is (the raw file's ``roofline``, as before)."""
        return self.rooflines().get(OURS, {})

    def jetson(self) -> list[dict[str, Any]]:
        return projection(self.rooflines())


def run(spec: GpuBenchSpec, log: Callable[[str], None] = print,
        checkpoints: Mapping[str, Path] | None = None,
        after_each: Callable[[GpuReport, list[str]], None] | None = None) -> GpuReport:
    """Every engine in its own worker; ``checkpoints`` maps each weight format to its folder
    (:func:`prepare_weights`; by default built under the model's parent folder). ``after_each``
    is called after every worker but the last, done or failed, with the report so far and the
    names of the workers still to run."""
    from edgeinfer.bench.common import call_worker

    checkpoints = dict(checkpoints) if checkpoints is not None else prepare_weights(spec, spec.model.parent, log=log)
    report = GpuReport(spec)
    tasks = [("gpu-bandwidth", "bandwidth", spec.dense, GREEDY)] + [(f"gpu-{kind}", label, fmt, mode)
                                                                   for label, kind, fmt, mode in spec.engines()]
    for i, (task, name, fmt, mode) in enumerate(tasks):
        if after_each is not None and i:
            after_each(report, [pending for _, pending, _, _ in tasks[i:]])
        log(f"[bench gpu] {spec.model.name}: {name} ...")
        started = time.perf_counter()
        checkpoint = checkpoints[fmt]
        try:
            out = call_worker(task, replace(spec, model=checkpoint, weights=(fmt,), sampling=(mode,)).to_json(),
                              timeout_s=spec.engine_timeout_s)
        except RuntimeError as error:
            report.errors[name] = str(error)
            log(f"[bench gpu] {name} failed:\n{str(error)[-2000:]}")
            continue
        log(f"[bench gpu] {name}: {time.perf_counter() - started:.0f} s")
        if name == "bandwidth":
            report.probes = [Probe(p["name"], p["bytes"], p["seconds"]) for p in out["probes"]]
            report.environment = out["environment"]
        else:
            kind = task.removeprefix("gpu-")
            report.results[name] = {**out, "kind": kind, "sampling": mode,
                                    **weight_record(fmt, checkpoint, peer=kind != OURS, dtype=spec.dtype)}
    return report


def to_raw(report: GpuReport, tracker: LoadTracker, max_load: float, allow_noisy: bool,
           pending: Sequence[str] = ()) -> tuple[dict, Any]:
    """The raw file's content; ``pending``: workers not yet run (the file is then a partial one,
    not publishable)."""
    records = [r for result in report.results.values() for r in result["runs"]]
    verdict = judge(records, tracker.share_at, max_load, enforced=not report.spec.device.startswith("cuda"))
    summaries = report.summaries()
    body = {"bandwidth": {"probes": [p.to_dict() for p in report.probes],
                          "best_gbs": best_bandwidth_gbs(report.probes) if report.probes else None},
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in report.results.items()},
            "runs": {k: v["runs"] for k, v in report.results.items()},
            "summary": summaries, "speedups": compare(summaries), "roofline": report.roofline(),
            "same_prompt": report.same_prompt(), "errors": report.errors,
            "weights": {"formats": list(report.spec.formats), "peers_run": report.spec.dense,
                        "note": f"transformers runs the {report.spec.dense} checkpoint only; ours runs every format",
                        "over_dense": compare_weights(summaries)},
            "rooflines": report.rooflines(),
            "jetson": {"label": projection_label(report.environment.get("gpu")), "rows": report.jetson()}}
    head = raw.header("gpu", report.spec.to_json(), report.environment or environment("cpu"))
    problems = raw.comparison_problems(report.errors, report.same_prompt()) + raw.incomplete(pending)
    return raw.with_verdict({**head, **body}, verdict, allow_noisy, problems), verdict


def _cell(s: Spread, scale: float = 1.0, digits: int = 0) -> str:
    if not s.n:
        return "–"
    return f"{s.median * scale:.{digits}f} ({s.min * scale:.{digits}f}–{s.max * scale:.{digits}f})"


def markdown(report: GpuReport) -> str:
    spec, summaries, speedups = report.spec, report.summaries(), compare(report.summaries())
    over_dense = compare_weights(summaries)
    batches = list(spec.batch_sizes)
    warmups = (f"at least {spec.warmup} untimed (the first batch size's for at least {spec.warmup_s:g} s)"
               if spec.warmup and spec.warmup_s else f"{spec.warmup} untimed")
    lines = [f"Medians of {spec.repeats} timed pairs of calls (min–max) per batch size, after {warmups}; "
             f"{spec.new_tokens} tokens; {spec.image_size[0]}×{spec.image_size[1]} pictures, one per request.", ""]
    if any(map(is_quantized, spec.formats)):
        lines += [_weights_line(spec), ""]
    for key, title, scale, digits in (("decode_tok_s", "decode only (tok/s)", 1, 0),
                                      ("decode_in_call_tok_s", "decode in the call (tok/s)", 1, 0),
                                      ("request_tok_s", "whole request (tok/s)", 1, 0)):
        lines += ["| engine | " + " | ".join(f"{title} b={b}" for b in batches) + " |",
                  "|---" * (1 + len(batches)) + "|"]
        for kind, per_batch in summaries.items():
            lines.append(f"| {kind} | " + " | ".join(_cell(per_batch[b][key], scale, digits) if b in per_batch
                                                      else "–" for b in batches) + " |")
        lines.append("| **ours / fastest peer** | " + " | ".join(
            f"**{speedups[b][key]['speedup']:.2f}×** ({speedups[b][key]['fastest_peer']})"
            if b in speedups and key in speedups[b] else "–" for b in batches) + " |")
        for label, per_batch in over_dense.items():
            lines.append(f"| **{label} / {OURS}** | " + " | ".join(
                f"**{per_batch[b][key]:.2f}×**" if b in per_batch else "–" for b in batches) + " |")
        lines.append("")
    if 1 in batches:
        lines += ["| engine | time to first token b=1 (ms) | peak memory (MB) |", "|---|---|---|"]
        for kind, per_batch in summaries.items():
            lines.append(f"| {kind} | {_cell(per_batch[1]['first_token_s'], 1e3, 1)} | "
                         f"{report.results[kind]['peak_memory_mb']:.0f} |")
        lines.append("")
    if report.probes:
        probes = ", ".join(f"{p.name} {p.gbs:.0f}" for p in report.probes)
        best = best_bandwidth_gbs(report.probes)
        lines += [f"Bandwidth (GB/s): {probes}; the roofline uses the best, {best:.0f}.", ""]
        lines += _roofline_table(report, batches) + _jetson_table(report, batches)
    if not report.same_prompt():
        lines.append("\n**The engines' prompt ids differ: this comparison is not like for like.**")
    for kind, error in report.errors.items():
        lines.append(f"\n{kind} failed:\n```\n{error[-1500:]}\n```")
    return "\n".join(lines) + "\n"


def _weights_line(spec: GpuBenchSpec) -> str:
    quantized = [f for f in spec.formats if is_quantized(f)]
    return (f"Weights: ours runs {', '.join(spec.formats)}; {', '.join(quantized)} quantized once from the "
            f"{spec.dense} checkpoint by `edgeinfer quantize --method rtn --group-size {spec.group_size} "
            f"--dtype {spec.dtype}`. "
            f"The transformers peers run the {spec.dense} checkpoint only.")


def _mb(value: float) -> str:
    mb = value / 1e6
    return f"{mb:,.0f}" if mb >= 100 else f"{mb:.3g}"


def _roofline_table(report: GpuReport, batches: list[int]) -> list[str]:
    """Each of ours: its weights as stored, the bytes a step reads, the share of its own roofline."""
    rooflines = report.rooflines()
    if not rooflines:
        return []
    spans = {row["span"] for per_batch in rooflines.values() for row in per_batch.values()}
    named = " and ".join(sorted(SPAN_NAMES[s] for s in spans))
    lines = [(f"Byte roofline, {named}: bytes a step reads = the decoder's weights as stored + every "
              "sequence's K/V at the prompt plus half the new tokens."), "",
             "| engine | checkpoint weights (MB) | decoder read per step (MB) | "
             + " | ".join(f"share of roofline b={b}" for b in batches) + " |",
             "|---" * (3 + len(batches)) + "|"]
    for label, per_batch in rooflines.items():
        result = report.results[label]
        cells = [f"{v['fraction']:.1%} of {v['roofline_tok_s']:,.0f} tok/s"
                 if (v := per_batch.get(b)) and math.isfinite(v["fraction"]) else "–" for b in batches]
        lines.append(f"| {label} | {_mb(result['weight_bytes'])} | {_mb(result['decode_weight_bytes']['per_step'])} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    for label in rooflines:
        result = report.results[label]
        held, stored = result.get("loaded_text_bytes"), result["decode_weight_bytes"]["per_step"]
        if label != OURS and held and held > 1.5 * stored:
            lines += [(f"{label} held {_mb(held)} MB of decoder weights on the device against {_mb(stored)} MB "
                       "stored: its weights ran in a wider form than stored, so it read more than its roofline "
                       "counts."), ""]
    return lines


def _jetson_table(report: GpuReport, batches: list[int]) -> list[str]:
    rows = report.jetson()
    if not rows:
        return []
    lines = [(f"Jetson decode (tok/s), {projection_label(report.environment.get('gpu'))}: share of roofline × "
              "the board's bandwidth / bytes a step reads per token. A board's achievable share is usually lower."),
             "",
             "| board | bandwidth (GB/s) | engine | " + " | ".join(f"projected b={b}" for b in batches) + " |",
             "|---" * (3 + len(batches)) + "|"]
    for row in rows:
        lines.append(f"| {row['board']} | {row['bandwidth_gbs']:g} | {row['engine']} | " + " | ".join(
            f"{row['tok_s'][b]:,.0f}" if math.isfinite(row["tok_s"].get(b, math.nan)) else "–"
            for b in batches) + " |")
    sources = "; ".join(f"{b.name}: {b.source}" for b in BOARDS)
    return lines + ["", f"Board bandwidths: {sources}.", ""]


def raw_stem(spec: GpuBenchSpec) -> str:
    """``gpu-<model>``, ``gpu-<model>-bf16-w8a16-w4a16`` when more than the checkpoint as it is runs,
    and ``-greedy-sampled`` (the modes) appended when any engine samples."""
    stem = f"gpu-{spec.model.name}"
    stem = stem if spec.formats == (spec.dense,) else "-".join((stem, *spec.formats))
    return stem if spec.sampling == (GREEDY,) else "-".join((stem, *spec.sampling))


def bench(spec: GpuBenchSpec, out: Path, *, max_load: float = QUIET_LOAD, allow_noisy: bool = False,
          log: Callable[[str], None] = print, checkpoints: Mapping[str, Path] | None = None) -> Path:
    """Run the GPU benchmark, write ``gpu-<model>.json`` (+ ``.md``) under ``out`` (see :func:`raw_stem`),
    return its path; it is rewritten after every worker, marked incomplete until the last.
    ``checkpoints``: each weight format's folder (:func:`prepare_weights`).
    Raises ``LimitExceeded`` for noisy CPU runs (the file is written first, marked unpublishable)."""
    def keep_so_far(report: GpuReport, pending: list[str]) -> None:
        # A run stopped before its end (a time limit, ^C) leaves what its finished workers measured.
        partial, _ = to_raw(report, tracker, max_load, allow_noisy, pending)
        raw.write(out, raw_stem(spec), partial, markdown(report))

    with LoadTracker() as tracker:
        report = run(spec, log, checkpoints, after_each=keep_so_far)
    data, verdict = to_raw(report, tracker, max_load, allow_noisy)
    path = raw.write(out, raw_stem(spec), data, markdown(report))
    log(markdown(report))
    raw.refuse_if_problems(data["problems"], path)
    refuse_if_noisy(verdict, path, allow_noisy)
    return path
