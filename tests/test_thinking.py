"""The thinking cap: a reasoning variant's thinking span closes after ``max_thinking_tokens``
and the answer follows, apart from the reasoning.

The tiny Qwen3-VL checkpoint with thinking tags (``make_qwen3_vl(thinking=True)``) has the
Thinking variant's template: the generation prompt ends with ``<think>``, so a span is open
from the first generated token.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from typer.testing import CliRunner

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.errors import RequestError
from tests.conftest import noise_image
from tests.test_family_qwen2_vl import hf_generate, hf_inputs

FAMILY = "qwen3_vl_thinking"
QUESTION = "what is in the image ?"
IMAGES = [noise_image(120, 80, seed=1)]
NEW = 24  # every answer here is this long: min_new_tokens keeps the stop tokens away


def params(cap: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, max_thinking_tokens=cap, **kw)


def load(path) -> Engine:
    return Engine.load(path, config=EngineConfig(block_size=16, num_blocks=128))


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return load(checkpoint(FAMILY))


@pytest.fixture(scope="module")
def markers(engine) -> tuple[int, int]:
    ids = engine.adapter.thinking_token_ids()
    assert ids is not None
    return ids


@pytest.fixture(scope="module")
def uncapped(engine) -> list[int]:
    return engine.generate(QUESTION, IMAGES, params(None)).token_ids


def test_the_prompt_opens_the_span(engine, markers):
    seq = engine.submit(QUESTION, IMAGES, params(4))
    assert seq.prompt_ids[-1] == markers[0]
    assert seq.thinking is not None and seq.thinking.open


@pytest.mark.parametrize("cap", [0, 3, 7])
def test_the_cap_closes_the_span_at_exactly_n_tokens_and_the_answer_follows(checkpoint, engine, markers, uncapped,
                                                                           cap):
    start, end = markers
    assert end not in uncapped[:cap + 1], "the model must not close the span by itself here"
    result = engine.generate(QUESTION, IMAGES, params(cap))
    tokens = result.token_ids
    assert tokens[:cap] == uncapped[:cap]  # the thinking, untouched
    assert tokens[cap] == end  # closed by the runtime after exactly ``cap`` thinking tokens
    assert len(tokens) == NEW

    # The answer is the model's own continuation after the closed span, as transformers gives it.
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(checkpoint(FAMILY)).eval()
    prompt = engine.submit(QUESTION, IMAGES, params(cap)).prompt_ids + tokens[:cap + 1]
    answer = tokens[cap + 1:]
    # The random model may open a second span in its answer: the cap is spent, so it closes at once.
    reopened = answer.index(start) + 1 if start in answer[:-1] else len(answer)
    assert answer[:reopened] == hf_generate(hf, hf_inputs(engine, prompt, IMAGES), new_tokens=NEW - cap - 1)[:reopened]
    if reopened < len(answer):
        assert answer[reopened] == end

    tok = engine.adapter.tokenizer
    assert result.text == tok.decode(tokens[cap + 1:], skip_special_tokens=True).strip()
    assert result.reasoning == (tok.decode(tokens[:cap], skip_special_tokens=True).strip() if cap else None)
    assert result.to_dict().get("reasoning") == result.reasoning


def test_capped_and_uncapped_rows_decode_together(engine, markers, uncapped):
    seqs = [engine.submit(QUESTION, IMAGES, params(5)), engine.submit(QUESTION, IMAGES, params(None))]
    capped, free = engine.run_until_done(seqs)
    assert capped.token_ids[5] == markers[1] and capped.token_ids[:5] == uncapped[:5]
    assert free.token_ids == uncapped
    assert free.text == "" and free.reasoning  # never closed: all of it is reasoning


def test_a_model_without_thinking_tokens_refuses_the_cap(checkpoint):
    engine = load(checkpoint("qwen3_vl"))
    assert engine.adapter.thinking_token_ids() is None
    with pytest.raises(RequestError, match="thinking tokens"):
        engine.submit(QUESTION, IMAGES, params(4))
    plain = engine.generate(QUESTION, IMAGES, params(None))
    assert plain.reasoning is None and "reasoning" not in plain.to_dict()


def test_a_negative_cap_is_refused():
    with pytest.raises(RequestError, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=-1)


def test_the_cli_takes_the_cap(checkpoint, markers, tmp_path):
    from edgeinfer.cli.main import app

    picture = tmp_path / "picture.png"
    IMAGES[0].save(picture)
    out = CliRunner().invoke(app, ["run", QUESTION, "--model", str(checkpoint(FAMILY)), "--image", str(picture),
                                   "--max-tokens", "12", "--max-thinking-tokens", "2", "--backend", "torch",
                                   "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["token_ids"][2] == markers[1] and "reasoning" in report


def test_the_api_returns_the_reasoning_apart(checkpoint, markers):
    from edgeinfer.profiles import load_profile
    from edgeinfer.server import ServerSettings
    from tests.test_server import BASE_OVERRIDES, running_server

    settings = ServerSettings(model_dir=checkpoint(FAMILY), profile=load_profile("cpu", BASE_OVERRIDES),
                              backend="torch")
    engine = load(checkpoint(FAMILY))
    expected = engine.generate("describe this picture", [], SamplingParams(max_new_tokens=10, max_thinking_tokens=3))
    with running_server(settings) as url:
        body = {"messages": [{"role": "user", "content": "describe this picture"}], "max_tokens": 10,
                "max_thinking_tokens": 3}
        message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        refused = httpx.post(f"{url}/v1/chat/completions", json=body | {"max_thinking_tokens": -1}, timeout=60)
    assert message["reasoning_content"] == expected.reasoning
    assert message["content"] == expected.text
    assert refused.status_code in (400, 422)
    assert torch.tensor(expected.token_ids)[3].item() == markers[1]
