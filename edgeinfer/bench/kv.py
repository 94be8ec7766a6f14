"""``edgeinfer bench kv``: the KV spill manager against recomputing, against itself with spilling off,
and against transformers' offloading cache.

One run; every timed figure is the median of all its runs (min and max beside it), each
run recorded with the load average around it (``quiet.py``):

- ``resume``: an idle session (one image + about 1K tokens of history) asked a follow-up
  question, its blocks on the host tier, on disk (page cache dropped), and after a
  restart; against recomputing the session (vision output cached, and not).
- ``overhead``: the spill machinery's cost end to end: the same sessions and turns, the
  same prefix cache, no memory pressure, host and disk tiers on against off; whole-run
  tokens/s (background write-through included), runs interleaved.
- ``round_robin``: eight sessions take turns; the device pool holds 25% of their working
  set. Throughput against an unconstrained pool, requests that failed, tokens equal, and
  blocks spilled per run (a squeezed run that spilled nothing measured nothing: the part
  is then marked unpublishable). On CUDA also the share of transfer time hidden behind compute.
- ``peer`` (CUDA only: transformers' offloading cache needs it): offloading against
  offloading, **both batched**: every round's turns of all sessions go in one batch on
  both sides; no reuse across requests on either side (our prefix cache is off, each turn
  resends its whole conversation as transformers does); the vision encoder runs for every
  request on both sides (one picture per session, our vision cache cleared each round, no
  disk tier); the assistant turns are scripted, so both sides run the same prompts. Ours:
  the device pool at 25% of the working set, preempted sequences spilled to the host tier
  and restored. Peer: ``generate()`` with ``DynamicCache(offloading=True)`` in its own process.
- ``drift``: the int8 and fp8 host tiers under constant spilling: the largest logit
  difference against full precision and how many greedy tokens stay equal (not timed).
- ``demo``: the demo model's accuracy with the device pool squeezed, per host precision
  (not timed; when the demo model is present).
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from edgeinfer.bench import raw
from edgeinfer.bench.common import bench_image, environment, peak_memory_mb, sync
from edgeinfer.bench.quiet import QUIET_LOAD, LoadTracker, RunLog, judge, refuse_if_noisy
from edgeinfer.bench.stats import Spread, ratio, spread
from edgeinfer.errors import EdgeInferError

PARTS = ("resume", "overhead", "round_robin", "peer", "drift", "demo")


@dataclass(frozen=True)
class KVBenchSpec:
    model: Path
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 2
    repeats: int = 3
    image_size: int = 512
    history_tokens: int = 1024  # the resumed session: image + history, in tokens
    session_tokens: int = 384  # each round-robin session's opening turn, in tokens
    sessions: int = 8
    rounds: int = 3
    new_tokens: int = 16
    overhead_sessions: int = 4  # the spill-overhead workload: fewer sessions, no pressure
    overhead_rounds: int = 2
    pool_fraction: float = 0.25
    block_size: int = 16
    max_batch_size: int = 4
    parts: tuple[str, ...] = PARTS
    demo_questions: int = 140
    scratch: Path | None = None  # disk tier folder; a temporary one by default

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")


# --- observing the engine ------------------------------------------------------------------------
def record_logits(engine, sink: dict) -> None:
    """Record every row of logits the engine samples from, as ``sink[(seq_id, step)]`` (float32, CPU)."""
    choose = engine.runner.choose_tokens

    def recording(seqs, logits):
        for seq, row in zip(seqs, logits):
            sink[(seq.seq_id, len(seq.generated))] = row.detach().float().cpu().clone()
        return choose(seqs, logits)

    engine.runner.choose_tokens = recording


@dataclass(frozen=True)
class Drift:
    max_abs: float
    compared: int  # logit rows compared (each sequence up to its first differing token)
    same_tokens: int
    total_tokens: int


def max_logit_drift(ref_logits: dict, logits: dict, ref_tokens: list[list[int]], tokens: list[list[int]]) -> Drift:
    """Largest |logit difference| between two runs of the same requests, in submission order."""
    import torch

    def by_order(rows: dict) -> dict:
        order = {sid: i for i, sid in enumerate(sorted({sid for sid, _ in rows}))}
        return {(order[sid], step): row for (sid, step), row in rows.items()}

    ref, got = by_order(ref_logits), by_order(logits)
    worst, compared = 0.0, 0
    for i, (want, have) in enumerate(zip(ref_tokens, tokens)):
        for step in range(min(len(want), len(have))):
            a, b = ref.get((i, step)), got.get((i, step))
            if a is None or b is None:
                break
            finite = torch.isfinite(a) & torch.isfinite(b)
            worst = max(worst, float((a - b)[finite].abs().max()))
            compared += 1
            if want[step] != have[step]:
                break
    same = sum(x == y for want, have in zip(ref_tokens, tokens) for x, y in zip(want, have))
    return Drift(worst, compared, same, sum(len(t) for t in ref_tokens))


# --- workloads ----------------------------------------------------------------------------------
def _words(tokenizer) -> list[str]:
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and 2 < len(w) < 9)
    return words or ["the", "cat", "sat", "on", "a", "mat"]


def _text(words: list[str], n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n))


def prompt_len(engine, messages, images) -> int:
    seq = engine.submit(messages, images)
    engine.cancel(seq)
    engine.result(seq)
    return seq.prompt_len


def fit_text(engine, messages_of: Callable[[str], list], images: list, tokens: int, seed: int) -> list:
    """Messages whose prompt is about ``tokens`` long: filler text grown until it is."""
    words = _words(engine.adapter.tokenizer)
    n = max(8, tokens // 2)
    for _ in range(8):
        messages = messages_of(_text(words, n, seed))
        length = prompt_len(engine, messages, images)
        if abs(length - tokens) <= max(8, tokens // 50):
            break
        n = max(8, round(n * tokens / max(length, 1)))
    return messages


def opening(text: str, label: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": label}, {"type": "image"},
                                         {"type": "text", "text": text}]}]


def follow_up(messages: list, answer: str, question: str) -> list:
    """The conversation with an answer and a new question (content as parts: every chat template reads them)."""
    return messages + [{"role": "assistant", "content": [{"type": "text", "text": answer}]},
                       {"role": "user", "content": [{"type": "text", "text": question}]}]


def _sampling(tokens: int):
    from edgeinfer.engine import SamplingParams

    return SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens)


class Harness:
    """Engines over one loaded model, each with its own KV configuration; the run log of timed runs."""

    def __init__(self, spec: KVBenchSpec, log: RunLog) -> None:
        import torch

        from edgeinfer.engine import Engine, EngineConfig
        from edgeinfer.models.loader import load_model

        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.log = log
        self.base = EngineConfig(dtype=spec.dtype, device=spec.device, threads=spec.threads,
                                 block_size=spec.block_size, max_batch_size=spec.max_batch_size,
                                 prefill_chunk=1024, max_context=8192, vision_cache_entries=64)
        self.model = load_model(spec.model, self.base.torch_dtype, spec.device)
        self._Engine = Engine
        self._scratch = tempfile.TemporaryDirectory(prefix="edgeinfer-bench-kv-") if spec.scratch is None else None
        self.scratch = Path(spec.scratch or self._scratch.name)
        self._dirs = 0

    def engine(self, *, num_blocks: int, tiers: bool, disk: bool = True, prefix_cache: bool = True,
               precision: str = "full", disk_dir: Path | None = None, **extra):
        if disk_dir is None and tiers and disk:
            self._dirs += 1
            disk_dir = self.scratch / f"kv{self._dirs}"
        config = replace(self.base, num_blocks=num_blocks, prefix_cache=prefix_cache, host_precision=precision,
                         host_tier_mb=2048 if tiers else 0, disk_tier_mb=8192 if tiers and disk_dir else 0,
                         disk_dir=str(disk_dir) if disk_dir else None, **extra)
        from edgeinfer.backends.registry import torch_engines

        return self._Engine(self.model, config, torch_engines(self.model, config))

    def sync(self) -> None:
        sync(self.spec.device)

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()


def _warm(engine) -> None:
    """Allocator and kernel warm-up on a picture no measured request uses."""
    engine.generate("hello there", [bench_image(64, seed=9)], _sampling(2))


def _ttft(engine, messages, images, tokens: int) -> tuple[float, Any]:
    result = engine.generate(messages, images, _sampling(tokens))
    return result.timings["ttft_s"], result


def _spreads(runs: dict[str, list[float]]) -> dict[str, Spread]:
    return {name: spread(values) for name, values in runs.items()}


# --- resume -------------------------------------------------------------------------------------
def bench_resume(h: Harness) -> dict:
    spec, log = h.spec, h.log
    image = bench_image(spec.image_size, seed=1)
    blocks = 4 * (spec.history_tokens + 256) // spec.block_size
    ours = h.engine(num_blocks=blocks, tiers=True)
    recompute = h.engine(num_blocks=blocks, tiers=False, prefix_cache=False)
    for engine in (ours, recompute):
        _warm(engine)
    base = fit_text(ours, lambda t: opening(t, "session"), [image], spec.history_tokens, seed=1)
    first = ours.generate(base, [image], _sampling(spec.new_tokens))  # the session, now idle
    recompute.generate(base, [image], _sampling(1))  # its vision output is cached there too
    words = _words(ours.adapter.tokenizer)
    rows: dict[str, list[float]] = {"recompute": [], "host": [], "disk": [], "recompute_with_vision": []}
    checks = []
    for r in range(spec.repeats):
        messages = follow_up(base, first.text, f"{_text(words, 6, 100 + r)} ?")
        with log.run(f"resume recompute #{r}") as rec:
            rec["ttft_s"] = _ttft(recompute, messages, [image], 1)[0]
        rows["recompute"].append(rec["ttft_s"])
        ours.kv_manager.spill_idle("host")
        with log.run(f"resume host #{r}") as rec:
            rec["ttft_s"], res = _ttft(ours, messages, [image], 1)
        rows["host"].append(rec["ttft_s"])
        checks.append(res.cache)
        ours.kv_manager.spill_idle("disk")
        ours.kv_manager.disk.drop_page_cache()
        with log.run(f"resume disk #{r}") as rec:
            rec["ttft_s"], res = _ttft(ours, messages, [image], 1)
        rows["disk"].append(rec["ttft_s"])
        checks.append(res.cache)
        recompute.vision_cache.clear()
        with log.run(f"resume recompute with vision #{r}") as rec:
            rec["ttft_s"], probe = _ttft(recompute, follow_up(base, first.text, f"{_text(words, 6, 200 + r)} ?"),
                                         [image], 1)
        rows["recompute_with_vision"].append(rec["ttft_s"])
    disk_dir = Path(ours.config.disk_dir)
    metrics = ours.kv_metrics()
    ours.close()
    restarted = h.engine(num_blocks=blocks, tiers=True, disk_dir=disk_dir)
    _warm(restarted)
    restarted.kv_manager.disk.drop_page_cache()
    with log.run("resume disk after restart") as rec:
        rec["ttft_s"], restart = _ttft(restarted, follow_up(base, first.text, f"{_text(words, 6, 100)} ?"),
                                       [image], 1)
    rows["disk_after_restart"] = [rec["ttft_s"]]
    restarted.close()
    ttft = _spreads(rows)
    med = {k: v.median for k, v in ttft.items()}
    return {
        "session_tokens": probe.usage["prompt_tokens"], "image_tokens": probe.usage["image_tokens"],
        "ttft_s": ttft,
        "speedups": {"host_vs_recompute": ratio(med["recompute"], med["host"]),
                     "disk_vs_recompute": ratio(med["recompute"], med["disk"]),
                     "host_vs_recompute_with_vision": ratio(med["recompute_with_vision"], med["host"]),
                     "restart_vs_recompute_with_vision": ratio(med["recompute_with_vision"],
                                                               med["disk_after_restart"])},
        "reused": {"host_and_disk": checks, "restart": restart.cache},
        "restore": {"bytes": metrics.restore_bytes, "latency_mean_s": metrics.restore_latency.mean},
        "runs": rows,
    }


# --- sessions, round robin -----------------------------------------------------------------------
def _sessions(h: Harness, engine, images: list, count: int) -> list[list]:
    """One opening turn per session. Each starts with its own words before its image, so no two
    sessions share a block (digits alone may all be one unknown token to a tokenizer)."""
    words = _words(engine.adapter.tokenizer)
    return [fit_text(engine, lambda t, i=i: opening(t, _text(words, 4, 7000 + i)), [images[i % len(images)]],
                     h.spec.session_tokens, seed=i) for i in range(count)]


def _questions(engine, rounds: int, sessions: int) -> list[list[str]]:
    words = _words(engine.adapter.tokenizer)
    return [[f"{_text(words, 5, 1000 * r + i)} ?" for i in range(sessions)] for r in range(rounds)]


def run_round_robin(engine, sessions: list[list], questions: list[list[str]], images: list, new_tokens: int,
                    logits: dict | None = None) -> dict:
    """Every round submits one turn per session (session ``i`` asks about ``images[i % len]``); the
    engine batches and schedules them. The answers it generates become the next round's history."""
    if logits is not None:
        record_logits(engine, logits)
    conversations = [list(s) for s in sessions]
    tokens: list[list[int]] = []
    failed = generated = 0
    started = time.perf_counter()
    for r, round_questions in enumerate(questions):
        turns = [c if r == 0 else c + [{"role": "user", "content": [{"type": "text", "text": q}]}]
                 for c, q in zip(conversations, round_questions)]
        try:
            seqs = [engine.submit(t, [images[i % len(images)]], _sampling(new_tokens)) for i, t in enumerate(turns)]
            results = engine.run_until_done(seqs)
        except EdgeInferError as error:  # a request refused or failed is what this counts
            failed += len(turns)
            print(f"round {r} failed: {error!r}")
            continue
        for i, result in enumerate(results):
            tokens.append(result.token_ids)
            generated += len(result.token_ids)
            failed += result.finish_reason not in ("length", "stop")
            conversations[i] = turns[i] + [{"role": "assistant", "content": [{"type": "text", "text": result.text}]}]
    sync(str(engine.config.device))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens_per_s": generated / wall, "generated": generated, "failed": failed,
            "tokens": tokens, "counters": engine.counters, "metrics": engine.kv_metrics()}


def _final_blocks(engine, sessions, images, rounds: int, new_tokens: int, block_size: int) -> list[int]:
    """Blocks of each session's last turn (its opening, and each round's question and answer)."""
    return [-(-(prompt_len(engine, s, [images[i % len(images)]]) + rounds * (new_tokens + 24)) // block_size)
            for i, s in enumerate(sessions)]


def _kv_summary(m, counters: dict) -> dict:
    return {"preemptions": m.preemptions, "spilled_blocks": m.spilled_blocks, "restored_blocks": m.restored_blocks,
            "persisted_blocks": m.persisted_blocks, "spill_bytes": m.spill_bytes, "restore_bytes": m.restore_bytes,
            "spill_latency_mean_s": m.spill_latency.mean, "restore_latency_mean_s": m.restore_latency.mean,
            "transfer_s": m.transfer_s, "wait_s": m.wait_s, "hidden_ratio": m.hidden_ratio,
            "prefix_hit_ratio": m.prefix_hit_ratio, "recomputes": m.recomputes, "lost_blocks": m.lost_blocks,
            "prefill_tokens": counters.get("prefill_tokens"), "decode_steps": counters.get("decode_steps")}


def bench_round_robin(h: Harness) -> dict:
    """Unconstrained and squeezed runs alternate over the repeats (fresh engines, the same model), so
    a change of the machine's state hits both; medians of tokens/s."""
    spec, log = h.spec, h.log
    images = [bench_image(spec.image_size, seed=2)]
    probe = h.engine(num_blocks=64, tiers=False)
    sessions = _sessions(h, probe, images, spec.sessions)
    questions = _questions(probe, spec.rounds, spec.sessions)
    final = _final_blocks(probe, sessions, images, spec.rounds, spec.new_tokens, spec.block_size)
    working, longest = sum(final), max(final)
    pool = max(int(spec.pool_fraction * working), longest + 2)
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for r in range(spec.repeats):
        order = ("unconstrained", "constrained") if r % 2 == 0 else ("constrained", "unconstrained")
        for name in order:
            engine = h.engine(num_blocks=2 * working if name == "unconstrained" else pool, tiers=True)
            engine.generate("hello there", images, _sampling(2))  # vision of the shared image, warm-up
            with log.run(f"round robin {name} #{r}") as rec:
                done = run_round_robin(engine, sessions, questions, images, spec.new_tokens)
                rec.update(tokens_per_s=done["tokens_per_s"], wall_s=done["wall_s"],
                           spilled_blocks=done["metrics"].spilled_blocks,
                           restored_blocks=done["metrics"].restored_blocks, failed=done["failed"])
            runs[name].append(done)
            engine.close()
    rate = {name: spread(run["tokens_per_s"] for run in done) for name, done in runs.items()}
    last = {name: done[-1] for name, done in runs.items()}
    # A block dropped from the device that already had a copy below (written through) is not
    # "spilled"; what shows that the squeezed pool worked through the tiers is what came back.
    restored = [run["metrics"].restored_blocks for run in runs["constrained"]]
    problems = [f"round robin: squeezed run #{i} restored no block from a lower tier, so it measured no spilling"
                for i, n in enumerate(restored) if n == 0]
    return {
        "working_set_blocks": working, "pool_blocks": pool, "pool_fraction": pool / working,
        "tokens_per_s": rate, "throughput_ratio": ratio(rate["constrained"].median, rate["unconstrained"].median),
        "failed": sum(run["failed"] for done in runs.values() for run in done),
        "same_tokens": all(run["tokens"] == runs["unconstrained"][0]["tokens"] for done in runs.values()
                           for run in done),
        "spilled_blocks_per_run": [run["metrics"].spilled_blocks for run in runs["constrained"]],
        "restored_blocks_per_run": restored,
        "constrained": _kv_summary(last["constrained"]["metrics"], last["constrained"]["counters"]),
        "unconstrained": _kv_summary(last["unconstrained"]["metrics"], last["unconstrained"]["counters"]),
        "runs": {name: [run["tokens_per_s"] for run in done] for name, done in runs.items()},
        "problems": problems,
    }


# --- overhead ------------------------------------------------------------------------------------
def bench_overhead(h: Harness) -> dict:
    """The same sessions and turns without memory pressure, tiers on against off (the prefix cache on
    in both): whole-run tokens/s, the engine closed inside the timed span so background writes count."""
    spec, log = h.spec, h.log
    images = [bench_image(spec.image_size, seed=4)]
    probe = h.engine(num_blocks=64, tiers=False)
    sessions = _sessions(h, probe, images, spec.overhead_sessions)
    questions = _questions(probe, spec.overhead_rounds, spec.overhead_sessions)
    working = sum(_final_blocks(probe, sessions, images, spec.overhead_rounds, spec.new_tokens, spec.block_size))
    rates: dict[str, list[float]] = {"on": [], "off": []}
    activity: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(spec.repeats):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            engine = h.engine(num_blocks=2 * working, tiers=name == "on")
            engine.generate("hello there", images, _sampling(2))  # warm-up, vision of the shared image
            with log.run(f"overhead spill {name} #{r}") as rec:
                h.sync()
                started = time.perf_counter()
                done = run_round_robin(engine, sessions, questions, images, spec.new_tokens)
                engine.close()  # drains the worker: the tiers' background writes are part of the run
                rec["tokens_per_s"] = done["generated"] / (time.perf_counter() - started)
            rates[name].append(rec["tokens_per_s"])
            m = done["metrics"]
            activity[name].append({"spilled_blocks": m.spilled_blocks, "persisted_blocks": m.persisted_blocks,
                                   "preemptions": m.preemptions})
    rate = _spreads(rates)
    return {"workload": {"sessions": spec.overhead_sessions, "rounds": spec.overhead_rounds,
                         "pool_blocks": 2 * working},
            "tokens_per_s": rate, "overhead": 1 - ratio(rate["on"].median, rate["off"].median),
            "activity": activity, "runs": rates}


# --- peer ----------------------------------------------------------------------------------------
def scripted_rounds(sessions: list[list], questions: list[list[str]], answers: list[list[str]]) -> list[list[list]]:
    """Every round's chat per session, the assistant's turns given (both sides run the same prompts)."""
    rounds, conversations = [], [list(s) for s in sessions]
    for r, (round_questions, round_answers) in enumerate(zip(questions, answers)):
        if r:
            conversations = [c + [{"role": "user", "content": [{"type": "text", "text": q}]}]
                             for c, q in zip(conversations, round_questions)]
        rounds.append([list(c) for c in conversations])
        conversations = [c + [{"role": "assistant", "content": [{"type": "text", "text": a}]}]
                         for c, a in zip(conversations, round_answers)]
    return rounds


def script_rates(records: list[dict]) -> list[float]:
    """Tokens/s of each timed pass over the script: its rounds' tokens over their seconds."""
    passes: dict[int, list[dict]] = {}
    for r in records:
        if r.get("timed", True):
            passes.setdefault(r["repeat"], []).append(r)
    return [sum(r["generated"] for r in p) / sum(r["seconds"] for r in p) for _, p in sorted(passes.items())]


def run_script(engine, rounds: list[list[list]], images: list, new_tokens: int, log: RunLog, repeat: int,
               timed: bool = True) -> None:
    """One pass over the script with ours: each round batched, the vision cache cleared before it."""
    for r, chats in enumerate(rounds):
        engine.vision_cache.clear()
        label = f"offloading ours pass {repeat} round {r}" if timed else f"offloading ours warm-up round {r}"
        with log.run(label, timed) as rec:
            sync(str(engine.config.device))
            started = time.perf_counter()
            seqs = [engine.submit(chat, [image], _sampling(new_tokens)) for chat, image in zip(chats, images)]
            results = engine.run_until_done(seqs)
            sync(str(engine.config.device))
            rec.update(repeat=repeat, seconds=time.perf_counter() - started,
                       generated=sum(len(x.token_ids) for x in results), prompt_tokens=sum(s.prompt_len for s in seqs))


def bench_peer(h: Harness) -> dict:
    from edgeinfer.bench.common import call_worker

    spec, log = h.spec, h.log
    if not spec.device.startswith("cuda"):
        return {"skipped": "DynamicCache(offloading=True) needs CUDA"}
    seeds = list(range(100, 100 + spec.sessions))
    images = [bench_image(spec.image_size, seed=s) for s in seeds]
    probe = h.engine(num_blocks=256, tiers=False)
    sessions = _sessions(h, probe, images, spec.sessions)
    questions = _questions(probe, spec.rounds, spec.sessions)
    words = _words(probe.adapter.tokenizer)
    answers = [[_text(words, spec.new_tokens, 5000 + 100 * r + i) for i in range(spec.sessions)]
               for r in range(spec.rounds)]
    rounds = scripted_rounds(sessions, questions, answers)
    final = [-(-(prompt_len(probe, chat, [image]) + spec.new_tokens) // spec.block_size)
             for chat, image in zip(rounds[-1], images)]
    working = sum(final)
    pool = max(int(spec.pool_fraction * working), max(final) + 2)
    engine = h.engine(num_blocks=pool, tiers=True, disk=False, prefix_cache=False, max_batch_size=spec.sessions)
    _reset_peak_memory(spec.device)
    ours_log = RunLog()
    run_script(engine, rounds[:1], images, spec.new_tokens, ours_log, -1, timed=False)
    for repeat in range(spec.repeats):
        run_script(engine, rounds, images, spec.new_tokens, ours_log, repeat)
    metrics, counters, peak = engine.kv_metrics(), engine.counters, peak_memory_mb(spec.device)
    engine.close()
    log.records.extend(ours_log.records)
    payload = {"model": str(spec.model), "device": spec.device, "dtype": spec.dtype, "new_tokens": spec.new_tokens,
               "image_size": spec.image_size, "image_seeds": seeds, "rounds": rounds, "repeats": spec.repeats}
    peer = call_worker("kv-offload-peer", payload)
    log.records.extend(peer["runs"])
    ours_rate, peer_rate = spread(script_rates(ours_log.records)), spread(script_rates(peer["runs"]))
    return {"batching": "both batched: each round's turns of all sessions in one batch",
            "caching": "no reuse across requests on either side; vision encoder run for every request on both",
            "working_set_blocks": working, "pool_blocks": pool,
            "tokens_per_s": {"ours": ours_rate, "peer": peer_rate},
            "ours_vs_peer": ratio(ours_rate.median, peer_rate.median),
            "ours": {**_kv_summary(metrics, counters), "peak_memory_mb": peak},
            "peer": {k: v for k, v in peer.items() if k != "runs"},
            "runs": {"ours": ours_log.records, "peer": peer["runs"]}}


def _reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


# --- drift, demo ---------------------------------------------------------------------------------
def bench_drift(h: Harness) -> dict:
    from edgeinfer.kv.codec import fp8_supported

    spec = h.spec
    images = [bench_image(spec.image_size, seed=3)]
    probe = h.engine(num_blocks=64, tiers=False)
    words = _words(probe.adapter.tokenizer)
    sessions = [fit_text(probe, lambda t, i=i: opening(t, _text(words, 4, 8000 + i)), images, 96, seed=50 + i)
                for i in range(4)]
    questions = _questions(probe, 2, len(sessions))
    longest = max(_final_blocks(probe, sessions, images, 2, spec.new_tokens, spec.block_size))
    ref_logits: dict = {}
    reference = run_round_robin(h.engine(num_blocks=8 * longest, tiers=False), sessions, questions, images,
                                spec.new_tokens, ref_logits)
    out = {}
    for precision in ("full", "int8", "fp8"):
        if precision == "fp8" and not fp8_supported(spec.device):
            out[precision] = {"skipped": "no float8_e4m3fn in this torch"}
            continue
        logits: dict = {}
        engine = h.engine(num_blocks=longest + 2, tiers=True, precision=precision, high_watermark=0.4,
                          low_watermark=0.2)
        run = run_round_robin(engine, sessions, questions, images, spec.new_tokens, logits)
        engine.close()
        drift = max_logit_drift(ref_logits, logits, reference["tokens"], run["tokens"])
        out[precision] = {**asdict(drift), "restored_blocks": run["metrics"].restored_blocks,
                          "preemptions": run["metrics"].preemptions}
    return out


def bench_demo(h: Harness) -> dict:
    """The demo model's accuracy when its prompts come back from a squeezed pool's host tier.

    Each group of eight questions is asked twice: the first round fills the prefix cache,
    and the pool (blocks for about two of the eight prompts) pushes those blocks to the
    host tier; the second round finds them there and restores them, in the tier's
    precision, instead of running the prompt again. Accuracy is the second round's.
    """
    from edgeinfer.demo import DEMO_MODEL_DIR, synthetic
    from edgeinfer.engine import Engine, EngineConfig, SamplingParams

    if not (DEMO_MODEL_DIR / "config.json").is_file():
        return {"skipped": f"no demo model in {DEMO_MODEL_DIR}"}
    samples = synthetic.held_out(1234, h.spec.demo_questions)
    out = {}
    for precision in ("none", "full", "int8", "fp8"):
        squeeze = precision != "none"
        config = EngineConfig(num_blocks=48 if squeeze else 4096, block_size=4, max_batch_size=8,
                              host_tier_mb=64 if squeeze else 0, host_precision="full" if not squeeze else precision,
                              high_watermark=0.4, low_watermark=0.2, threads=h.spec.threads)
        engine = Engine.load(DEMO_MODEL_DIR, config=config)
        correct = reused = 0
        for start in range(0, len(samples), 8):
            batch = samples[start:start + 8]
            for _ in range(2):
                seqs = [engine.submit(s.question, [s.image], SamplingParams(max_new_tokens=8)) for s in batch]
                results = engine.run_until_done(seqs)
            correct += sum(r.text.strip().strip(".!? ").lower() == s.answer for s, r in zip(batch, results))
            reused += sum(r.cache["prefix_tokens_reused"] for r in results)
        out[precision] = {"accuracy": correct / len(samples), "n": len(samples),
                          "restored_blocks": engine.counters["restored_blocks"],
                          "prefix_tokens_reused": reused, "preemptions": engine.counters["preemptions"]}
        engine.close()
    return out


# --- the run ---------------------------------------------------------------------------------------
PART_FUNCTIONS: dict[str, Callable[[Harness], dict]] = {
    "resume": bench_resume, "overhead": bench_overhead, "round_robin": bench_round_robin, "peer": bench_peer,
    "drift": bench_drift, "demo": bench_demo,
}


def run(spec: KVBenchSpec, log: RunLog, say: Callable[[str], None] = print,
        checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Every part in turn; a part that fails is recorded as its error and the run goes on.
    ``checkpoint(report)`` is called after each part (the report so far)."""
    h = Harness(spec, log)
    report: dict[str, Any] = {}
    try:
        for part in spec.parts:
            started = time.perf_counter()
            say(f"[bench kv] {part} ...")
            try:
                report[part] = PART_FUNCTIONS[part](h)
            except Exception as error:  # noqa: BLE001 - one broken part must not lose the others
                report[part] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                say(report[part]["traceback"])
            report[part]["seconds"] = time.perf_counter() - started
            say(f"[bench kv] {part}: {report[part]['seconds']:.0f} s")
            gc.collect()
            if checkpoint is not None:
                checkpoint(report)
    finally:
        h.close()
    return report


def problems(report: dict) -> list[str]:
    """What keeps a run's figures from standing: failed parts, squeezed runs that spilled nothing."""
    out = [f"{name} failed: {part['error']}" for name, part in report.items() if isinstance(part, dict)
           and "error" in part]
    return out + [p for part in report.values() if isinstance(part, dict) for p in part.get("problems", [])]


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _cell(s: Spread) -> str:
    return f"{_fmt(s.median)} ({_fmt(s.min)}–{_fmt(s.max)})" if s.n else "–"


def markdown(report: dict, spec: KVBenchSpec) -> str:
    lines = [f"Medians of every run (min–max); repeats: {spec.repeats}; {spec.device}, {spec.dtype}, "
             f"{spec.threads} threads.", ""]
    lines += [f"**{p}**" for p in problems(report)] + ([""] if problems(report) else [])
    ok = {name: part for name, part in report.items() if isinstance(part, dict) and "error" not in part}
    if "resume" in ok:
        r = ok["resume"]
        t, q = r["ttft_s"], r["speedups"]
        lines += ["## Resume an idle session", "",
                  f"Session: {r['session_tokens']} tokens ({r['image_tokens']} image tokens); time to first token "
                  "of a follow-up question.", "",
                  "| from | TTFT s | vs recompute (vision cached) | vs recompute with vision |", "|---|---|---|---|",
                  f"| host tier | {_cell(t['host'])} | {_fmt(q['host_vs_recompute'])}× | "
                  f"{_fmt(q['host_vs_recompute_with_vision'])}× |",
                  f"| disk tier (page cache dropped) | {_cell(t['disk'])} | {_fmt(q['disk_vs_recompute'])}× | |",
                  f"| disk after a restart (one run) | {_cell(t['disk_after_restart'])} | | "
                  f"{_fmt(q['restart_vs_recompute_with_vision'])}× |",
                  f"| recompute (vision cached) | {_cell(t['recompute'])} | 1× | |",
                  f"| recompute with vision | {_cell(t['recompute_with_vision'])} | | 1× |", ""]
    if "overhead" in ok:
        o = ok["overhead"]
        w = o["workload"]
        lines += ["## Spill machinery without pressure, end to end", "",
                  f"{w['sessions']} sessions × {w['rounds']} rounds, prefix cache on in both, pool "
                  f"{w['pool_blocks']} blocks: tiers on {_cell(o['tokens_per_s']['on'])} tok/s, off "
                  f"{_cell(o['tokens_per_s']['off'])} tok/s: the machinery's cost **{o['overhead']:+.1%}** "
                  "(1 − on/off of the medians; whole run, background writes included).", ""]
    if "round_robin" in ok:
        r = ok["round_robin"]
        c = r["constrained"]
        lines += [f"## {spec.sessions} sessions, round robin", "",
                  f"Device pool {r['pool_blocks']} blocks = {r['pool_fraction']:.0%} of the working set "
                  f"({r['working_set_blocks']} blocks).", "",
                  "| pool | tokens/s |", "|---|---|",
                  f"| unconstrained | {_cell(r['tokens_per_s']['unconstrained'])} |",
                  f"| {r['pool_fraction']:.0%} of the working set | {_cell(r['tokens_per_s']['constrained'])} |", "",
                  f"Throughput ratio {r['throughput_ratio']:.1%}; failed requests {r['failed']}; greedy tokens equal: "
                  f"{r['same_tokens']}; per squeezed run, blocks spilled {r['spilled_blocks_per_run']} and restored "
                  f"{r['restored_blocks_per_run']}. Last squeezed run: {c['preemptions']} preemptions, prefix hit "
                  f"ratio {_fmt(c['prefix_hit_ratio'])}, transfer time {_fmt(c['transfer_s'])} s of which the engine "
                  f"waited {_fmt(c['wait_s'])} s (hidden: {_fmt(c['hidden_ratio'])}).", ""]
    if "peer" in ok:
        p = ok["peer"]
        lines += ["## A small device KV budget: ours against transformers' DynamicCache(offloading=True)", ""]
        if "skipped" in p:
            lines += [f"Skipped: {p['skipped']}.", ""]
        else:
            lines += [f"{p['batching']}; {p['caching']}. Ours: device pool {p['pool_blocks']} of the "
                      f"{p['working_set_blocks']} blocks the batch's last round needs, host tier on: "
                      f"{p['ours']['preemptions']} preemptions, {p['ours']['spilled_blocks']} blocks spilled, "
                      f"{p['ours']['restored_blocks']} restored.",
                      "", "| engine | tokens/s | peak device memory (MB) |", "|---|---|---|",
                      f"| ours | {_cell(p['tokens_per_s']['ours'])} | {_fmt(p['ours']['peak_memory_mb'])} |",
                      f"| transformers, offloading cache | {_cell(p['tokens_per_s']['peer'])} | "
                      f"{_fmt(p['peer']['peak_memory_mb'])} |",
                      f"| **ours / peer** | **{_fmt(p['ours_vs_peer'])}×** | |", ""]
    if "drift" in ok:
        lines += ["## Compressed host tier", "", "| precision | max logit drift | rows compared | tokens equal |",
                  "|---|---|---|---|"]
        for name, d in ok["drift"].items():
            if isinstance(d, dict) and "max_abs" in d:
                lines.append(f"| {name} | {_fmt(d['max_abs'])} | {d['compared']} | "
                             f"{d['same_tokens']}/{d['total_tokens']} |")
        lines.append("")
    if "demo" in ok:
        d = ok["demo"]
        lines += ["## Demo model accuracy, squeezed pool", ""]
        if "skipped" in d:
            lines += [f"Skipped: {d['skipped']}.", ""]
        else:
            lines += ["Each question asked twice; accuracy of the second round, whose prompts come back "
                      "from the host tier (`none`: an unconstrained pool, the prompts reused on the device).", "",
                      "| host tier | accuracy | blocks restored | prompt tokens reused |", "|---|---|---|---|"]
            lines += [f"| {k} | {v['accuracy']:.1%} | {v['restored_blocks']} | {v['prefix_tokens_reused']} |"
                      for k, v in d.items() if isinstance(v, dict)]
            lines.append("")
    return "\n".join(lines)


def bench(spec: KVBenchSpec, out: Path, *, max_load: float = QUIET_LOAD, allow_noisy: bool = False,
          say: Callable[[str], None] = print) -> Path:
    """Run the KV benchmark, write ``kv-<device>.json`` (+ ``.md``) under ``out`` after every part,
    return its path. Raises ``LimitExceeded`` for noisy CPU runs and ``EdgeInferError`` for parts
    that failed or measured nothing, after writing the file marked unpublishable."""
    log = RunLog()
    stem = f"kv-{spec.device.split(':')[0]}"
    head = raw.header("kv", {k: str(v) for k, v in asdict(spec).items()}, environment(spec.device, spec.threads))
    with LoadTracker() as tracker:
        def save(report: dict) -> Path:
            verdict = judge(log.records, tracker.share_at, max_load, enforced=spec.device == "cpu")
            data = raw.with_verdict({**head, **report, "runs": log.records}, verdict, allow_noisy, problems(report))
            return raw.write(out, stem, data, markdown(report, spec)), verdict

        report = run(spec, log, say, checkpoint=lambda r: save(r))
    path, verdict = save(report)
    say(markdown(report, spec))
    raw.refuse_if_problems(problems(report), path)
    refuse_if_noisy(verdict, path, allow_noisy)
    return path
