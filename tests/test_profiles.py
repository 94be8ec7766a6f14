"""Profiles: shipped files validate, broken ones fail precisely, overrides apply in order."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.device import CudaProbe, detect_device
from edgeinfer.errors import ProfileError, exit_code_for
from edgeinfer.profiles import (
    PROFILE_ENV,
    MemoryConfig,
    choose_profile,
    list_profiles,
    load_profile,
    match_profile,
    profile_dirs,
    profile_fingerprint,
    profile_from_mapping,
    profile_path,
    profile_to_dict,
    read_profile_data,
    shipped_profiles,
    validate_profile_file,
)

try:
    from tests.fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, make_dgpu, write
except ImportError:
    from fake_sysfs import JETSON_BOARDS, Jetson, make_cpu, make_dgpu, write

SHIPPED = ["agx-orin-32gb", "agx-orin-64gb", "agx-thor", "cpu", "cuda",
           "orin-nano-4gb", "orin-nano-8gb", "orin-nx-16gb", "orin-nx-8gb"]


def cpu_data() -> dict[str, Any]:
    return read_profile_data(profile_path("cpu"))


def write_profile(tmp_path: Path, data: Any, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


# --------------------------------------------------------------------------- shipped profiles


def test_every_device_class_ships_a_profile() -> None:
    assert list_profiles() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_validates(name: str) -> None:
    profile = validate_profile_file(profile_path(name))
    assert profile.name == name == profile_path(name).stem
    assert load_profile(name) == profile


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_round_trips_through_plain_data(name: str) -> None:
    profile = load_profile(name)
    assert profile_from_mapping(yaml.safe_load(yaml.safe_dump(profile_to_dict(profile)))) == profile


def test_cpu_profile_is_what_the_tests_of_other_parts_rely_on() -> None:
    profile = load_profile("cpu")
    assert (profile.runtime.device, profile.runtime.dtype, profile.kv.block_size) == ("cpu", "float32", 16)
    assert not profile.runtime.cuda_graphs


def test_unified_jetson_profiles_compress_the_host_tier() -> None:
    for profile in shipped_profiles():
        if profile.detect.kind == "jetson":
            assert profile.memory.unified and profile.kv.host_precision in ("int8", "fp8")


def test_profiles_are_searched_in_the_package_then_the_checkout() -> None:
    dirs = profile_dirs()
    assert [d.name for d in dirs] in (["_profiles"], ["profiles"], ["_profiles", "profiles"])
    assert profile_path("cpu").parent == dirs[0]


def test_profiles_are_frozen() -> None:
    profile = load_profile("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.kv.block_size = 32  # type: ignore[misc]


def test_fingerprint_is_stable_and_follows_engine_settings_only() -> None:
    base = profile_fingerprint(load_profile("cpu"))
    assert base == profile_fingerprint(load_profile("cpu"))
    assert base == profile_fingerprint(load_profile("cpu", ["server.max_queue=99", "memory.host_tier_mb=10"]))
    assert base != profile_fingerprint(load_profile("cpu", ["build.workspace_mb=512"]))
    assert base != profile_fingerprint(load_profile("cpu", ["kv.block_size=32"]))


# --------------------------------------------------------------------------- broken corpus

def _set(path: str, value: Any):
    def mutate(data: dict[str, Any]) -> None:
        *sections, leaf = path.split(".")
        node = data
        for section in sections:
            node = node[section]
        node[leaf] = value
    return mutate


def _drop(path: str):
    def mutate(data: dict[str, Any]) -> None:
        section, leaf = path.split(".")
        del data[section][leaf]
    return mutate


# (case, mutation, field named by the error, words the reason must contain)
BROKEN = [
    ("unknown top key", _set("colour", "red"), "colour", "unknown key"),
    ("unknown nested key", _set("kv.blocksize", 16), "kv.blocksize", "valid keys: block_size"),
    ("missing key", _drop("memory.total_mb"), "memory.total_mb", "missing"),
    ("section not a mapping", _set("kv", [1, 2]), "kv", "expected a mapping"),
    ("string for int", _set("kv.block_size", "16"), "kv.block_size", "expected int"),
    ("bool for int", _set("images.max_images", True), "images.max_images", "got bool"),
    ("float for int", _set("memory.total_mb", 8192.5), "memory.total_mb", "expected int"),
    ("literal", _set("kv.host_precision", "int4"), "kv.host_precision", "one of 'full', 'int8', 'fp8'"),
    ("dtype literal", _set("runtime.dtype", "fp16"), "runtime.dtype", "'float16'"),
    ("bool field", _set("runtime.cuda_graphs", "yes please"), "runtime.cuda_graphs", "expected bool"),
    ("kv budget over total minus reserve", _set("memory.kv_device_budget_mb", 6145),
     "memory.kv_device_budget_mb", "over total_mb - os_reserve_mb = 6144"),
    ("reserve over total", _set("memory.os_reserve_mb", 8192), "memory.os_reserve_mb", "leaves nothing"),
    ("watermarks reversed", _set("memory.low_watermark", 0.95), "memory.low_watermark", "high_watermark=0.9"),
    ("high watermark over one", _set("memory.high_watermark", 1.5), "memory.high_watermark", "(0, 1]"),
    ("floor over plannable", _set("memory.available_floor_mb", 7000), "memory.available_floor_mb", "not below"),
    ("negative tier", _set("memory.disk_tier_mb", -1), "memory.disk_tier_mb", ">= 0"),
    ("negative prefill graphs", _set("runtime.prefill_graphs", -1), "runtime.prefill_graphs", ">= 0"),
    ("block size not power of two", _set("kv.block_size", 24), "kv.block_size", "power of two"),
    ("zero device blocks", _set("kv.device_blocks", 0), "kv.device_blocks", "> 0 or null"),
    ("policy name", _set("kv.policy", "LRU K"), "kv.policy", "policy name"),
    ("chunk over context", _set("runtime.prefill_chunk_tokens", 8192), "runtime.prefill_chunk_tokens",
     "over max_context_tokens"),
    ("cuda graphs on cpu", _set("runtime.cuda_graphs", True), "runtime.cuda_graphs", "need device 'cuda'"),
    ("vision size not WxH", _set("runtime.vision_compile_sizes", ["1024x768", "big"]),
     "runtime.vision_compile_sizes", "'big' is not WIDTHxHEIGHT"),
    ("vision sizes not a list", _set("runtime.vision_compile_sizes", "1024x768"), "runtime.vision_compile_sizes",
     "expected"),
    ("cpu profile on cuda", _set("runtime.device", "cuda"), "runtime.device", "must run on 'cpu'"),
    ("shape out of order", _set("build.vision_side", {"min": 448, "opt": 224, "max": 1024}),
     "build.vision_side.opt", "must be >= min"),
    ("shape unknown key", _set("build.decoder_batch", {"min": 1, "opt": 1, "max": 2, "best": 1}),
     "build.decoder_batch.best", "unknown key"),
    ("optimization level", _set("build.builder_optimization_level", 6), "build.builder_optimization_level", "0..5"),
    ("dla precision", _set("build.dla_core", 0), "build.dla_core", "DLA runs only"),
    ("decoder batch under runtime batch", _set("runtime.max_batch_size", 3), "build.decoder_batch.max",
     "under runtime.max_batch_size 3"),
    ("decoder tokens under chunk", _set("runtime.prefill_chunk_tokens", 512), "build.decoder_tokens.max",
     "under runtime.prefill_chunk_tokens 512"),
    ("block table too short", _set("kv.block_size", 8), "build.decoder_block_table.max", "needs 512"),
    ("body under one image", _set("server.max_body_mb", 26), "server.max_body_mb", "needs 27"),
    ("timeout not positive", _set("server.request_timeout_s", 0), "server.request_timeout_s", "> 0"),
    ("bad name", _set("name", "My Profile"), "name", "lower-case"),
    ("bad regex", _set("detect.model_patterns", ["Orin ("]), "detect.model_patterns[0]", "regular expression"),
    ("memory range reversed", _set("detect.min_memory_mb", 9000) , None, None),
]


@pytest.mark.parametrize(("case", "mutate", "field", "reason"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_profile_names_file_and_field(tmp_path: Path, case: str, mutate, field: str | None,
                                            reason: str | None) -> None:
    data = cpu_data()
    mutate(data)
    if case == "memory range reversed":
        data["detect"]["max_memory_mb"] = 4096
        field, reason = "detect.max_memory_mb", "above min_memory_mb (9000)"
    path = write_profile(tmp_path, data)
    with pytest.raises(ProfileError) as caught:
        validate_profile_file(path)
    error = caught.value
    assert (error.file, error.field) == (str(path), field)
    assert reason in error.reason
    assert str(error).startswith(f"{path}: {field}: ")
    assert exit_code_for(error) == 2 and error.http_status == 500


def test_unified_host_tier_at_full_precision_frees_nothing(tmp_path: Path) -> None:
    data = read_profile_data(profile_path("orin-nx-16gb"))
    data["kv"]["host_precision"] = "full"
    with pytest.raises(ProfileError) as caught:
        validate_profile_file(write_profile(tmp_path, data))
    assert caught.value.field == "kv.host_precision"


def test_unified_host_tier_shares_dram_with_the_pool(tmp_path: Path) -> None:
    data = read_profile_data(profile_path("orin-nano-4gb"))
    data["memory"]["host_tier_mb"] = 2100
    with pytest.raises(ProfileError, match="kv_device_budget_mb \\+ host_tier_mb = 2612 MiB") as caught:
        validate_profile_file(write_profile(tmp_path, data))
    assert caught.value.field == "memory.host_tier_mb"


@pytest.mark.parametrize(("text", "reason"), [
    ("name: cpu\nname: gpu\n", "duplicate key 'name' at line 2"),
    ("name: [unclosed\n", "not valid YAML"),
    ("", "expected a mapping of DeviceProfile fields, got null"),
    ("- a\n- b\n", "got list"),
])
def test_broken_yaml_documents(tmp_path: Path, text: str, reason: str) -> None:
    path = write_profile(tmp_path, text)
    with pytest.raises(ProfileError, match=reason.replace("[", r"\[")) as caught:
        validate_profile_file(path)
    assert caught.value.file == str(path)


def test_missing_file_and_unknown_name() -> None:
    with pytest.raises(ProfileError, match="cannot read profile file"):
        load_profile("/nonexistent/profile.yaml")
    with pytest.raises(ProfileError, match="unknown profile 'orin-mega'; available: agx-orin-32gb"):
        load_profile("orin-mega")


def test_direct_construction_validates_too() -> None:
    memory = load_profile("cpu").memory
    with pytest.raises(ProfileError) as caught:
        dataclasses.replace(memory, low_watermark=0.95)
    assert caught.value.field == "low_watermark"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(total=st.integers(-10, 20_000), reserve=st.integers(-10, 20_000), kv=st.integers(-10, 20_000),
       high=st.one_of(st.floats(-1, 2), st.just(math.nan)), low=st.one_of(st.floats(-1, 2), st.just(math.nan)))
def test_memory_config_either_builds_consistently_or_raises_profile_error(total, reserve, kv, high, low) -> None:
    try:
        memory = MemoryConfig(total, reserve, kv, 0, 0, high, low, 0, False)
    except ProfileError as error:
        assert error.field in {f.name for f in dataclasses.fields(MemoryConfig)}
        return
    assert memory.kv_device_budget_mb <= memory.total_mb - memory.os_reserve_mb
    assert 0 < memory.low_watermark < memory.high_watermark <= 1


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["kv.block_size", "memory.total_mb", "runtime.dtype", "images.max_side",
                              "build.vision_side.max", "server.max_queue", "kv.disk_dir"]),
       value=st.one_of(st.integers(-5, 5000), st.text(max_size=6), st.none(), st.booleans(), st.floats(-1, 1)))
def test_any_override_value_is_applied_or_rejected_with_a_profile_error(field, value) -> None:
    item = f"{field}={yaml.safe_dump(value, default_flow_style=True).removesuffix(chr(10) + '...' + chr(10)).strip()}"
    try:
        load_profile("cpu", [item])
    except ProfileError as error:
        assert error.field is None or error.field.split(".")[0] in {"kv", "memory", "runtime", "images", "build", "server"}


# --------------------------------------------------------------------------- overrides and order


def test_set_overrides_fields_with_yaml_values() -> None:
    profile = load_profile("cpu", ["kv.block_size=32", "kv.disk_dir=/ssd/kv", "runtime.threads=2",
                                   "build.decoder_batch.max=4", "runtime.max_batch_size=4", "kv.disk_dir="])
    assert (profile.kv.block_size, profile.runtime.threads, profile.kv.disk_dir) == (32, 2, None)
    assert profile.build.decoder_batch.max == 4


def test_later_set_wins() -> None:
    assert load_profile("cpu", ["kv.block_size=32", "kv.block_size=64"]).kv.block_size == 64


@pytest.mark.parametrize(("item", "file", "field", "reason"), [
    ("kv.block_size=33", "--set kv.block_size=33", "kv.block_size", "power of two"),
    ("kv.nope=1", "--set kv.nope=1", "kv.nope", "unknown key"),
    ("kv.block_size", "--set kv.block_size", None, "section.field=value"),
    ("kv..x=1", "--set kv..x=1", None, "section.field=value"),
    ("kv.block_size.x=1", "--set kv.block_size.x=1", "kv.block_size", "not a section"),
    ("images.max_side=[1", "--set images.max_side=[1", "images.max_side", "not valid YAML"),
])
def test_bad_override_names_the_set_and_field(item: str, file: str, field: str | None, reason: str) -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("cpu", [item])
    assert (caught.value.file, caught.value.field) == (file, field)
    assert reason in caught.value.reason


def test_override_that_breaks_another_field_names_the_file_and_the_set() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("cpu", ["memory.os_reserve_mb=7500"])
    assert caught.value.field == "memory.kv_device_budget_mb"
    assert caught.value.file == f"{profile_path('cpu')} with --set memory.os_reserve_mb=7500"


def test_selector_may_be_a_file(tmp_path: Path) -> None:
    data = cpu_data()
    data["name"] = "my-box"
    path = write_profile(tmp_path, data, "box.yaml")
    assert load_profile(str(path)).name == "my-box"


def test_order_set_over_profile_over_env_over_detection(tmp_path: Path) -> None:
    root = Jetson(JETSON_BOARDS[3]).build(tmp_path)  # Orin NX 16GB
    assert load_profile(env={}, root=root).name == "orin-nx-16gb"
    assert load_profile(env={PROFILE_ENV: "cuda"}, root=root).name == "cuda"
    assert load_profile("cpu", env={PROFILE_ENV: "cuda"}, root=root).name == "cpu"
    assert load_profile("cpu", ["kv.block_size=64"], env={PROFILE_ENV: "cuda"}, root=root).kv.block_size == 64
    assert choose_profile(env={PROFILE_ENV: "cuda"}, root=root).source == "env"


@pytest.mark.parametrize("board", JETSON_BOARDS, ids=lambda b: f"{b.profile}:{b.model[-12:]}")
def test_detection_picks_the_board_profile(tmp_path: Path, board) -> None:
    assert load_profile(env={}, root=Jetson(board).build(tmp_path)).name == board.profile


def test_memory_decides_when_the_model_string_is_shared(tmp_path: Path) -> None:
    write(tmp_path, "/proc/device-tree/model", b"NVIDIA Jetson AGX Orin\x00")
    write(tmp_path, "/proc/meminfo", "MemTotal: 64349000 kB\nMemAvailable: 60000000 kB\n")
    assert load_profile(env={}, root=tmp_path).name == "agx-orin-64gb"


def test_dgpu_and_cpu_boxes_get_the_generic_profiles(tmp_path: Path) -> None:
    assert load_profile(env={}, root=make_dgpu(tmp_path / "gpu")).name == "cuda"
    assert load_profile(env={}, root=make_cpu(tmp_path / "cpu")).name == "cpu"


def test_unknown_jetson_falls_back_by_what_runs(tmp_path: Path) -> None:
    write(tmp_path, "/proc/device-tree/model", b"NVIDIA Jetson Xavier NX Developer Kit\x00")
    write(tmp_path, "/proc/meminfo", "MemTotal: 7000000 kB\nMemAvailable: 5000000 kB\n")
    profiles = shipped_profiles()
    without_cuda, why = match_profile(detect_device(tmp_path), profiles)
    assert without_cuda.name == "cpu" and "matches no named profile" in why
    with_cuda, _ = match_profile(detect_device(tmp_path, cuda_probe=lambda: CudaProbe("Xavier", "7.2", 6800)), profiles)
    assert with_cuda.name == "cuda"


def test_every_jetson_rule_matches_only_its_own_boards(tmp_path: Path) -> None:
    profiles = [p for p in shipped_profiles() if p.detect.kind == "jetson"]
    for i, board in enumerate(JETSON_BOARDS):
        device = detect_device(Jetson(board).build(tmp_path / str(i)))
        assert [p.name for p in profiles if p.detect.matches(device)] == [board.profile]


def test_budget_table_leaves_room_for_weights() -> None:
    for profile in shipped_profiles():
        memory = profile.memory
        room = memory.total_mb - memory.os_reserve_mb - memory.kv_device_budget_mb
        assert room >= memory.kv_device_budget_mb, profile.name
        blocks = math.ceil(profile.runtime.max_context_tokens / profile.kv.block_size)
        assert profile.build.decoder_block_table.max == blocks, profile.name


# --------------------------------------------------------------------------- the command

from typer.testing import CliRunner  # noqa: E402

from edgeinfer.cli.main import app  # noqa: E402

runner = CliRunner()


def test_cli_list() -> None:
    result = runner.invoke(app, ["profiles", "list", "--json"])
    assert result.exit_code == 0
    assert [row["name"] for row in json.loads(result.stdout)] == SHIPPED


def test_cli_show_applies_set() -> None:
    result = runner.invoke(app, ["profiles", "show", "cpu", "--set", "kv.block_size=32", "--set", "kv.policy=lru"])
    assert result.exit_code == 0
    data = yaml.safe_load(result.stdout)
    assert (data["kv"]["block_size"], data["kv"]["policy"]) == (32, "lru")
    assert result.stdout.startswith("# fingerprint: ")


def test_cli_typed_error_is_one_line_and_exit_two() -> None:
    result = runner.invoke(app, ["profiles", "show", "cpu", "--set", "kv.block_size=3"])
    assert result.exit_code == 2
    assert result.stderr == "error: --set kv.block_size=3: kv.block_size: must be a power of two between 1 and 1024, got 3\n"
    assert "Traceback" not in result.output


def test_cli_validate_reports_each_file(tmp_path: Path) -> None:
    data = cpu_data()
    data["memory"]["low_watermark"] = 0.99
    bad = write_profile(tmp_path, data, "bad.yaml")
    result = runner.invoke(app, ["profiles", "validate", str(profile_path("cpu")), str(bad)])
    assert result.exit_code == 2
    assert result.stdout.startswith(f"ok: {profile_path('cpu')} (cpu, fingerprint ")
    assert result.stderr.strip() == f"error: {bad}: memory.low_watermark: must be in (0, high_watermark=0.9), got 0.99"


def test_cli_detect_over_a_fake_tree(tmp_path: Path) -> None:
    root = Jetson(JETSON_BOARDS[0]).build(tmp_path)
    result = runner.invoke(app, ["profiles", "detect", "--root", str(root), "--json"])
    report = json.loads(result.stdout)
    assert (report["profile"], report["device"]["kind"], report["device"]["jetpack"]) == ("agx-thor", "jetson", "7.0")


def test_cli_profile_env_is_honoured_by_commands_that_take_it(tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "--root", str(make_cpu(tmp_path / "r")), "--json",
                                 "--engines", str(tmp_path / "e")], env={PROFILE_ENV: "orin-nano-4gb"})
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["profile"]["detail"].startswith("orin-nano-4gb (from $EDGEINFER_PROFILE)")


def test_vision_compile_sizes_reach_the_engine_config(tmp_path: Path) -> None:
    from edgeinfer.engine import EngineConfig

    data = cpu_data()
    data["runtime"]["vision_compile_sizes"] = ["1024x768", "640X480"]
    profile = validate_profile_file(write_profile(tmp_path, data))
    assert profile.runtime.vision_compile_sizes == ("1024x768", "640X480")
    assert EngineConfig.from_profile(profile).vision_compile_sizes == ((1024, 768), (640, 480))
