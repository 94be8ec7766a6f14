"""``edgeinfer run``: one question about one or more images, answered from the shell.

The question and every image are checked before the model loads: a refused image costs
a header read, not a model load and a KV pool.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Optional

import typer

from edgeinfer.cli.errors import cli_errors
from edgeinfer.cli.options import (
    BackendOption, EnginesOption, ImageOption, JsonOption, ModelOption, ProfileOption, SetOption,
)
from edgeinfer.demo import DEMO_MODEL_DIR
from edgeinfer.errors import ModelLoadError
from edgeinfer.preflight import ImageRules, OnOversize
from edgeinfer.profiles import DeviceProfile, load_profile


def run(
    question: Annotated[str, typer.Argument(help="The question about the image(s).")],
    *,
    image: ImageOption = [],  # noqa: B006 - Typer reads the default, never mutates it
    model: ModelOption = None,
    profile: ProfileOption = None,
    set_: SetOption = None,
    backend: BackendOption = "auto",
    engines: EnginesOption = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling.")] = None,
    max_thinking_tokens: Annotated[Optional[int], typer.Option(
        min=0, help="Models that think: close the thinking span after this many tokens and answer "
                    "(with --json the thinking is under 'reasoning').")] = None,
    stream: Annotated[Optional[bool], typer.Option(
        "--stream/--no-stream", help="Print tokens as they come (default: on a terminal).")] = None,
    on_oversize: Annotated[OnOversize, typer.Option(
        help="reject: refuse an image over a limit (exit 2); fit: downscale it and say so.")] = OnOversize.REJECT,
    as_json: JsonOption = False,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a checkpoint's own Python code.")] = False,
) -> None:
    """Answer QUESTION about the given images (with --json: the answer with timings, usage, preflight,
    cache, and the backend and precision that ran)."""
    with cli_errors(as_json):
        if model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
            raise ModelLoadError(f"the bundled demo model is not in this install ({DEMO_MODEL_DIR}); "
                                 "pass --model DIR with a Hugging Face checkpoint folder")
        answer(question, image, model or DEMO_MODEL_DIR, profile, set_ or [], backend, max_tokens, temperature,
               top_p, seed, stream, on_oversize, as_json, trust_remote_code, engines, max_thinking_tokens)


def answer(question, images, model, profile, overrides, backend, max_tokens, temperature, top_p, seed,
           stream, on_oversize, as_json, trust_remote_code, engines_root=None, max_thinking_tokens=None) -> None:
    from edgeinfer.backends.registry import require_backend
    from edgeinfer.engine import Engine, SamplingParams
    from edgeinfer.preflight import check_text, prepare_images

    check_text(question, "question")
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              max_thinking_tokens=max_thinking_tokens)
    require_backend(backend)
    device_profile = one_question_profile(profile, overrides)
    started = time.perf_counter()
    prepared = prepare_images(images, image_rules_before_load(model, device_profile, trust_remote_code),
                              on_oversize)
    preflight_s = time.perf_counter() - started
    engine = Engine.load(model, profile=device_profile, backend=backend, trust_remote_code=trust_remote_code,
                         engines_root=engines_root)
    for item in prepared:
        if item.report.action != "none" and not as_json:
            typer.echo(f"note: {item.report.describe()}", err=True)
    if stream is None:
        stream = sys.stdout.isatty() and not as_json
    if stream and not as_json:
        for delta in engine.stream(question, prepared, sampling):
            typer.echo(delta, nl=False)
        typer.echo()
        return
    result = engine.generate(question, prepared, sampling)
    if not as_json:
        typer.echo(result.text)
        return
    report = result.to_dict()
    report["timings"] = {"preflight_s": preflight_s, **report["timings"]}
    if engine.load_timings is not None:
        report["timings"]["load"] = engine.load_timings.to_dict()
    report["preflight"] = [item.report.to_dict() for item in prepared]
    ran = engine.engines
    report.update(model=str(model), backend=ran.backend, precision=ran.precision, profile=engine.config.profile_name,
                  stale_engines=list(ran.passed_over))
    typer.echo(json.dumps(report, indent=2))


# One question: its graphs are captured when its request first needs them. Capturing every batch,
# width and sampler bucket at load (the profile's capture_budget_s, there for a daemon) would make
# the one answer wait for graphs it never replays. A --set of the field still wins.
ONE_QUESTION_CAPTURE = "runtime.capture_budget_s=0"


def one_question_profile(profile, overrides) -> DeviceProfile:
    """The profile ``edgeinfer run`` loads: the chosen one with :data:`ONE_QUESTION_CAPTURE`, then ``overrides``."""
    return load_profile(None if profile in (None, "auto") else str(profile), [ONE_QUESTION_CAPTURE, *overrides])


def image_rules_before_load(model, device_profile, trust_remote_code: bool) -> ImageRules:
    """The rules ``Engine.image_rules`` will apply, from the checkpoint's processor files alone (no weights)."""
    from edgeinfer.models.loader import read_checkpoint

    checkpoint, adapter = read_checkpoint(model, trust_remote_code)
    limits = adapter(checkpoint).image_limits()
    return ImageRules.from_profile(device_profile.images, model_max_side=limits.get("max_side"),
                                   model_max_pixels=limits.get("max_pixels"),
                                   model_min_side=limits.get("min_side"))
