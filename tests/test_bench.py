"""The benchmarks' own logic: medians of all runs, quiet-run refusal, raw files, the roofline's
arithmetic, the peer's isolation and the `edgeinfer bench` commands. No timing is asserted."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgeinfer.bench import raw
from edgeinfer.bench.common import loaded_runtime_modules
from edgeinfer.bench.gpu import compare, run_figures, summarize
from edgeinfer.bench.kv import script_rates, scripted_rounds
from edgeinfer.bench.quiet import LoadTracker, RunLog, ema_step, judge, refuse_if_noisy
from edgeinfer.bench.roofline import Probe, best_bandwidth_gbs, measure_probes, roofline, roofline_tok_s, step_bytes
from edgeinfer.bench.stats import Spread, ratio, spread
from edgeinfer.cli.main import app
from edgeinfer.errors import LimitExceeded, exit_code_for

# --- medians of all runs --------------------------------------------------------------------------

def test_spread_is_the_median_of_every_run_with_its_range():
    s = spread([10.0, 30.0, 20.0, 100.0, None])
    assert (s.median, s.min, s.max, s.n) == (25.0, 10.0, 100.0, 4)  # not the best run (100)


def test_spread_of_nothing_is_a_visible_hole():
    s = spread([None])
    assert s.n == 0 and math.isnan(s.median)


def test_ratio_is_nan_where_either_side_is_missing():
    assert ratio(4.0, 2.0) == 2.0
    assert math.isnan(ratio(4.0, 0.0)) and math.isnan(ratio(None, 2.0)) and math.isnan(ratio(math.nan, 1.0))


# --- quiet runs -----------------------------------------------------------------------------------

def test_our_share_of_the_load_follows_the_kernels_one_minute_average():
    share = 0.0
    for _ in range(12):  # two busy threads for a minute, in 5 s steps
        share = ema_step(share, cpu_seconds=10.0, seconds=5.0)
    assert share == pytest.approx(2 * (1 - math.exp(-1)), rel=1e-9)
    for _ in range(120):
        share = ema_step(share, cpu_seconds=10.0, seconds=5.0)
    assert share == pytest.approx(2.0, abs=1e-3)
    assert ema_step(1.0, 0.0, 0.0) == 1.0  # no time passed, nothing changes


def _tracker(cpu_per_s: float) -> LoadTracker:
    """A tracker on a fake clock and a fake CPU counter: ``cpu_per_s`` busy threads of ours."""
    now = {"t": 1000.0}
    tracker = LoadTracker(cpu_seconds=lambda: (now["t"] - 1000.0) * cpu_per_s, clock=lambda: now["t"])
    tracker._samples.append((now["t"], 0.0))
    tracker._last_cpu = 0.0
    for _ in range(30):
        now["t"] += 2.0
        tracker.sample()
    return tracker


def test_tracker_interpolates_our_share_between_samples():
    tracker = _tracker(cpu_per_s=2.0)
    first, last = tracker._samples[0], tracker._samples[-1]
    assert tracker.share_at(first[0] - 5) == first[1] and tracker.share_at(last[0] + 5) == last[1]
    a, b = tracker._samples[10], tracker._samples[11]
    assert tracker.share_at((a[0] + b[0]) / 2) == pytest.approx((a[1] + b[1]) / 2)
    assert last[1] == pytest.approx(2 * (1 - math.exp(-1)), rel=1e-6)  # 60 s of two busy threads


def _record(label: str, before: float, after: float, timed: bool = True) -> dict:
    return {"label": label, "timed": timed,
            "load": {"started": 10.0, "ended": 20.0, "before": [before, 0, 0], "after": [after, 0, 0]}}


def test_a_run_is_noisy_when_other_processes_load_goes_over_the_limit():
    own = {10.0: 0.5, 20.0: 1.9}.get  # our own threads made the load rise during the run
    records = [_record("ours alone", 0.6, 2.0), _record("others before", 2.6, 2.0),
               _record("others after", 0.6, 3.6), _record("warm-up", 9.0, 9.0, timed=False)]
    verdict = judge(records, own, max_load=1.5)
    assert [r.quiet for r in verdict.runs] == [True, False, False]  # the warm-up does not count
    assert verdict.runs[2].others == pytest.approx(1.7)
    assert not verdict.publishable and [r.label for r in verdict.noisy] == ["others before", "others after"]
    assert judge(records[:1], own, max_load=1.5).publishable


def test_noisy_cpu_figures_are_refused_unless_allowed(tmp_path):
    own = {10.0: 0.0, 20.0: 0.0}.get
    noisy = judge([_record("a", 5.0, 6.0)], own, max_load=1.5)
    with pytest.raises(LimitExceeded) as caught:
        refuse_if_noisy(noisy, tmp_path / "x.json", allow_noisy=False)
    assert exit_code_for(caught.value) == 2
    assert caught.value.limit == 1.5 and caught.value.measured == 6.0 and "--allow-noisy" in str(caught.value)
    refuse_if_noisy(noisy, tmp_path / "x.json", allow_noisy=True)
    gpu = judge([_record("a", 5.0, 6.0)], own, max_load=1.5, enforced=False)
    assert gpu.publishable  # a GPU's figures record the load but are not refused for it
    refuse_if_noisy(gpu, tmp_path / "x.json", allow_noisy=False)
    with pytest.raises(LimitExceeded):
        refuse_if_noisy(judge([], own), tmp_path / "x.json", allow_noisy=False)  # no runs: nothing to publish


def test_run_log_records_the_load_average_around_each_run():
    log = RunLog()
    with log.run("one") as rec:
        rec["x"] = 1
    with log.run("warm", timed=False):
        pass
    first = log.records[0]
    assert first["x"] == 1 and first["timed"] and not log.records[1]["timed"]
    assert len(first["load"]["before"]) == 3 and len(first["load"]["after"]) == 3
    assert first["load"]["ended"] >= first["load"]["started"]


# --- raw files ------------------------------------------------------------------------------------

def test_raw_file_says_what_ran_and_whether_it_may_be_published(tmp_path):
    own = {10.0: 0.0, 20.0: 0.0}.get
    verdict = judge([_record("a", 5.0, 6.0)], own, max_load=1.5)
    head = raw.header("test", {"model": Path("/m"), "sizes": (1, 2)}, {"device": "cpu"}, argv=["edgeinfer", "x"])
    data = raw.with_verdict({**head, "summary": {"rate": Spread(math.nan, 1.0, 2.0, 2)}}, verdict, allow_noisy=True)
    path = raw.write(tmp_path / "out", "test", data, "| a |\n")
    saved = json.loads(path.read_text())
    assert saved["publishable"] is False and saved["allow_noisy"] is True
    assert saved["quiet"]["noisy_runs"] == ["a"] and saved["quiet"]["max_load"] == 1.5
    assert saved["command"] == "edgeinfer x" and saved["schema"] == raw.SCHEMA and "commit" in saved["git"]
    assert saved["spec"] == {"model": "/m", "sizes": [1, 2]}
    assert saved["summary"]["rate"] == {"median": None, "min": 1.0, "max": 2.0, "n": 2}  # NaN is null in JSON
    summary = path.with_suffix(".md").read_text()
    assert "Not publishable" in summary and "test.json" in summary
    # written again (as a run does after each engine): replaced whole, nothing left beside it
    raw.write(tmp_path / "out", "test", {**data, "publishable": True}, "| b |\n")
    assert json.loads(path.read_text())["publishable"] is True
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.json", "test.md"]


def test_a_comparison_with_a_failed_engine_or_different_prompts_does_not_stand(tmp_path):
    from edgeinfer.errors import EdgeInferError

    assert raw.comparison_problems({}, True) == []
    problems = raw.comparison_problems({"transformers": "boom"}, False)
    assert problems[0] == "transformers failed" and "like for like" in problems[1]
    quiet = judge([_record("a", 0.0, 0.0)], {10.0: 0.0, 20.0: 0.0}.get)
    assert raw.with_verdict({}, quiet, False)["publishable"] is True
    assert raw.with_verdict({}, quiet, False, problems)["publishable"] is False
    raw.refuse_if_problems([], tmp_path)
    with pytest.raises(EdgeInferError, match="like for like"):
        raw.refuse_if_problems(problems, tmp_path)


# --- the GPU benchmark's spans and ratios --------------------------------------------------------------

def test_decode_is_the_time_between_one_token_and_all_of_them():
    figures = run_figures({"batch": 4, "full_s": 2.0, "first_s": 0.5, "full_first_s": 0.4, "full_first_tokens": 4},
                          new_tokens=64)
    assert figures["decode_tok_s"] == pytest.approx(4 * 63 / 1.5)
    assert figures["decode_in_call_tok_s"] == pytest.approx(4 * 63 / 1.6)  # the full call after its own first
    assert figures["request_tok_s"] == pytest.approx(4 * 64 / 2.0)
    assert figures["first_token_s"] == 0.5
    assert run_figures({"batch": 1, "full_s": 0.5, "first_s": 0.6}, 64)["decode_tok_s"] is None
    assert run_figures({"batch": 1, "full_s": 0.5, "first_s": 0.1}, 64)["decode_in_call_tok_s"] is None  # older files


def test_decode_in_the_call_counts_only_the_tokens_made_after_the_last_first_token():
    """Four rows prefilled one after another, the first ones decoding in between, had made 10 tokens
    (4 + 3 + 2 + 1) when the last one's first token came: the span after it made 256 - 10 tokens, not
    4 x 63. A record of one row needs no count (its first token is its only one); a record of several
    rows without the count (files from before it was kept) has no figure in the call."""
    record = {"batch": 4, "full_s": 2.0, "first_s": 0.5, "full_first_s": 0.4, "full_first_tokens": 10}
    assert run_figures(record, 64)["decode_in_call_tok_s"] == pytest.approx((4 * 64 - 10) / 1.6)
    assert run_figures({"batch": 1, "full_s": 1.0, "first_s": 0.2, "full_first_s": 0.1}, 64)["decode_in_call_tok_s"] \
        == pytest.approx(63 / 0.9)
    del record["full_first_tokens"]
    assert run_figures(record, 64)["decode_in_call_tok_s"] is None


def test_decode_in_the_call_does_not_move_with_the_one_token_call():
    """Three pairs whose full calls are alike but whose one-token calls ran 40, 70 and 40 ms: decode
    only swings with them, decode in the call does not."""
    runs = [{"batch": 1, "full_s": 0.102, "first_s": t1, "full_first_s": 0.039, "timed": True}
            for t1 in (0.040, 0.070, 0.040)]
    figures = summarize(runs, 64)[1]
    assert figures["decode_tok_s"].max / figures["decode_tok_s"].min > 1.8
    assert figures["decode_in_call_tok_s"].min == figures["decode_in_call_tok_s"].max == pytest.approx(63 / 0.063)


def test_the_peers_clock_stamps_generated_tokens_not_the_prompt():
    """generate() hands the streamer the prompt first: the first stamp is the first generated token's."""
    from edgeinfer.bench.common import TokenClock

    clock = TokenClock()
    clock.put([[1, 2, 3]])  # the prompt
    assert clock.times == []
    clock.put([7])
    clock.put([8])
    assert len(clock.times) == 2 and clock.times[0] <= clock.times[1]


def _runs(batch: int, pairs: list[tuple[float, float]], warm: tuple[float, float] = (99.0, 0.1)) -> list[dict]:
    records = [{"batch": batch, "full_s": warm[0], "first_s": warm[1], "timed": False}]
    return records + [{"batch": batch, "full_s": f, "first_s": s, "timed": True} for f, s in pairs]


def test_ratios_are_against_the_fastest_peer_at_each_batch_size_and_span():
    summaries = {
        "ours": summarize(_runs(1, [(1.0, 0.1), (1.2, 0.1), (1.1, 0.1)]) + _runs(4, [(2.0, 0.2)]), 8),
        "transformers-static": summarize(_runs(1, [(2.0, 0.4)]) + _runs(4, [(8.0, 0.4)]), 8),
        "transformers-dynamic": summarize(_runs(1, [(3.0, 0.2)]) + _runs(4, [(4.0, 0.3)]), 8),
    }
    assert summaries["ours"][1]["request_tok_s"].n == 3  # the warm-up is not a run
    out = compare(summaries)
    assert out[1]["decode_tok_s"]["fastest_peer"] == "transformers-static"  # 7/1.6 beats 7/2.8
    assert out[1]["decode_tok_s"]["speedup"] == pytest.approx((7 / 1.0) / (7 / 1.6))
    assert out[4]["request_tok_s"]["fastest_peer"] == "transformers-dynamic"
    assert out[1]["first_token_s"]["fastest_peer"] == "transformers-dynamic"  # the peer's quickest first token
    assert out[1]["first_token_s"]["speedup"] == pytest.approx(0.2 / 0.1)  # > 1: ours is faster


# --- roofline ---------------------------------------------------------------------------------------

def test_roofline_arithmetic():
    assert step_bytes(1000, 10, context=50, batch=4) == 1000 + 4 * 50 * 10
    assert roofline_tok_s(1.0, 2 * 10**9, 0, context=0, batch=1) == pytest.approx(0.5)
    assert roofline_tok_s(2.0, 10**9, 0, context=0, batch=4) == pytest.approx(8.0)
    out = roofline({1: 0.25}, 1.0, 2 * 10**9, 0, context=0)
    assert out[1] == {"roofline_tok_s": pytest.approx(0.5), "fraction": pytest.approx(0.5)}


def test_bandwidth_is_the_best_of_three_recorded_probes():
    probes = [Probe("copy", 2 * 10**9, 1.0), Probe("sum", 10**9, 0.25), Probe("gemv", 10**9, 0.5)]
    assert best_bandwidth_gbs(probes) == pytest.approx(4.0)
    measured = measure_probes("cpu", mib=4, dtype="float32")
    assert [p.name for p in measured] == ["copy", "sum", "gemv"]
    assert all(p.gbs > 0 and p.bytes > 0 for p in measured)
    assert measured[0].bytes == 2 * 4 * 2**20  # a copy reads and writes


# --- KV: the scripted conversation both sides run -----------------------------------------------------

def test_scripted_rounds_give_every_session_its_history():
    sessions = [[{"role": "user", "content": [{"type": "text", "text": f"s{i}"}]}] for i in range(2)]
    rounds = scripted_rounds(sessions, [["q0a", "q0b"], ["q1a", "q1b"]], [["a0a", "a0b"], ["a1a", "a1b"]])
    assert rounds[0] == sessions
    assert [m["role"] for m in rounds[1][0]] == ["user", "assistant", "user"]
    assert rounds[1][1][1]["content"][0]["text"] == "a0b" and rounds[1][1][2]["content"][0]["text"] == "q1b"


def test_script_rates_are_per_pass_over_all_rounds():
    records = [{"repeat": -1, "timed": False, "generated": 1, "seconds": 100.0},
               {"repeat": 0, "generated": 10, "seconds": 1.0}, {"repeat": 0, "generated": 10, "seconds": 3.0},
               {"repeat": 1, "generated": 20, "seconds": 2.0}]
    assert script_rates(records) == [5.0, 10.0]


# --- the peer holds nothing of ours -------------------------------------------------------------------

def test_the_peers_worker_names_any_module_of_our_runtime():
    modules = {"edgeinfer": 1, "edgeinfer.bench.peer": 1, "edgeinfer.engine.engine": 1, "edgeinfer.kv": 1,
               "transformers": 1}
    assert loaded_runtime_modules(modules) == ["edgeinfer.engine.engine", "edgeinfer.kv"]


def test_the_peers_module_imports_nothing_of_our_runtime():
    import subprocess

    code = ("import sys, edgeinfer.bench.peer, edgeinfer.bench._worker; "
            "from edgeinfer.bench.common import require_nothing_of_ours; require_nothing_of_ours()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# --- the commands ---------------------------------------------------------------------------------------

def test_bench_commands_have_help_and_no_visible_worker():
    runner = CliRunner()
    top = runner.invoke(app, ["bench", "--help"])
    assert top.exit_code == 0
    for command in ("generate", "onnxruntime", "gpu", "kv"):
        assert command in top.output
        result = runner.invoke(app, ["bench", command, "--help"])
        assert result.exit_code == 0, result.output
        assert "--out" in result.output and "--worker" not in result.output


def test_an_unknown_engine_kind_is_a_usage_error(checkpoint):
    result = CliRunner().invoke(app, ["bench", "gpu", "--model", str(checkpoint("smolvlm")), "--kinds", "ours,nope"])
    assert result.exit_code == 2 and "nope" in result.output


@pytest.mark.slow
def test_the_gpu_benchmark_keeps_each_engines_own_first_tokens(checkpoint, tmp_path):
    """`bench gpu` on the CPU (its code paths only) with ours and transformers, each in its worker:
    every full call records when its first tokens reached the host, after the call started and
    before it ended, and how many tokens its rows had made by then: at three rows transformers'
    batched generate() hands the three first tokens at once, while ours prefills the rows one after
    another and decodes the first ones in between. The report has decode in the call for both."""
    result = CliRunner().invoke(app, ["bench", "gpu", "--model", str(checkpoint("qwen2_vl")), "--device", "cpu",
                                      "--dtype", "float32", "--kinds", "ours,transformers-dynamic",
                                      "--batch-sizes", "1,3", "--new-tokens", "3", "--repeats", "1", "--warmup", "0",
                                      "--image-size", "64x64", "--allow-noisy", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(next(tmp_path.glob("gpu-*.json")).read_text())
    assert not data["errors"] and data["same_prompt"] is True
    made = {}
    for kind in ("ours", "transformers-dynamic"):
        for batch in (1, 3):
            (run,) = [r for r in data["runs"][kind] if r["timed"] and r["batch"] == batch]
            assert 0 < run["full_first_s"] < run["full_s"]
            assert data["summary"][kind][str(batch)]["decode_in_call_tok_s"]["n"] == 1
            made[kind, batch] = run["full_first_tokens"]
    assert made["ours", 1] == made["transformers-dynamic", 1] == 1 and made["transformers-dynamic", 3] == 3
    assert 3 < made["ours", 3] <= 3 * 3
    parts = [r["parts"] for r in data["runs"]["ours"] if r["batch"] == 1]  # ours also says where its first tokens went
    assert len(parts) == 1 and parts[0]["full"]["first_token_s"] == data["runs"]["ours"][0]["full_first_s"]
    assert all(0 < p["submit_s"] < p["first_token_s"] and p["prefill_s"] > 0 for p in parts[0].values())
    # and what each call compiled, captured and tuned: on the CPU, nothing.
    assert [set(p["during"].values()) for p in parts[0].values()] == [{0}, {0}]
    assert set(parts[0]["full"]["during"]) >= {"compiled_graphs", "decoder_captures", "packed_tiles_chosen"}
    assert "decode in the call (tok/s) b=1" in next(tmp_path.glob("gpu-*.md")).read_text()


@pytest.mark.slow
def test_generate_runs_both_engines_alone_and_refuses_noisy_figures(checkpoint, tmp_path):
    """The whole command on a tiny checkpoint: two workers, the same prompt, the raw file written
    and marked unpublishable when the runs are over the load limit (here: any load)."""
    result = CliRunner().invoke(app, ["bench", "generate", "--model", str(checkpoint("smolvlm")), "--out",
                                      str(tmp_path), "--image-size", "64", "--new-tokens", "3", "--repeats", "2",
                                      "--warmup", "0", "--max-load", "-1"])
    assert result.exit_code == 2, result.output
    assert "load average" in result.output and "--allow-noisy" in result.output
    data = json.loads(next(tmp_path.glob("cpu-generate-*.json")).read_text())
    assert data["publishable"] is False and data["same_prompt"] is True and not data["errors"]
    assert set(data["runs"]) == {"transformers", "ours"}
    for runs in data["runs"].values():
        assert [r["tokens"] for r in runs] == [3, 3] and all("before" in r["load"] for r in runs)
    assert data["summary"]["ours"]["decode_tok_s"]["n"] == 2
    assert {"decode", "request", "ttft", "peak_rss"} <= set(data["ratios"]["ours"])


def test_a_generate_run_keeps_what_finished_kinds_measured(checkpoint, tmp_path):
    """The raw file is on disk after the first kind, marked incomplete, and complete at the end."""
    from edgeinfer.bench.generate import GenerateSpec, bench

    spec = GenerateSpec(checkpoint("smolvlm"), image_size=64, new_tokens=2, repeats=1, warmup=0)
    partial = []

    def log(line: str) -> None:
        if line == "[bench generate] ours ...":
            partial.append(json.loads(next(tmp_path.glob("cpu-generate-*.json")).read_text()))

    path = bench(spec, tmp_path, allow_noisy=True, log=log)
    assert len(partial) == 1 and list(partial[0]["runs"]) == ["transformers"]
    assert partial[0]["problems"] == ["incomplete: ours not run yet"] and not partial[0]["publishable"]
    data = json.loads(path.read_text())
    assert set(data["runs"]) == {"transformers", "ours"} and not data["problems"]


def test_the_raw_file_names_the_cpu_and_the_instructions_its_kernels_depend_on(tmp_path):
    """An int8 product runs other code with VNNI or AMX than without: the raw file records the CPU's
    model and those features, read from the first processor of /proc/cpuinfo."""
    from edgeinfer.bench.common import cpu_identity

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu avx2 avx512f avx512_vnni sse4_2\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: amx_int8\n")
    assert cpu_identity(info) == {"cpu": "Some CPU 9000", "cpu_features": ["avx2", "avx512f", "avx512_vnni"]}
    missing = cpu_identity(tmp_path / "none")
    assert missing["cpu_features"] is None and missing["cpu"]


def test_the_raw_file_records_the_switches_a_run_had(monkeypatch):
    """Two runs of one tree differ by their ``EDGEINFER_*`` switches (a kernel behind one, the tile
    cache): the raw file's environment names those set, and no other variable."""
    from edgeinfer.bench.common import environment, switches

    assert switches({"EDGEINFER_STAGED_PRODUCTS": "1", "HOME": "/root", "EDGEINFER_TILE_CACHE": "off"}) == \
        {"EDGEINFER_STAGED_PRODUCTS": "1", "EDGEINFER_TILE_CACHE": "off"}
    monkeypatch.setenv("EDGEINFER_STAGED_PRODUCTS", "1")
    assert environment("cpu")["switches"]["EDGEINFER_STAGED_PRODUCTS"] == "1"
    monkeypatch.delenv("EDGEINFER_STAGED_PRODUCTS")
    assert "EDGEINFER_STAGED_PRODUCTS" not in environment("cpu")["switches"]


def test_int4_options_reach_the_int4_builds_only_and_the_build_command_takes_them():
    """``bench onnxruntime --int4-block-size/--int4-symmetric`` builds the int4 kinds that way (the
    int8 ones as before), records it in the spec and says it above the table; the flags are ones
    ``edgeinfer build`` itself parses to those values."""
    from typer.main import get_command

    from edgeinfer.bench.generate import GenerateSpec, _int4_note

    spec = GenerateSpec(Path("m"), kinds=("transformers", "onnxruntime-int8", "onnxruntime-int4",
                                          "onnxruntime-int4-vision-int8"), int4_block_size=128, int4_symmetric=True)
    assert spec.build_flags("onnxruntime-int8") == ()
    assert spec.build_flags("onnxruntime-int4") == ("--int4-block-size", "128", "--int4-symmetric")
    assert spec.build_flags("onnxruntime-int4-vision-int8") == (
        "--vision-precision", "int8", "--int4-block-size", "128", "--int4-symmetric")
    assert GenerateSpec.from_json(spec.to_json()) == spec
    assert _int4_note(spec.to_json()) == " int4 kinds built with blocks of 128, symmetric."
    assert GenerateSpec(Path("m")).build_flags("onnxruntime-int4") == () and _int4_note(GenerateSpec(Path("m")).to_json()) == ""
    build = get_command(app).commands["build"]
    params = build.make_context("build", ["--precision", "int4", *spec.build_flags("onnxruntime-int4-vision-int8")]).params
    assert (params["int4_block_size"], params["int4_symmetric"], params["vision_precision"].value) == (128, True, "int8")
    asym = GenerateSpec(Path("m"), int4_symmetric=False).build_flags("onnxruntime-int4")
    assert build.make_context("build", list(asym)).params["int4_symmetric"] is False


@pytest.mark.slow
def test_gpu_benchmark_code_paths_on_a_cpu(checkpoint, tmp_path):
    """The GPU benchmark's workers on a CPU (no timing meaning): pairs of calls at two batch sizes,
    the same prompt ids on both sides, three bandwidth probes recorded; the raw file is written
    after each engine too, marked incomplete, so a run cut short keeps what it measured."""
    from edgeinfer.bench.gpu import GpuBenchSpec, bench, raw_stem

    spec = GpuBenchSpec(checkpoint("qwen2_vl"), image_size=(56, 56), batch_sizes=(1, 2), new_tokens=2, repeats=1,
                        warmup=0, dtype="float32", device="cpu", kinds=("ours", "transformers-dynamic"),
                        bandwidth_mib=4)
    partial = []  # what the raw file said when the second engine started: only the first had run

    def log(line: str) -> None:
        if line.endswith(": transformers-dynamic ..."):
            partial.append(json.loads((tmp_path / f"{raw_stem(spec)}.json").read_text()))

    path = bench(spec, tmp_path, allow_noisy=True, log=log)
    assert len(partial) == 1 and not partial[0]["publishable"]
    assert partial[0]["problems"] == ["incomplete: transformers-dynamic not run yet"]
    assert list(partial[0]["runs"]) == ["ours"] and partial[0]["bandwidth"]["probes"]
    data = json.loads(path.read_text())
    assert data["same_prompt"] and not data["errors"] and not data["problems"]
    assert [p["name"] for p in data["bandwidth"]["probes"]] == ["copy", "sum", "gemv"]
    assert {r["batch"] for r in data["runs"]["transformers-dynamic"]} == {1, 2}
    assert set(data["speedups"]["2"]) >= {"request_tok_s", "first_token_s"}


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plot_module():
    return _script("plot_bench")


def _gpu_raw(folder: Path, calls: list[tuple], engine: str = "ours") -> Path:
    """A `bench gpu` raw file of 64-token calls at batch 1: (T_n, T_1) per timed run, or (T_n, T_1,
    T_n's own first tokens), one untimed first."""
    runs = [{"timed": False, "batch": 1, "full_s": 9.0, "first_s": 1.0}]
    runs += [{"timed": True, "batch": 1, "full_s": c[0], "first_s": c[1],
              **({"full_first_s": c[2]} if len(c) > 2 else {})} for c in calls]
    report = {"benchmark": "gpu", "spec": {"new_tokens": 64}, "runs": {engine: runs},
              "results": {engine: {"diagnostics": {"kernels": {"step": {"alone_us": 1000.0, "in_step_us": 990.0}}}}}}
    folder.mkdir(parents=True)
    (folder / "gpu-x.json").write_text(json.dumps(report))
    return folder / "gpu-x.json"


def test_compare_pools_every_run_of_a_tree_and_sets_each_tree_against_the_first(tmp_path):
    """Two rounds of the tree before (``old-1``, ``old-2``) and one of the tree after: the pooled
    decode is the median of all the tree's timed runs (not a median of medians, not the best), and
    the ratio is over the first tree given."""
    compare = _script("compare_bench_runs")
    old = [_gpu_raw(tmp_path / "old-1", [(0.110, 0.047), (0.120, 0.057)]),  # 1000 and 1000 tok/s
           _gpu_raw(tmp_path / "old-2", [(0.0925, 0.047)])]  # 1384.6 tok/s
    new = [_gpu_raw(tmp_path / "new-1", [(0.089, 0.047), (0.089, 0.047), (0.110, 0.047)])]  # 1500, 1500, 1000
    table = compare.compare(old + new)
    assert "| old | ours | 1 | all 3 timed runs | **1,000.0 (1,000.0–1,384.6)**" in table
    assert "| new | ours | 1 | all 3 timed runs | **1,500.0 (1,000.0–1,500.0)**" in table
    assert "| ours | 1 | new | 1.500× | – |" in table  # files without their calls' own first tokens
    assert table.count("| 1,000.0 → 990.0 |") == 3  # each run's step, as its engine timed it


def test_compare_pools_decode_in_the_call_too(tmp_path):
    compare = _script("compare_bench_runs")
    old = [_gpu_raw(tmp_path / "old-1", [(0.110, 0.047, 0.047), (0.110, 0.080, 0.047)])]  # in the call: 1000, 1000
    new = [_gpu_raw(tmp_path / "new-1", [(0.089, 0.047, 0.047)])]  # 1500
    table = compare.compare(old + new)
    # decode only: 1000 and 2100 tok/s (the second one-token call ran long); in the call: 1000 and 1000
    assert "| old | ours | 1 | all 2 timed runs | **1,550.0 (1,000.0–2,100.0)** | **1,000.0 (1,000.0–1,000.0)** |" \
        in table
    assert "| ours | 1 | new | 0.968× | 1.500× |" in table


def test_plot_reads_medians_and_ranges_from_a_gpu_raw_file():
    plot = _plot_module()
    report = {"summary": {"ours": {"4": {"decode_tok_s": {"median": 10.0, "min": 8.0, "max": 13.0, "n": 3}},
                                   "1": {"decode_tok_s": {"median": 5.0, "min": 5.0, "max": 6.0, "n": 3}},
                                   "16": {"decode_tok_s": {"median": None, "min": None, "max": None, "n": 0}}}}}
    assert plot.series(report, "ours", "decode_tok_s") == ([1, 4], [5.0, 10.0], [[0.0, 2.0], [1.0, 3.0]])


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    plot = _plot_module()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the optional extra is not installed
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[plot\]'"):
        plot.main([str(tmp_path / "gpu-x.json"), "--out", str(tmp_path / "x.png")])


def test_a_worker_runs_this_package_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    """Started from a directory that holds another ``edgeinfer`` (a source tree of another version),
    the worker still imports this one: the decoy's import fails loudly, this package's worker
    fails on the empty spec."""
    from edgeinfer.bench.common import call_worker

    (tmp_path / "edgeinfer").mkdir()
    (tmp_path / "edgeinfer" / "__init__.py").write_text("raise ImportError('the decoy package was imported')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError) as failed:
        call_worker("gpu-bandwidth", {})
    assert "decoy" not in str(failed.value)
    assert "KeyError: 'model'" in str(failed.value)


def test_a_worker_past_its_time_limit_is_stopped_with_the_limit_named():
    """A fresh interpreter cannot start, let alone measure, in 10 ms: the limit stops it and says so."""
    from edgeinfer.bench.common import call_worker

    with pytest.raises(RuntimeError, match="did not finish within 0.01 s"):
        call_worker("gpu-bandwidth", {}, timeout_s=0.01)


def test_the_profiles_timeline_counts_busy_time_gaps_and_each_kernel_a_step():
    """Two steps' kernels: A 0-10 µs, B 12-20, A again 20-25 (touching B), C 30-31 inside a longer
    D 28-35. Busy time is the span less the gaps (35 - 2 - 0 - 3 = 30 µs, 15 a step); A ran 15 µs
    in two launches, one a step, the most of any kernel."""
    timeline = _script("profile_gpu").timeline
    spans = [(20.0, 25.0, "A"), (0.0, 10.0, "A"), (12.0, 20.0, "B"), (30.0, 31.0, "C"), (28.0, 35.0, "D")]
    got = timeline(spans, wall_us=40.0, steps=2, top=3)
    assert got["busy_us_a_token"] == pytest.approx(15.0) and got["span_us_a_token"] == pytest.approx(17.5)
    assert got["gaps"] == 3 and got["gap_us_a_token"] == pytest.approx(2.5) and got["wall_us_a_token"] == 20.0
    assert got["longest"][0] == {"us": 3.0, "after": "A", "before": "D"}
    assert [k["name"] for k in got["by_kernel"]] == ["A", "B", "D"]
    assert got["by_kernel"][0] == {"name": "A", "count_a_token": 1.0, "us_a_token": 7.5}
