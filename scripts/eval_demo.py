#!/usr/bin/env python3
"""Measure the demo model on a held-out synthetic set, per question type.

    python scripts/eval_demo.py --seed 1234 --n 600 --engine transformers
    python scripts/eval_demo.py --engine edgeinfer --json eval.json
    python scripts/eval_demo.py --engine cli --json eval-cli.json   # through `edgeinfer run --json`
    python scripts/eval_demo.py --backend onnxruntime --set build.precision=int8

The held-out set comes from ``synthetic.held_out(seed, n)``: question types in turn,
so each gets ``n / 7`` questions, drawn from a seed the training stream never uses.
Answers are decoded greedily; a prediction is right when, lower-cased and stripped of
surrounding spaces and punctuation, it equals the expected one-word answer.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.demo import DEMO_MODEL_DIR, synthetic  # noqa: E402

EngineName = Literal["edgeinfer", "cli", "transformers"]
ENGINES: tuple[EngineName, ...] = ("edgeinfer", "cli", "transformers")

Answerer = Callable[[Image.Image, str], str]


@dataclass(slots=True)
class TypeScore:
    n: int = 0
    correct: int = 0
    errors: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def normalized(text: str) -> str:
    return text.strip().strip(string.punctuation + " ").lower()


def transformers_answerer(model_dir: Path, max_new_tokens: int) -> Answerer:
    """Greedy answers from ``LlavaForConditionalGeneration.generate`` through the checkpoint's own processor."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()

    def answer(image: Image.Image, question: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(images=image, text=prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    return answer


def edgeinfer_answerer(model_dir: Path, max_new_tokens: int, backend: str = "torch",
                       overrides: tuple[str, ...] = ()) -> Answerer:
    """Greedy answers from edgeinfer's own engine (CPU profile; ``backend`` and ``--set`` overrides)."""
    from edgeinfer import Engine, SamplingParams

    engine = Engine.load(str(model_dir), profile="cpu", backend=backend, overrides=list(overrides))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    def answer(image: Image.Image, question: str) -> str:
        return engine.generate(question, images=[image], sampling=sampling).text

    return answer


def cli_answerer(model_dir: Path, max_new_tokens: int) -> Answerer:
    """The ``answer`` of ``edgeinfer run --json``, the command itself invoked in this process.

    Each question is a whole run: the picture written to a PNG (lossless, so the
    command reads the same pixels), the model loaded, preflight, generation, JSON.
    """
    import tempfile

    from typer.testing import CliRunner

    from edgeinfer.cli.main import app

    runner = CliRunner()
    folder = Path(tempfile.mkdtemp(prefix="edgeinfer-eval-"))

    def answer(image: Image.Image, question: str) -> str:
        path = folder / "picture.png"
        image.save(path)
        result = runner.invoke(app, ["run", "--model", str(model_dir), "--profile", "cpu", "--backend", "torch",
                                     "--max-tokens", str(max_new_tokens), "--temperature", "0", "--no-stream",
                                     "--json", "--image", str(path), question])
        if result.exit_code != 0:
            raise RuntimeError(f"edgeinfer run exited {result.exit_code}: {result.output.strip()}")
        return json.loads(result.stdout)["answer"]

    return answer


ANSWERERS: dict[EngineName, Callable[[Path, int], Answerer]] = {
    "edgeinfer": edgeinfer_answerer,
    "cli": cli_answerer,
    "transformers": transformers_answerer,
}


def evaluate(answer: Answerer, samples: list[synthetic.Sample], progress: bool,
             answers: list[str] | None = None) -> dict[str, TypeScore]:
    """Score ``answer`` on ``samples`` per question type; every raw answer appended to ``answers``."""
    scores = {q: TypeScore() for q in synthetic.QTYPES}
    if progress:
        from rich.progress import track

        iterator = track(samples, description="answering", transient=True)
    else:
        iterator = samples
    for index, sample in enumerate(iterator):
        predicted = answer(sample.image, sample.question)
        if answers is not None:
            answers.append(predicted)
        score = scores[sample.qtype]
        score.n += 1
        if normalized(predicted) == sample.answer:
            score.correct += 1
        else:
            score.errors.append({"index": index, "question": sample.question, "expected": sample.answer,
                                 "predicted": predicted})
    return {q: s for q, s in scores.items() if s.n}


def overall(scores: dict[str, TypeScore]) -> TypeScore:
    total = TypeScore()
    for score in scores.values():
        total.n += score.n
        total.correct += score.correct
    return total


def print_table(scores: dict[str, TypeScore], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column, justify in (("type", "left"), ("questions", "right"), ("correct", "right"), ("accuracy", "right")):
        table.add_column(column, justify=justify)
    for qtype, score in scores.items():
        table.add_row(qtype, str(score.n), str(score.correct), f"{score.accuracy:.1%}")
    total = overall(scores)
    table.add_section()
    table.add_row("all", str(total.n), str(total.correct), f"{total.accuracy:.1%}", style="bold")
    Console().print(table)


def report(scores: dict[str, TypeScore], answers: list[str], args: argparse.Namespace, seconds: float) -> dict:
    total = overall(scores)
    return {
        "engine": args.engine, "backend": args.backend, "overrides": args.overrides, "model": "edgeinfer/demo_model" if args.model == DEMO_MODEL_DIR else str(args.model),
        "seed": args.seed, "n": total.n,
        "seconds": round(seconds, 2),
        "overall": {"n": total.n, "correct": total.correct, "accuracy": round(total.accuracy, 4)},
        "per_type": {q: {"n": s.n, "correct": s.correct, "accuracy": round(s.accuracy, 4)} for q, s in scores.items()},
        "errors": {q: s.errors for q, s in scores.items() if s.errors},
        "answers": answers,
    }


def agreement(answers: list[str], other: dict) -> tuple[int, list[int]]:
    """How many answers equal ``other``'s (an earlier ``--json`` on the same set), and where they differ."""
    theirs = other["answers"]
    if len(theirs) != len(answers):
        raise SystemExit(f"--agree-with holds {len(theirs)} answers, this run {len(answers)}: not the same set")
    differ = [i for i, (a, b) in enumerate(zip(answers, theirs)) if normalized(a) != normalized(b)]
    return len(answers) - len(differ), differ


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1234, help="seed of the held-out set")
    parser.add_argument("--n", type=int, default=600, help="number of questions")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="checkpoint folder")
    parser.add_argument("--engine", choices=ENGINES, default="edgeinfer")
    parser.add_argument("--backend", default="torch", help="edgeinfer engine's backend: torch or onnxruntime")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="profile override for the edgeinfer engine, e.g. build.precision=int8 (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit 1 when the overall accuracy is below this (0-1)")
    parser.add_argument("--agree-with", type=Path, default=None,
                        help="an earlier --json of the same seed and n: count the answers both give alike")
    parser.add_argument("--show-errors", type=int, default=5, help="wrong answers to print")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    samples = synthetic.held_out(args.seed, args.n)
    if args.engine == "edgeinfer":
        answer = edgeinfer_answerer(args.model, args.max_new_tokens, args.backend, tuple(args.overrides))
    elif args.backend != "torch" or args.overrides:
        raise SystemExit("--backend and --set apply to --engine edgeinfer")
    else:
        answer = ANSWERERS[args.engine](args.model, args.max_new_tokens)
    started = time.perf_counter()
    answers: list[str] = []
    scores = evaluate(answer, samples, progress=sys.stderr.isatty(), answers=answers)
    seconds = time.perf_counter() - started
    print_table(scores, f"{args.engine} on {args.model.name}, seed {args.seed}, {len(samples)} questions "
                        f"({seconds / len(samples) * 1000:.0f} ms each)")
    result = report(scores, answers, args, seconds)
    wrong = [e | {"type": q} for q, errors in result["errors"].items() for e in errors]
    for error in wrong[: args.show_errors]:
        print(f"  wrong [{error['type']}] {error['question']!r}: expected {error['expected']!r}, "
              f"got {error['predicted']!r}")
    if args.agree_with:
        other = json.loads(args.agree_with.read_text())
        same, differ = agreement(answers, other)
        result["agreement"] = {"with": other.get("engine"), "same": same, "n": len(answers), "differ": differ}
        print(f"agreement with {other.get('engine')} ({args.agree_with}): {same}/{len(answers)} answers alike"
              + (f"; differ at {differ[:20]}" if differ else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.min_accuracy is not None:
        if overall(scores).accuracy < args.min_accuracy:
            print(f"overall accuracy {overall(scores).accuracy:.1%} is below {args.min_accuracy:.0%}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
