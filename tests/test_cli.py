"""The CLI's shared options and its error edge, through the real commands (typer's CliRunner,
in process) on the bundled demo model: with --json every error is one JSON object on stdout
with the exit code of the one error map; without it, one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from PIL import Image
from typer.testing import CliRunner

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.main import app
from edgeinfer.errors import ERROR_MAP, BackendUnavailableError, ModelLoadError, PreflightError, ProfileError

REPO = Path(__file__).resolve().parents[1]
DEMO_IMAGE = str(REPO / "examples" / "demo.jpg")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def json_error(result, exit_code: int) -> dict:
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    body = json.loads(result.stdout)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"type", "code", "message", "exit_code", "detail"} and error["code"]
    assert error["exit_code"] == exit_code and "Traceback" not in result.stderr
    return error


@pytest.fixture(scope="module")
def big_image(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli") / "wide.png"
    Image.new("RGB", (640, 80), (200, 30, 30)).save(path)
    return str(path)


def test_demo_answers_as_text_and_as_json():
    plain = invoke("run", "--image", DEMO_IMAGE, "What color is the circle?")
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout.strip() == "red"
    report = json.loads(invoke("run", "--json", "--image", DEMO_IMAGE, "What color is the circle?").stdout)
    assert report["answer"] == "red" and report["preflight"][0]["action"] == "none"


def test_an_image_over_the_limit_is_json_with_its_reason_and_limit(big_image):
    result = invoke("run", "--json", "--image", big_image, "--set", "images.max_side=320", "What color?")
    error = json_error(result, ERROR_MAP[PreflightError].exit_code)
    assert (error["type"], error["code"]) == ("PreflightError", "image_too_large")
    assert error["detail"]["limit"] == 320 and error["detail"]["measured"] == 640
    assert "max_side" in error["message"]


def test_without_json_the_same_error_is_one_line_on_stderr(big_image):
    result = invoke("run", "--image", big_image, "--set", "images.max_side=320", "What color?")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


def test_an_unreadable_image_is_json_exit_2():
    error = json_error(invoke("run", "--json", "--image", "/no/such/frame.png", "What?"), 2)
    assert error["code"] == "unreadable" and error["detail"]["source"] == "/no/such/frame.png"


def test_a_folder_that_is_no_checkpoint_is_json_exit_3(tmp_path):
    error = json_error(invoke("run", "--json", "--model", str(tmp_path), "What?"), ERROR_MAP[ModelLoadError].exit_code)
    assert (error["type"], error["code"]) == ("ModelLoadError", "model_load_error") and error["exit_code"] == 3


def test_a_named_backend_that_is_missing_is_json_exit_4():
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here, so the tensorrt backend is not missing")
    except ImportError:
        pass
    error = json_error(invoke("run", "--json", "--backend", "tensorrt", "--image", DEMO_IMAGE, "What?"),
                       ERROR_MAP[BackendUnavailableError].exit_code)
    assert error["code"] == "backend_unavailable" and "tensorrt" in error["message"]


@pytest.mark.parametrize("command", [["run", "--profile", "no-such", "What?"], ["build", "--profile", "no-such"],
                                     ["profiles", "show", "cpu", "--set", "kv.no_such_field=1"]])
def test_every_json_command_answers_a_bad_profile_in_json(command):
    error = json_error(invoke(*command, "--json"), ERROR_MAP[ProfileError].exit_code)
    assert (error["type"], error["code"]) == ("ProfileError", "profile_error")


@pytest.mark.parametrize("args", [["run", "--json", "--max-tokens", "many", "What?"], ["run", "--json"],
                                  ["run", "--json", "--no-such-flag", "What?"]])
def test_usage_errors_are_json_too(args):
    error = json_error(invoke(*args), 2)
    assert error["code"] == "usage_error" and "--help" in error["message"]


def test_usage_errors_without_json_stay_clicks_own():
    result = invoke("run", "--max-tokens", "many", "What?")
    assert result.exit_code == 2 and result.stdout == "" and "--max-tokens" in result.stderr


def test_with_json_a_bug_is_json_exit_1_and_without_it_keeps_its_traceback():
    """An untyped exception is a bug: --json still answers in the one shape (code internal_error)."""
    probe = typer.Typer()

    @probe.command()
    def broken(json_: bool = typer.Option(False, "--json")) -> None:
        with cli_errors(json_):
            {}["missing"]

    result = CliRunner().invoke(probe, ["--json"])
    error = json_error(result, 1)
    assert (error["type"], error["code"]) == ("KeyError", "internal_error")
    assert isinstance(CliRunner().invoke(probe, []).exception, KeyError)


def test_commands_share_one_definition_of_each_common_option():
    command = typer.main.get_command(app)
    helps: dict[str, set[str]] = {}
    for name in ("run", "serve", "build", "doctor"):
        for param in command.commands[name].params:
            shared = {"profile", "set_"} | ({"model"} if name != "doctor" else set()) | \
                ({"backend"} if name in ("run", "serve") else set())  # build's --backend names build targets
            if param.name in shared:
                helps.setdefault(param.name, set()).add(param.help)
    assert helps.keys() == {"profile", "set_", "backend", "model"}
    assert all(len(texts) == 1 for texts in helps.values()), helps
