"""``edgeinfer bench gpu --weights``: the weight formats it parses, the quantized checkpoints it
keeps, the bytes a decode step reads as stored, each format's roofline and the Jetson
projection. Tiny checkpoints on the CPU; the CUDA run skips here. No timing is asserted."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from edgeinfer.bench.gpu import (
    GpuBenchSpec,
    GpuReport,
    markdown,
    prepare_weights,
    raw_stem,
    to_raw,
)
from edgeinfer.bench.jetson import BOARDS, projected_tok_s, projection
from edgeinfer.bench.quiet import LoadTracker
from edgeinfer.bench.roofline import Probe
from edgeinfer.bench.weights import (
    QuantizedCheckpointSpec,
    parse_weights,
    quantized_checkpoint,
)
from edgeinfer.cli.main import app
from edgeinfer.quant.footprint import decode_weight_bytes

GROUP = 32  # the tiny checkpoints' widths are 64 and 128


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    """(source, cache, w4a16 folder): the tiny Qwen2-VL checkpoint quantized once through the cache."""
    cache = tmp_path_factory.mktemp("bench-cache")
    source = Path(shutil.copytree(checkpoint("qwen2_vl"), cache / "qwen2_vl"))
    return source, cache, quantized_checkpoint(QuantizedCheckpointSpec(source, 4, GROUP), cache)


# --- the formats and the engines they give ------------------------------------------------------------

def test_weight_formats_parse_in_order_once_and_match_the_dtype():
    assert parse_weights("bf16, W8A16,w4a16,w4a16", "bfloat16") == ("bf16", "w8a16", "w4a16")
    assert parse_weights("fp32,w4a16", "float32") == ("fp32", "w4a16")
    with pytest.raises(ValueError, match=r"unknown weight formats \['int3'\]; choose from .*w4a16"):
        parse_weights("bf16,int3", "bfloat16")
    with pytest.raises(ValueError, match="fp16 with --dtype bfloat16: the checkpoint runs as bf16"):
        parse_weights("fp16,w4a16", "bfloat16")
    with pytest.raises(ValueError, match="no weight format"):
        parse_weights(" , ", "bfloat16")


@pytest.mark.parametrize(("fmt", "bits", "head"), [("w8a16", 8, None), ("w8a16-h8", 8, 8), ("w4a16", 4, None),
                                                    ("w4a16-h8", 4, 8), ("w4a16-h4", 4, 4)])
def test_each_quantized_format_names_its_bits_and_head(fmt, bits, head):
    spec = QuantizedCheckpointSpec.of(fmt, Path("ckpt"), 128)
    assert (spec.bits, spec.lm_head_bits, spec.format) == (bits, head, fmt)


def test_ours_runs_every_format_and_the_peers_the_checkpoint_as_it_is():
    spec = GpuBenchSpec(Path("/m/qwen2-vl-2b"), kinds=("ours", "transformers-static"),
                        weights=("bf16", "w8a16", "w4a16"))
    assert spec.engines() == [("ours", "ours", "bf16", "greedy"), ("ours-w8a16", "ours", "w8a16", "greedy"),
                              ("ours-w4a16", "ours", "w4a16", "greedy"),
                              ("transformers-static", "transformers-static", "bf16", "greedy")]
    assert raw_stem(spec) == "gpu-qwen2-vl-2b-bf16-w8a16-w4a16"
    assert GpuBenchSpec.from_json(spec.to_json()) == spec
    # An existing run (and a raw file's spec from before the formats) keeps its engines and file name.
    old = GpuBenchSpec(Path("/m/qwen2-vl-2b"))
    assert old.formats == ("bf16",) and [e[0] for e in old.engines()] == ["ours", "transformers-static",
                                                                           "transformers-dynamic"]
    assert raw_stem(old) == "gpu-qwen2-vl-2b"
    legacy = {k: v for k, v in old.to_json().items() if k not in ("weights", "group_size")}
    assert GpuBenchSpec.from_json(legacy) == old
    assert GpuBenchSpec(Path("/m/x"), dtype="float32").formats == ("fp32",)


def test_each_engine_runs_once_per_sampling_mode_beside_greedy():
    spec = GpuBenchSpec(Path("/m/qwen2-vl-2b"), kinds=("ours", "transformers-static"), sampling=("greedy", "sampled"))
    assert [(label, mode) for label, _, _, mode in spec.engines()] == [
        ("ours", "greedy"), ("ours-sampled", "sampled"), ("transformers-static", "greedy"),
        ("transformers-static-sampled", "sampled")]
    assert raw_stem(spec) == "gpu-qwen2-vl-2b-greedy-sampled"
    assert GpuBenchSpec.from_json(spec.to_json()) == spec
    assert not spec.sampled and replace(spec, sampling=("sampled",)).sampled
    with pytest.raises(ValueError, match="sampling must name"):
        GpuBenchSpec(Path("/m/x"), sampling=("top-p",))


def test_the_first_batch_size_warms_up_for_warmup_s_and_the_others_by_count():
    from edgeinfer.bench.gpu import measure
    from edgeinfer.bench.quiet import RunLog

    now = [0.0]

    def call(batch, new_tokens, images):  # each call takes one second of the clock below
        assert len(images) == batch
        now[0] += 1.0
        return 1.0, 0.5, batch

    def labels(**kw):
        spec = GpuBenchSpec(Path("/m/x"), image_size=(8, 8), batch_sizes=(1, 2), new_tokens=2, repeats=2, **kw)
        log = RunLog()
        measure(spec, "ours", call, log, clock=lambda: now[0])
        return [(r["label"], r["timed"]) for r in log.records]

    # A pair takes 2 s: warm-ups start at 0, 2 and 4 s, then the 5 s have passed.
    assert labels(warmup=1, warmup_s=5.0) == [
        ("ours b=1 warm-up 0", False), ("ours b=1 warm-up 1", False), ("ours b=1 warm-up 2", False),
        ("ours b=1 #0", True), ("ours b=1 #1", True),
        ("ours b=2 warm-up 0", False), ("ours b=2 #0", True), ("ours b=2 #1", True)]
    assert [label for label, _ in labels(warmup=2, warmup_s=0.0)][:3] == [
        "ours b=1 warm-up 0", "ours b=1 warm-up 1", "ours b=1 #0"]
    # No warm-up asked for: none, whatever warmup_s says.
    assert all(timed for _, timed in labels(warmup=0, warmup_s=5.0))
    # The summary says how the warm-ups were counted.
    summary = {s: markdown(GpuReport(GpuBenchSpec(Path("/m/x"), kinds=("ours",), warmup=1, warmup_s=s))).splitlines()[0]
               for s in (5.0, 0.0)}
    assert "after at least 1 untimed (the first batch size's for at least 5 s);" in summary[5.0]
    assert "after 1 untimed;" in summary[0.0]
    with pytest.raises(ValueError, match="warmup_s must be >= 0"):
        GpuBenchSpec(Path("/m/x"), warmup_s=-1.0)


@pytest.mark.parametrize("args,needle", [
    (["--weights", "bf16,w2a16"], "w2a16"),
    (["--weights", "fp32"], "fp32 with --dtype bfloat16"),
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--batch-sizes", "0,4"], "positive"),
    (["--group-size", "0"], "--group-size"),
])
def test_the_gpu_command_refuses_options_it_cannot_run(checkpoint, args, needle):
    result = CliRunner().invoke(app, ["bench", "gpu", "--model", str(checkpoint("qwen2_vl")), *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output


# --- the quantized checkpoints and their cache ----------------------------------------------------------

def _scale_dtypes(folder: Path) -> set:
    from safetensors import safe_open

    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            dtypes |= {f.get_slice(name).get_dtype() for name in f.keys() if name.endswith("weight_scale")}
    return dtypes


def test_the_benchmark_quantizes_in_the_dtype_it_runs(quantized):
    """A bf16 run's 4-bit checkpoint is quantized from the weights in bf16 (`quantize --dtype`), so its
    scales are bf16, as a checkpoint quantized from bf16 weights has them; the float32 source quantized
    as it is keeps float32 scales, in another folder."""
    from edgeinfer.bench.gpu import prepare_weights
    from edgeinfer.quant.compress import REPORT_NAME

    source, cache, as_is = quantized
    spec = GpuBenchSpec(source, kinds=("ours",), weights=("bf16", "w4a16"), group_size=GROUP)
    folder = prepare_weights(spec, cache, log=lambda _: None)["w4a16"]
    assert folder != as_is
    assert _scale_dtypes(folder) == {"BF16"} and _scale_dtypes(as_is) == {"F32"}
    assert json.loads((folder / REPORT_NAME).read_text())["dtype"] == "bfloat16"
    # Loaded for a bf16 run, the packed products keep bf16 scales: the tensor-core kernel's condition
    from edgeinfer.models.loader import load_model

    weights = load_model(folder, torch.bfloat16, keep_packed=True).quantized.weights
    assert weights and {w.scales.dtype for w in weights.values()} == {torch.bfloat16}
    before = load_model(as_is, torch.bfloat16, keep_packed=True).quantized.weights  # what the last run had
    assert {w.scales.dtype for w in before.values()} == {torch.float32}


def test_a_quantized_checkpoint_is_written_once_under_a_key_of_what_it_depends_on(quantized, monkeypatch):
    source, cache, folder = quantized
    spec = QuantizedCheckpointSpec(source, 4, GROUP)
    assert folder == spec.folder(cache) and folder.parent == cache
    assert folder.name.startswith("qwen2_vl-w4a16-g32-rtn-")
    written = (folder / "config.json").stat().st_mtime_ns
    assert quantized_checkpoint(spec, cache) == folder  # cached: not written again
    assert (folder / "config.json").stat().st_mtime_ns == written
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["group_size"] == GROUP
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no scratch folder left behind

    key = spec.key()
    assert QuantizedCheckpointSpec(source, 8, GROUP).key() != key
    assert QuantizedCheckpointSpec(source, 4, GROUP, dtype="bfloat16").key() != key
    assert QuantizedCheckpointSpec(source, 4, 16).key() != key
    heads = {QuantizedCheckpointSpec(source, 4, GROUP, lm_head_bits=bits).key() for bits in (8, 4)}
    assert len(heads) == 2 and key not in heads
    # A changed checkpoint (here its config) is another source.
    changed = Path(shutil.copytree(source, cache / "changed" / "qwen2_vl"))
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert QuantizedCheckpointSpec(changed, 4, GROUP).folder(cache) != folder
    # Another quantizer (here another compressed-tensors release) rebuilds.
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "9.9.9" if name == "compressed-tensors" else real(name))
    assert spec.key() != key


def test_a_format_runs_the_checkpoint_itself_or_its_quantized_copy(quantized, tmp_path):
    """What ``scripts/profile_gpu.py --shape --weights`` profiles: the benchmark's folder for the format,
    quantized (and said so) only where the cache does not hold it yet."""
    from edgeinfer.bench.weights import format_checkpoint

    source, cache, folder = quantized
    said = []
    assert format_checkpoint(source, "fp32", cache, GROUP, "float32", log=said.append) == source
    assert format_checkpoint(source, "w4a16", cache, GROUP, "float32", log=said.append) == folder
    assert said == []
    fresh = format_checkpoint(source, "w4a16", tmp_path / "fresh", GROUP, "float32", log=said.append)
    assert fresh.parent == tmp_path / "fresh" and (fresh / "config.json").is_file()
    assert len(said) == 1 and "w4a16" in said[0] and str(fresh) in said[0]


def test_prepare_weights_maps_each_format_to_its_checkpoint(quantized):
    source, cache, folder = quantized
    spec = GpuBenchSpec(source, dtype="float32", weights=("fp32", "w4a16"), group_size=GROUP)
    said = []
    assert prepare_weights(spec, cache, log=said.append) == {"fp32": source, "w4a16": folder}
    assert said == []  # cached: nothing quantized, nothing said
    peers_only = GpuBenchSpec(source, dtype="float32", weights=("fp32", "w8a16"), kinds=("transformers-static",))
    assert prepare_weights(peers_only, cache) == {"fp32": source}  # nothing of ours runs a quantized format


# --- the bytes a decode step reads ------------------------------------------------------------------------

def _stored(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - safe_open is not iterable
    return tensors


def _nbytes(tensors: dict[str, torch.Tensor], keep) -> int:
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if keep(name))


def test_decode_bytes_are_the_decoders_tensors_as_stored(quantized):
    source, _, folder = quantized
    tensors = _stored(folder)
    layers = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    got = decode_weight_bytes(folder)
    # Qwen2-VL's decoder is ``model.*`` on disk (its tower is ``visual.*``), its head ``lm_head``.
    assert got.quantized == _nbytes(tensors, lambda n: n.rsplit(".", 1)[0] in layers and not n.endswith("_shape"))
    assert got.dense == _nbytes(tensors, lambda n: n.startswith("model.") and n.rsplit(".", 1)[0] not in layers
                                and n != "model.embed_tokens.weight")
    assert got.head == tensors["lm_head.weight"].numel() * 4 and not got.tied_head
    embed = tensors["model.embed_tokens.weight"]
    assert got.embedding_row == embed.shape[1] * 4
    assert got.quantized_layers == len(layers) == 7 * 2
    # Four bits a weight, one fp32 scale per 32 of them.
    q_proj = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q_proj}.weight_packed"].numel() * 4 == 64 * 64 // 2
    assert tensors[f"{q_proj}.weight_scale"].shape == (64, 64 // GROUP)

    dense = decode_weight_bytes(source)
    source_tensors = _stored(source)
    assert dense.quantized == 0
    assert dense.per_step == _nbytes(source_tensors, lambda n: n.startswith(("model.", "lm_head."))) \
        - embed.numel() * 4 + embed.shape[1] * 4
    assert got.quantized + got.dense < (dense.quantized + dense.dense) / 6  # 4-bit layers against fp32 ones
    assert got.head == dense.head and got.embedding_row == dense.embedding_row  # both stay as they were


def test_dense_tensors_count_at_the_dtype_the_engine_runs(quantized):
    """An fp32 checkpoint run in bf16 is converted at load: its dense tensors are read at two bytes
    a value, its packed layers as stored."""
    source, _, folder = quantized
    as_stored, in_bf16 = decode_weight_bytes(source), decode_weight_bytes(source, 2)
    assert in_bf16.dense * 2 == as_stored.dense and in_bf16.head * 2 == as_stored.head
    packed, packed_bf16 = decode_weight_bytes(folder), decode_weight_bytes(folder, 2)
    assert packed_bf16.quantized == packed.quantized and packed_bf16.dense * 2 == packed.dense


def test_a_tied_head_reads_the_whole_embedding(checkpoint):
    folder = checkpoint("qwen2_5_vl")  # tie_word_embeddings: no lm_head stored
    tensors = _stored(folder)
    assert not any(n.startswith("lm_head.") for n in tensors)
    embed = next(t for n, t in tensors.items() if n.endswith("embed_tokens.weight"))
    got = decode_weight_bytes(folder)
    assert got.tied_head and got.head == embed.numel() * embed.element_size()
    assert got.embedding_row == embed.shape[1] * embed.element_size()


# --- each format's roofline and the Jetson projection --------------------------------------------------------

def _result(kind: str, fmt: str, decode_s: float, weight_bytes: int) -> dict:
    """One engine's record: three timed pairs whose decode takes ``decode_s`` for 9 tokens at batch 1."""
    runs = [{"batch": 1, "full_s": 0.1 + decode_s, "first_s": 0.1, "timed": True} for _ in range(3)]
    return {"runs": runs, "kind": kind, "weights": fmt, "prompt_tokens": 95, "prompt_digest": "d",
            "peak_memory_mb": 1.0, "kv_bytes_per_token": 0, "weight_bytes": weight_bytes,
            "decode_weight_bytes": {"per_step": weight_bytes}, "loaded_text_bytes": weight_bytes}


def test_each_format_has_its_own_roofline_and_projection():
    spec = GpuBenchSpec(Path("/m/qwen2-vl-2b"), batch_sizes=(1,), new_tokens=10, kinds=("ours",),
                        weights=("bf16", "w4a16"))
    report = GpuReport(spec, probes=[Probe("gemv", 4 * 10**9, 1.0)], environment={"gpu": "NVIDIA H200"})
    # 4 GB/s over 1 GB a step: a roofline of 4 tok/s; 9 tokens in 4.5 s is 2 tok/s, half of it.
    report.results["ours"] = _result("ours", "bf16", 4.5, 10**9)
    # 0.25 GB a step: 16 tok/s; 9 tokens in 0.75 s is 12 tok/s, three quarters of it.
    report.results["ours-w4a16"] = _result("ours", "w4a16", 0.75, 10**9 // 4)
    rooflines = report.rooflines()
    assert rooflines["ours"][1]["fraction"] == pytest.approx(0.5)
    assert rooflines["ours-w4a16"][1]["roofline_tok_s"] == pytest.approx(16.0)
    assert rooflines["ours-w4a16"][1]["fraction"] == pytest.approx(0.75)
    assert report.roofline() == rooflines["ours"]  # the raw file's ``roofline`` stays ours as it is

    rows = {(r["board"], r["engine"]): r["tok_s"][1] for r in report.jetson()}
    assert len(rows) == len(BOARDS) * 2
    assert rows["Jetson AGX Orin 64 GB", "ours"] == pytest.approx(0.5 * 204.8)  # share × GB/s / GB per token
    assert rows["Jetson AGX Orin 64 GB", "ours-w4a16"] == pytest.approx(0.75 * 204.8 * 4)
    assert rows["Jetson Orin Nano 8 GB (original)", "ours"] == pytest.approx(0.5 * 68)
    assert projected_tok_s(0.5, 100.0, 2e9, batch=4) == pytest.approx(100.0)

    text = markdown(report)
    assert "projected from the NVIDIA H200's measured share of its byte roofline, not measured on the board" in text
    assert "The transformers peers run the bf16 checkpoint only" in text
    assert "| **ours-w4a16 / ours** | **6.00×** |" in text  # 12 tok/s over 2
    assert "| Jetson AGX Orin 64 GB | 204.8 | ours-w4a16 | 614 |" in text
    with LoadTracker() as tracker:
        data, _ = to_raw(report, tracker, max_load=1.5, allow_noisy=True)
    assert {"summary", "speedups", "roofline", "bandwidth", "results", "runs"} <= set(data)  # the old fields stay
    assert data["weights"]["peers_run"] == "bf16" and "transformers runs the bf16" in data["weights"]["note"]
    assert data["weights"]["over_dense"]["ours-w4a16"][1]["decode_tok_s"] == pytest.approx(6.0)
    assert "not measured on the board" in data["jetson"]["label"]
    assert {r["source"] for r in data["jetson"]["rows"]} == {b.source for b in BOARDS}


def test_the_roofline_takes_the_decode_rate_in_the_call_where_every_run_has_it():
    """A one-token call that ran 0.05 s long makes decode only 9 tokens in 0.45 s (20 tok/s) where the
    full call's own span is 9 in 0.5 s (18 tok/s): the share follows the call's own span, and decode
    only where a run lacks its full call's first token."""
    spec = GpuBenchSpec(Path("/m/qwen2-vl-2b"), batch_sizes=(1,), new_tokens=10, kinds=("ours",))
    report = GpuReport(spec, probes=[Probe("gemv", 40 * 10**9, 1.0)], environment={"gpu": "NVIDIA H200"})
    result = _result("ours", "bf16", 0.5, 10**9)  # a roofline of 40 tok/s
    for run in result["runs"]:
        run.update(first_s=0.15, full_first_s=0.1)
    report.results["ours"] = result
    row = report.rooflines()["ours"][1]
    assert row["span"] == "decode_in_call_tok_s" and row["fraction"] == pytest.approx(18 / 40)
    assert "Byte roofline, decode in the call:" in markdown(report)
    del result["runs"][0]["full_first_s"]
    row = report.rooflines()["ours"][1]
    assert row["span"] == "decode_tok_s" and row["fraction"] == pytest.approx(20 / 40)
    assert "Byte roofline, decode only:" in markdown(report)


def test_a_projection_without_a_measured_rate_is_a_hole_not_a_figure():
    rows = projection({"ours": {1: {"fraction": math.nan, "step_bytes": 1e9}}})
    assert all(math.isnan(r["tok_s"][1]) for r in rows)


# --- the whole command ------------------------------------------------------------------------------------------

def test_each_engines_record_states_the_weights_it_ran(quantized):
    from edgeinfer.bench.gpu import weight_record

    source, _, folder = quantized
    for fmt, checkpoint, peer in (("fp32", source, True), ("w4a16", folder, False)):
        record = weight_record(fmt, checkpoint, peer, "float32")
        assert record["weights"] == fmt and record["checkpoint"] == str(checkpoint)
        assert record["decode_weight_bytes"] == decode_weight_bytes(checkpoint, 4).to_dict()
        tensors = _stored(checkpoint)
        assert record["weight_bytes"] == _nbytes(tensors, lambda n: True)
        assert ("weights_note" in record) == peer
    assert weight_record("w4a16", folder, False, "float32")["weight_format"] == "compressed-tensors W4A16 g32"
    assert "transformers runs the fp32 checkpoint only" in weight_record("fp32", source, True, "float32")["weights_note"]


@pytest.mark.slow
def test_ours_runs_a_quantized_checkpoint_in_its_worker(quantized, tmp_path):
    """Ours on the w4a16 copy, on a CPU (no timing meaning): the worker's record merged with its weights'."""
    from edgeinfer.bench.gpu import bench

    source, cache, folder = quantized
    spec = GpuBenchSpec(source, image_size=(56, 56), batch_sizes=(1,), new_tokens=2, repeats=1, warmup=0,
                        dtype="float32", device="cpu", kinds=("ours",), bandwidth_mib=4, weights=("w4a16",),
                        group_size=GROUP)
    path = bench(spec, tmp_path, allow_noisy=True, log=lambda _: None, checkpoints=prepare_weights(spec, cache))
    assert path.name == "gpu-qwen2_vl-w4a16.json"
    data = json.loads(path.read_text())
    assert not data["errors"] and set(data["results"]) == {"ours-w4a16"}
    record = data["results"]["ours-w4a16"]
    assert record["checkpoint"] == str(folder) and record["kind"] == "ours" and record["prompt_tokens"] > 0
    assert record["loaded_text_bytes"] > 0
    assert set(data["rooflines"]) == {"ours-w4a16"} and len(data["jetson"]["rows"]) == len(BOARDS)
    # The raw file alone gives its summary again (scripts/summarize_gpu_raw.py).
    assert path.with_suffix(".md").read_text().startswith(markdown(GpuReport.from_raw(data)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is false")
@pytest.mark.slow
def test_every_format_runs_on_a_gpu(quantized, tmp_path):
    from edgeinfer.bench.gpu import bench

    source, cache, _ = quantized
    spec = GpuBenchSpec(source, image_size=(56, 56), batch_sizes=(1, 2), new_tokens=4, repeats=1, warmup=1,
                        kinds=("ours", "transformers-static"), bandwidth_mib=64, weights=("bf16", "w8a16", "w4a16"),
                        group_size=GROUP)
    data = json.loads(bench(spec, tmp_path, log=lambda _: None, checkpoints=prepare_weights(spec, cache)).read_text())
    assert data["same_prompt"] and not data["errors"]
    assert set(data["rooflines"]) == {"ours", "ours-w8a16", "ours-w4a16"}
    assert data["results"]["transformers-static"]["weights"] == "bf16"
