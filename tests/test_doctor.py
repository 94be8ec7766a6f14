"""``edgeinfer doctor`` over fake machines; the software stack is the one boundary replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgeinfer.cli.main import app
from edgeinfer.device import CudaProbe, detect_device
from edgeinfer.doctor import (
    Environment,
    _supported_architectures,
    any_failed,
    check_engines,
    check_model_architecture,
    check_model_files,
    probe_environment,
    run_checks,
)
from edgeinfer.artifacts import MANIFEST_SCHEMA, file_sha256
from edgeinfer.backends.onnx.build import GRAPH_FORMAT
from edgeinfer.profiles import load_profile, profile_fingerprint

try:
    from tests.fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, make_dgpu
except ImportError:
    from fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, make_dgpu

ORIN_NX = JETSON_BOARDS[3]
runner = CliRunner()


def jetson_env(**changes) -> Environment:
    values = dict(python=(3, 10, 12), torch="2.5.0a0+872d972e41.nv24.08", torch_cuda="12.6", cuda_available=True,
                  cuda_device="Orin", transformers="5.2.0", tensorrt="10.3.0", onnxruntime="1.20.0",
                  ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"))
    return Environment(**{**values, **changes})


def by_name(checks) -> dict[str, tuple[str, str | None]]:
    return {c.name: (c.status, c.fix) for c in checks}


def test_ready_jetson_at_max_clocks_passes(tmp_path: Path) -> None:
    root = Jetson(ORIN_NX, clocks_locked=True, swaps=(("/dev/zram0", 1024), ("/ssd/swap", 16384))).build(tmp_path)
    checks = run_checks(root=root, env=jetson_env(), engines_dir=tmp_path / "engines")
    assert [c.name for c in checks if c.status != "pass"] == []
    names = [c.name for c in checks]
    assert {"jetpack", "power mode", "clocks", "swap", "memory", "profile"} <= set(names)
    assert "orin-nx-16gb" in next(c.detail for c in checks if c.name == "profile")


def test_throttled_jetson_warns_with_the_commands(tmp_path: Path) -> None:
    root = Jetson(ORIN_NX, mode=2, clocks_locked=False, swaps=(("/dev/zram0", 1024),)).build(tmp_path)
    checks = by_name(run_checks(root=root, env=jetson_env(), engines_dir=tmp_path / "engines"))
    assert checks["power mode"] == ("warn", "sudo nvpmodel -m 0  # MAXN")
    assert checks["clocks"] == ("warn", "sudo jetson_clocks")
    assert checks["swap"][0] == "warn" and "mkswap" in checks["swap"][1]


def test_tensorrt_that_is_not_jetpacks_fails(tmp_path: Path) -> None:
    root = Jetson(ORIN_NX).build(tmp_path)  # L4T 36.4.3 = JetPack 6.2, TensorRT 10.3
    checks = run_checks(root=root, env=jetson_env(tensorrt="10.7.0"), engines_dir=tmp_path / "e")
    status, fix = by_name(checks)["jetpack"]
    assert status == "fail" and "python3-libnvinfer" in fix
    assert any_failed(checks)


@pytest.mark.parametrize(("changes", "check", "status"), [
    ({"transformers": "4.57.1"}, "transformers", "fail"),
    ({"transformers": None}, "transformers", "fail"),
    ({"torch": None, "torch_cuda": None}, "torch", "fail"),
    ({"cuda_available": False, "cuda_device": None}, "cuda", "fail"),
    ({"tensorrt": None}, "tensorrt", "warn"),
    ({"ort_providers": ("CPUExecutionProvider",)}, "onnxruntime", "warn"),
    ({"onnxruntime": None, "ort_providers": ()}, "onnxruntime", "warn"),
    ({"python": (3, 9, 18)}, "python", "fail"),
])
def test_software_stack_checks(tmp_path: Path, changes, check: str, status: str) -> None:
    root = Jetson(ORIN_NX, clocks_locked=True).build(tmp_path)
    checks = by_name(run_checks(root=root, env=jetson_env(**changes), engines_dir=tmp_path / "e"))
    assert checks[check][0] == status
    assert checks[check][1]  # every warn and fail says what to do


def test_gpu_box_with_cpu_only_torch_fails_cuda(tmp_path: Path) -> None:
    root = make_dgpu(tmp_path)
    env = jetson_env(cuda_available=False, cuda_device=None, torch_cuda=None, tensorrt=None)
    checks = by_name(run_checks(root=root, env=env, engines_dir=tmp_path / "e"))
    assert checks["cuda"][0] == "fail" and "cu128" in checks["cuda"][1]
    assert "jetpack" not in checks and "power mode" not in checks


@pytest.mark.parametrize(("triton", "status"), [(None, "warn"), ("3.6.0", "pass")])
def test_gpu_box_says_whether_the_fused_decode_kernels_can_run(tmp_path: Path, triton, status: str) -> None:
    device = detect_device(make_dgpu(tmp_path), cuda_probe=lambda: CudaProbe("NVIDIA H200", "9.0", 143_000))
    checks = by_name(run_checks(root=tmp_path, env=jetson_env(triton=triton), device=device,
                                engines_dir=tmp_path / "e"))
    assert checks["triton"] == (status, "pip install triton" if triton is None else None)


def test_a_gpu_triton_cannot_build_for_is_a_warning_with_the_reason(tmp_path: Path) -> None:
    device = detect_device(make_dgpu(tmp_path), cuda_probe=lambda: CudaProbe("NVIDIA Thor", "11.0", 128_000))
    verdict = "PTXASError: ptxas-blackwell fatal   : Value 'sm_110a' is not defined for option 'gpu-name'"
    checks = run_checks(root=tmp_path, env=jetson_env(triton="3.6.0", triton_cannot_build=verdict), device=device,
                        engines_dir=tmp_path / "e")
    [check] = [c for c in checks if c.name == "triton"]
    assert check.status == "warn" and "sm_110a" in check.detail and "kernels are off" in check.detail
    assert "Triton 3.9" in check.fix


def test_gpu_box_says_where_tile_choices_are_kept(tmp_path: Path, monkeypatch) -> None:
    device = detect_device(make_dgpu(tmp_path), cuda_probe=lambda: CudaProbe("NVIDIA H200", "9.0", 143_000))

    def tile_check(folder):
        monkeypatch.setenv("EDGEINFER_TILE_CACHE", str(folder))
        checks = run_checks(root=tmp_path, env=jetson_env(triton="3.6.0"), device=device, engines_dir=tmp_path / "e")
        [check] = [c for c in checks if c.name == "tile cache"]
        return check

    fresh = tile_check(tmp_path / "cache" / "tiles")
    assert fresh.status == "pass" and "0 GPU and kernel builds kept" in fresh.detail
    (tmp_path / "cache" / "tiles").mkdir(parents=True)
    (tmp_path / "cache" / "tiles" / "nvidia-h200-0123.json").write_text("{}")
    assert "1 GPU and kernel build kept" in tile_check(tmp_path / "cache" / "tiles").detail
    (tmp_path / "a-file").write_text("")
    blocked = tile_check(tmp_path / "a-file" / "tiles")
    assert blocked.status == "warn" and "EDGEINFER_TILE_CACHE" in blocked.fix
    off = tile_check("off")
    assert off.status == "pass" and "every load times" in off.detail
    monkeypatch.setenv("EDGEINFER_TILE_CACHE", str(tmp_path / "tiles"))
    cpu = run_checks(root=make_cpu(tmp_path / "cpu"), env=jetson_env(triton="3.6.0", cuda_available=False),
                     engines_dir=tmp_path / "e")
    assert "tile cache" not in by_name(cpu)


def test_small_gpu_warns_against_the_profile(tmp_path: Path) -> None:
    device = detect_device(make_dgpu(tmp_path), cuda_probe=lambda: CudaProbe("NVIDIA T1000", "7.5", 8_000))
    checks = by_name(run_checks(root=tmp_path, env=jetson_env(), device=device, engines_dir=tmp_path / "e"))
    assert checks["gpu memory"][0] == "warn"


@pytest.mark.parametrize(("available_mb", "status"), [(300, "fail"), (6000, "warn"), (12_000, "pass")])
def test_memavailable_against_the_profile(tmp_path: Path, available_mb: int, status: str) -> None:
    root = Jetson(ORIN_NX, available_mb=available_mb, clocks_locked=True).build(tmp_path)
    checks = by_name(run_checks(root=root, env=jetson_env(), engines_dir=tmp_path / "e"))
    assert checks["memory"][0] == status  # orin-nx-16gb: floor 1024, plans for 6144


def test_cpu_box_passes_without_gpu_software(tmp_path: Path) -> None:
    env = jetson_env(cuda_available=False, cuda_device=None, torch_cuda=None, tensorrt=None,
                     ort_providers=("CPUExecutionProvider",))
    checks = run_checks(root=make_cpu(tmp_path / "root"), env=env, engines_dir=tmp_path / "e")
    assert not any_failed(checks)
    assert by_name(checks)["tensorrt"][0] == "pass"


def test_broken_override_is_a_failed_profile_check(tmp_path: Path) -> None:
    checks = by_name(run_checks(root=make_cpu(tmp_path), env=jetson_env(), overrides=["kv.block_size=3"],
                                engines_dir=tmp_path / "e"))
    assert checks["profile"][0] == "fail"


# --------------------------------------------------------------------------- model folder


def write_model(folder: Path, architectures: list[str] | None = None, files=("tokenizer.json", "preprocessor_config.json")) -> Path:
    folder.mkdir(parents=True)
    config = {"model_type": "idefics3"} | ({"architectures": architectures} if architectures is not None else {})
    (folder / "config.json").write_text(json.dumps(config))
    for name in files:
        (folder / name).write_text("{}")
    return folder


def test_model_folder_supported_and_complete(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", ["Idefics3ForConditionalGeneration"])
    check = check_model_architecture(model, registry=lambda: ["Idefics3ForConditionalGeneration"])
    assert check.status == "pass"
    assert [c.status for c in check_model_files(model)] == ["pass", "pass"]


def test_model_folder_problems(tmp_path: Path) -> None:
    assert check_model_architecture(tmp_path / "absent", registry=lambda: []).status == "fail"
    no_arch = write_model(tmp_path / "a", None, files=())
    assert check_model_architecture(no_arch, registry=lambda: ["X"]).detail == "config.json has no 'architectures'"
    unsupported = check_model_architecture(write_model(tmp_path / "b", ["BertModel"]), registry=lambda: ["LlavaForConditionalGeneration"])
    assert unsupported.status == "fail" and "LlavaForConditionalGeneration" in unsupported.fix
    assert [c.status for c in check_model_files(no_arch)] == ["fail", "fail"]


def test_model_folder_with_the_real_registry(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", ["SomethingForConditionalGeneration"])
    check = check_model_architecture(model)
    supported = _supported_architectures()
    if supported is None:
        assert (check.status, "model registry unavailable" in check.detail) == ("warn", True)
    else:
        assert check.status == ("pass" if "SomethingForConditionalGeneration" in supported else "fail")


# --------------------------------------------------------------------------- engines


def write_engine(engines: Path, *, tensorrt: str | None = "10.3.0", sm: str | None = "8.7",
                 profile: str = "cpu", fingerprint: str | None = None) -> Path:
    folder = engines / "smolvlm" / profile
    folder.mkdir(parents=True)
    (folder / "decoder.onnx").write_bytes(b"onnx-bytes")
    manifest = {"schema": MANIFEST_SCHEMA, "backend": "onnxruntime", "model": "smolvlm",
                "model_dir": "models/smolvlm", "profile": profile, "precision": "fp32",
                "export_revision": GRAPH_FORMAT.export_revision, "opset": GRAPH_FORMAT.opset,
                "fingerprint": {"tensorrt": tensorrt, "sm": sm,
                                "profile": fingerprint or profile_fingerprint(load_profile(profile)),
                                "onnx": {"decoder.onnx": file_sha256(folder / "decoder.onnx")}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def orin_device(tmp_path: Path):
    return detect_device(Jetson(ORIN_NX).build(tmp_path / "root"))


def test_matching_engine_passes(tmp_path: Path) -> None:
    write_engine(tmp_path / "engines")
    [check] = check_engines(tmp_path / "engines", jetson_env(), orin_device(tmp_path))
    assert (check.name, check.status) == ("engine smolvlm/cpu", "pass")


@pytest.mark.parametrize(("kwargs", "env", "reason"), [
    ({"tensorrt": "8.6.2"}, {}, "built with TensorRT 8.6.2, this machine has 10.3.0"),
    ({"sm": "8.9"}, {}, "built with GPU SM 8.9, this machine has 8.7"),
    ({"fingerprint": "0" * 16}, {}, "profile 'cpu' changed"),
    ({}, {"tensorrt": None}, "built with TensorRT 10.3.0, this machine has none"),
])
def test_stale_engine_fails_with_the_rebuild_command(tmp_path: Path, kwargs, env, reason: str) -> None:
    write_engine(tmp_path / "engines", **kwargs)
    [check] = check_engines(tmp_path / "engines", jetson_env(**env), orin_device(tmp_path))
    assert check.status == "fail" and reason in check.detail
    assert check.fix == "edgeinfer build --backend tensorrt --model models/smolvlm --profile cpu"


def test_changed_onnx_makes_the_engine_stale(tmp_path: Path) -> None:
    folder = write_engine(tmp_path / "engines")
    (folder / "decoder.onnx").write_bytes(b"re-exported")
    [check] = check_engines(tmp_path / "engines", jetson_env(), orin_device(tmp_path))
    assert "decoder.onnx: corrupt or changed" in check.detail


# --------------------------------------------------------------------------- the command


def test_probe_environment_reads_this_machine() -> None:
    env = probe_environment()
    assert env.python[0] == 3 and env.torch is not None and env.transformers is not None


def test_doctor_json_on_a_cpu_box(tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "--root", str(make_cpu(tmp_path / "root")), "--json",
                                 "--engines", str(tmp_path / "engines")], env={"EDGEINFER_PROFILE": ""})
    report = json.loads(result.stdout)
    assert {c["name"] for c in report["checks"]} >= {"python", "torch", "transformers", "cuda", "memory"}
    assert result.exit_code == (0 if report["ok"] else 1)


def test_doctor_exits_non_zero_on_a_stale_engine(tmp_path: Path) -> None:
    write_engine(tmp_path / "engines", fingerprint="f" * 16, tensorrt=None, sm=None)
    result = runner.invoke(app, ["doctor", "--root", str(make_cpu(tmp_path / "root")),
                                 "--engines", str(tmp_path / "engines"), "--profile", "cpu"])
    assert result.exit_code == 1
    assert "edgeinfer build --backend onnxruntime --model" in result.stdout


def test_remembered_digests_follow_every_write(tmp_path: Path) -> None:
    import hashlib
    import os

    from edgeinfer.artifacts import HASH_CACHE, file_sha256

    path = tmp_path / "decoder.onnx"
    path.write_bytes(b"a" * 1000)
    assert file_sha256(path, remember=True) == hashlib.sha256(b"a" * 1000).hexdigest()
    assert (tmp_path / HASH_CACHE).is_file()
    path.write_bytes(b"b" * 1000)  # same size, new modification time
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    assert file_sha256(path, remember=True) == hashlib.sha256(b"b" * 1000).hexdigest()
