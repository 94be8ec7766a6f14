#!/usr/bin/env python3
"""Train the embedded demo model: a tiny LLaVA that answers questions about synthetic pictures.

    python scripts/train_demo_model.py --seed 0 --device auto --steps 3000 --out edgeinfer/demo_model

Sample ``i`` of a run is ``synthetic.sample_at(seed, i)``; step ``s`` trains on samples
``s*B .. s*B+B-1``. The data therefore depends on the seed and the batch size only,
not on how many loader workers draw it, and the weights are initialised from the same
seed, so a run is repeatable (bit for bit on CPU; on CUDA up to the GPU's reduction
order). The loss counts the answer tokens and the closing ``</s>`` only.

``--time-budget`` guards a run on a lent machine: during warm-up, whose learning rate
does not depend on the step count, the script measures its speed and lowers ``--steps``
to fit. The step count it settles on is printed and written to the model card; passing
it as ``--steps`` repeats the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from typing import NamedTuple
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # loader workers are forked processes

from edgeinfer.demo import recipe, synthetic  # noqa: E402

BOS_DROP_RATE = 0.1  # a few prompts without <s>, so a caller that forgets it still gets answers
VALIDATION_SEED_OFFSET = 7_919  # validation stream = seed + this; the eval script uses its own seed
VALIDATION_SIZE = 350
PADDED_LENGTH = 96  # every training batch has this many positions, so drawn batches can be mixed


@dataclass(frozen=True, slots=True)
class TrainConfig:
    seed: int
    steps: int
    batch_size: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    echo: int
    window: int
    workers: int
    device: str
    threads: int
    time_budget: float | None
    validate_every: int
    dense_weight: float

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.echo, self.window) < 1:
            raise ValueError("steps, batch size, echo and window must be positive")
        if self.warmup_steps < 20:
            raise ValueError("warm-up must be at least 20 steps: the time budget is planned inside it")


# --- data ----------------------------------------------------------------------------

def encode(tokenizer, question: str, answer: str, image_tokens: int, with_bos: bool) -> tuple[list[int], int]:
    """Token ids of the chat prompt with the image expanded, then the answer and ``</s>``.

    Returns the ids and where the answer starts. The prompt goes through the chat
    template exactly as at inference.
    """
    ids = list(_prompt_ids(tokenizer, question, image_tokens))
    if not with_bos and ids[0] == tokenizer.bos_token_id:
        ids = ids[1:]
    answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids + answer_ids, len(ids)


@lru_cache(maxsize=4096)
def _prompt_ids(tokenizer, question: str, image_tokens: int) -> tuple[int, ...]:
    # Questions come from a few hundred templates: render and tokenize each once per process.
    prompt = tokenizer.apply_chat_template(recipe.user_turn(question), add_generation_prompt=True, tokenize=False)
    prompt = prompt.replace(recipe.IMAGE, recipe.IMAGE * image_tokens)
    return tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])


class Item(NamedTuple):
    pixels: np.ndarray  # uint8 [H, W, 3] at the model's size
    ids: list[int]  # prompt, answer, </s>
    start: int  # where the answer starts in ids
    qtype: str
    targets: dict[str, np.ndarray] | None  # per-patch classes, see synthetic.patch_targets


def make_item(sample: synthetic.Sample, scene: synthetic.Scene | None, spec: recipe.DemoSpec, tokenizer,
              with_bos: bool = True) -> Item:
    ids, start = encode(tokenizer, sample.question, sample.answer, spec.image_tokens, with_bos)
    targets = synthetic.patch_targets(scene, spec.image_size // spec.patch_size) if scene else None
    return Item(recipe.pixels(sample.image, spec), ids, start, sample.qtype, targets)


class SyntheticStream(Dataset):
    """Item ``i`` of stream ``seed``, with its per-patch targets."""

    def __init__(self, seed: int, spec: recipe.DemoSpec, tokenizer) -> None:
        self.seed, self.spec, self.tokenizer = seed, spec, tokenizer

    def __len__(self) -> int:
        return 2**31

    def __getitem__(self, index: int) -> Item:
        sample, scene = synthetic.annotated_at(self.seed, index)
        with_bos = random.Random(f"bos:{self.seed}:{index}").random() >= BOS_DROP_RATE
        return make_item(sample, scene, self.spec, self.tokenizer, with_bos)


def collate(items, pad_id: int, length: int | None = None):
    """Right-padded batch; ``labels[b, t]`` is the token at ``t + 1`` where that is an answer token, else -100.

    ``length`` fixes the padded length (batches of one shape can be mixed); by default
    the longest sequence sets it.
    """
    longest = max(len(item.ids) for item in items)
    length = length or longest
    if longest > length:
        raise ValueError(f"a sequence of {longest} tokens does not fit the padded length {length}")
    input_ids = torch.full((len(items), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(items), length), dtype=torch.long)
    labels = torch.full((len(items), length), -100, dtype=torch.long)
    for b, item in enumerate(items):
        input_ids[b, : len(item.ids)] = torch.tensor(item.ids)
        attention[b, : len(item.ids)] = 1
        labels[b, item.start - 1 : len(item.ids) - 1] = torch.tensor(item.ids[item.start:])
    batch = {"pixels": torch.from_numpy(np.stack([item.pixels for item in items])), "input_ids": input_ids,
             "attention_mask": attention, "labels": labels, "qtypes": [item.qtype for item in items]}
    if all(item.targets is not None for item in items):
        for key in DENSE_KEYS:
            batch[key] = torch.from_numpy(np.stack([item.targets[key] for item in items]))
    return batch


class PixelNormalizer:
    """uint8 ``[B, H, W, 3]`` on the device to the processor's normalized ``[B, 3, H, W]``."""

    def __init__(self, device: torch.device) -> None:
        self.mean = torch.tensor(recipe.CLIP_MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(recipe.CLIP_STD, device=device).view(1, 3, 1, 1)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        scaled = pixels.permute(0, 3, 1, 2).float() / 255.0
        return (scaled - self.mean) / self.std


# --- model and optimisation ----------------------------------------------------------

def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    return torch.device(choice)


def make_optimizer(modules: list[torch.nn.Module], config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98), eps=1e-8, fused=device.type == "cuda")


def learning_rate(step: int, total: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``total``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# --- the dense auxiliary loss ------------------------------------------------------------
# A ViT trained from scratch through the answer token alone learns to recognise shapes
# and glyphs very slowly: one target per picture reaches its patches only through the
# text model's attention, which starts out uniform. Per-patch targets (what each patch
# shows) give every patch its own signal, so the tower's features become semantic early
# and the text model has something to attend to. The heads are dropped after training.

DENSE_KEYS = ("kind", "color", "text", "centre")


class DenseHeads(torch.nn.Module):
    """Linear per-patch classifiers over the vision tower's selected layer."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.sizes = {"kind": len(synthetic.SHAPES) + 1, "color": len(synthetic.COLORS) + 1,
                      "text": len(synthetic.TEXT_CLASSES) + 1, "centre": 2}
        self.proj = torch.nn.Linear(hidden, sum(self.sizes.values()))

    def forward(self, patches: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.sizes, self.proj(patches.float()).split(list(self.sizes.values()), dim=-1)))


class PatchTap:
    """Keeps the patch states the vision tower hands to the projector in the last forward."""

    def __init__(self, model) -> None:
        self.layer = model.config.vision_feature_layer
        self.patches: torch.Tensor | None = None
        model.model.vision_tower.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.patches = output.hidden_states[self.layer][:, 1:]


def dense_loss(heads: DenseHeads, patches: torch.Tensor, batch: dict) -> torch.Tensor:
    logits = heads(patches)
    return sum(torch.nn.functional.cross_entropy(logits[key].flatten(0, 1), batch[key].flatten()) for key in DENSE_KEYS)


def answer_loss(model, batch: dict, pixel_values: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over answer tokens, and per-row whether every answer token was the argmax."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       pixel_values=pixel_values).logits
    labels = batch["labels"].to(device)
    mask = labels != -100
    loss = torch.nn.functional.cross_entropy(logits[mask].float(), labels[mask])
    hit = (logits.argmax(-1) == labels) | ~mask
    return loss, hit.all(dim=1)


@torch.no_grad()
def validate(model, batches: list[dict], normalizer: PixelNormalizer, device: torch.device) -> dict[str, float]:
    """Per-type share of validation questions whose whole answer is the greedy choice (teacher forced)."""
    model.eval()
    right: dict[str, list[bool]] = {q: [] for q in synthetic.QTYPES}
    for batch in batches:
        _, exact = answer_loss(model, batch, normalizer(batch["pixels"].to(device)), device)
        for qtype, ok in zip(batch["qtypes"], exact.tolist()):
            right[qtype].append(ok)
    model.train()
    scores = {q: sum(v) / len(v) for q, v in right.items() if v}
    scores["all"] = sum(sum(v) for v in right.values()) / sum(len(v) for v in right.values())
    return scores


def validation_batches(config: TrainConfig, spec: recipe.DemoSpec, tokenizer) -> list[dict]:
    samples = synthetic.held_out(config.seed + VALIDATION_SEED_OFFSET, VALIDATION_SIZE)
    items = [make_item(sample, None, spec, tokenizer) for sample in samples]
    return [collate(items[i : i + 128], tokenizer.pad_token_id) for i in range(0, len(items), 128)]


class ReplayWindow:
    """The last ``window`` drawn batches, kept on the device; each step trains on a random mix of them.

    Drawing pictures, not the GPU, limits a GPU run, so every drawn batch feeds ``echo``
    steps ("data echoing"). Step ``s`` sees the batches drawn up to ``s // echo`` and
    takes ``batch_size`` of their samples, chosen by a generator seeded from the run's
    seed and ``s``: a sample is used ``echo`` times on average, in different company,
    and the run stays repeatable. With ``echo == 1`` and ``window == 1`` it is plain
    training on each drawn batch once.
    """

    KEYS = ("pixels", "input_ids", "attention_mask", "labels", *DENSE_KEYS)

    def __init__(self, seed: int, batch_size: int, echo: int, window: int, device: torch.device) -> None:
        self.seed, self.batch_size, self.echo, self.window, self.device = seed, batch_size, echo, window, device
        self.slots: dict[str, torch.Tensor] = {}
        self.drawn = 0

    def add(self, batch: dict) -> None:
        slot = self.drawn % self.window
        for key in self.KEYS:
            value = batch[key].to(self.device, non_blocking=True)
            if key not in self.slots:
                self.slots[key] = torch.empty((self.window, *value.shape), dtype=value.dtype, device=self.device)
            self.slots[key][slot] = value
        self.drawn += 1

    def mix(self, step: int) -> dict[str, torch.Tensor]:
        available = min(self.drawn, self.window) * self.batch_size
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picked = torch.randperm(available, generator=generator)[: self.batch_size].to(self.device)
        return {key: value.flatten(0, 1)[picked] for key, value in self.slots.items()}

    def steps(self, loader: DataLoader):
        """Yield (step, batch) forever: a new drawn batch every ``echo`` steps."""
        step = 0
        for batch in loader:
            self.add(batch)
            for _ in range(self.echo):
                yield step, self.mix(step)
                step += 1


def train_step(model, heads: DenseHeads, tap: PatchTap, optimizer: torch.optim.Optimizer, batch: dict,
               normalizer: PixelNormalizer, dense_weight: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the answer loss and the dense loss."""
    loss, _ = answer_loss(model, batch, normalizer(batch["pixels"]), device)
    dense = dense_loss(heads, tap.patches, batch)
    optimizer.zero_grad(set_to_none=True)
    (loss + dense_weight * dense).backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    return loss.detach(), dense.detach()


# --- the run ---------------------------------------------------------------------------

def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def planned_steps(config: TrainConfig, steps_done: int, elapsed: float, since_step: int, since_time: float) -> int:
    """Steps that fit ``time_budget`` at the speed measured since ``since_step``, at most ``config.steps``."""
    rate = (steps_done - since_step) / max(1e-6, elapsed - since_time)
    reserve = 25.0  # saving and the final validation
    affordable = steps_done + int(rate * (config.time_budget - elapsed - reserve))
    return max(config.warmup_steps + 1, min(config.steps, affordable))


def train(config: TrainConfig, spec: recipe.DemoSpec, out: Path) -> None:
    from tqdm import tqdm

    device = pick_device(config.device)
    if device.type == "cpu":
        torch.set_num_threads(config.threads)
    seed_everything(config.seed, device)
    processor = recipe.build_processor(spec)
    tokenizer = processor.tokenizer
    model = recipe.build_model(spec, tokenizer).to(device)
    model.train()
    heads = DenseHeads(spec.vision_hidden).to(device)
    tap = PatchTap(model)
    optimizer = make_optimizer([model, heads], config, device)
    normalizer = PixelNormalizer(device)

    stream = SyntheticStream(config.seed, spec, tokenizer)
    loader = DataLoader(stream, batch_size=config.batch_size, shuffle=False, num_workers=config.workers,
                        collate_fn=partial(collate, pad_id=tokenizer.pad_token_id, length=PADDED_LENGTH),
                        pin_memory=device.type == "cuda", persistent_workers=config.workers > 0,
                        prefetch_factor=4 if config.workers > 0 else None)
    validation = validation_batches(config, spec, tokenizer)

    counts = {"total": sum(p.numel() for p in model.parameters()),
              "vision": sum(p.numel() for p in model.model.vision_tower.parameters()),
              "projector": sum(p.numel() for p in model.model.multi_modal_projector.parameters()),
              "text": sum(p.numel() for p in model.model.language_model.parameters())}
    print(f"device {device}, parameters {counts}, {config.steps} steps of {config.batch_size}", flush=True)

    total = config.steps
    started = time.perf_counter()
    calibrate_from, calibrate_at = 10, max(20, config.warmup_steps // 2)
    calibrate_time = started
    history: list[dict] = []
    bar = tqdm(total=total, desc="train", dynamic_ncols=True, mininterval=2.0, file=sys.stdout)
    replay = ReplayWindow(config.seed, config.batch_size, config.echo, config.window, device)
    step = 0
    for step, batch in replay.steps(loader):
        if step >= total:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, total, config)
        loss, dense = train_step(model, heads, tap, optimizer, batch, normalizer, config.dense_weight, device)
        step += 1

        if step == calibrate_from:
            calibrate_time = time.perf_counter()
        if config.time_budget and step == calibrate_at:
            new_total = planned_steps(config, step, time.perf_counter() - started, calibrate_from,
                                      calibrate_time - started)
            if new_total < total:
                print(f"\nplanned {new_total} steps (not {total}) to fit the {config.time_budget:.0f} s budget; "
                      f"repeat this run with --steps {new_total}", flush=True)
                total = new_total
                bar.total = total
        bar.update(1)
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", dense=f"{dense.item():.3f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        if step % config.validate_every == 0 or step == total:
            scores = validate(model, validation, normalizer, device)
            history.append({"step": step, "loss": round(loss.item(), 5), "dense": round(dense.item(), 4), "seconds": round(time.perf_counter() - started, 1),
                            **{k: round(v, 4) for k, v in scores.items()}})
            bar.write("step {step} loss {loss} dense {dense} ".format(**history[-1])
                      + " ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    bar.close()
    seconds = time.perf_counter() - started

    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").to(torch.float32)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    mark_tokenizer_portable(out)
    summary = {"config": asdict(config) | {"steps": total}, "spec": asdict(spec), "parameters": counts,
               "vocab_size": len(tokenizer), "seconds": round(seconds, 1), "device_name": device_name(device), "history": history,
               "torch": torch.__version__, "python": platform.python_version()}
    write_model_card(out, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1), flush=True)


def mark_tokenizer_portable(out: Path) -> None:
    """Name the tokenizer class by its long-standing alias, which every transformers release resolves."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write_model_card(out: Path, summary: dict) -> None:
    config, spec, counts, last = summary["config"], summary["spec"], summary["parameters"], summary["history"][-1]
    rows = "\n".join(f"| {q} | {last[q]:.3f} |" for q in (*synthetic.QTYPES, "all"))
    card = f"""# edgeinfer demo model

A tiny LLaVA (CLIP vision tower, MLP projector, Llama text model) trained from
scratch on synthetic pictures drawn with Pillow: shapes, colours, counts,
positions, sizes, rendered digits and words. It exists so that `edgeinfer run` has
a real model on a machine with no network; it knows nothing outside that world.

- Architecture: `LlavaForConditionalGeneration`; vision {spec['vision_layers']} layers x {spec['vision_hidden']},
  text {spec['text_layers']} layers x {spec['text_hidden']} ({spec['text_heads']} heads, {spec['text_kv_heads']} KV heads),
  image {spec['image_size']}x{spec['image_size']}, patch {spec['patch_size']}, {spec['image_size'] // spec['patch_size']} x {spec['image_size'] // spec['patch_size']} = {(spec['image_size'] // spec['patch_size']) ** 2} image tokens.
- Parameters: {counts['total']:,} (vision {counts['vision']:,}, projector {counts['projector']:,}, text {counts['text']:,}), float32.
- Tokenizer: word level, {summary.get('vocab_size', 'see tokenizer.json')} tokens, lower-cased; prompt
  `USER: <image>\\n{{question}} ASSISTANT:`, answer then `</s>`.
- Training: seed {config['seed']}, {config['steps']} steps of {config['batch_size']} samples, each drawn batch
  used for {config['echo']} step(s) ({math.ceil(config['steps'] / config['echo']) * config['batch_size']:,} generated samples), AdamW, peak learning rate {config['lr']},
  {config['warmup_steps']} warm-up steps then cosine decay; loss on the answer tokens, plus
  {config['dense_weight']} x a per-patch auxiliary loss on the vision tower (heads dropped after training).
  {summary['seconds']:.0f} s on {summary['device_name']} (torch {summary['torch']}).
- Reproduce: `python scripts/train_demo_model.py --seed {config['seed']} --steps {config['steps']} --batch-size {config['batch_size']} --echo {config['echo']} --window {config['window']} --lr {config['lr']} --warmup-steps {config['warmup_steps']} --dense-weight {config['dense_weight']} --device {config['device']} --out DIR`.

## Validation during training

Teacher-forced exact answers on {VALIDATION_SIZE} questions of seed {config['seed'] + VALIDATION_SEED_OFFSET}, at the last step:

| type | accuracy |
|---|---|
{rows}

## Evaluation

`python scripts/eval_demo.py --seed 1234 --n 600` generates a held-out set from seed 1234
and answers it with greedy decoding; see `docs/demo_model.md` for the numbers.
"""
    (out / "README.md").write_text(card)


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--min-lr-ratio", type=float, default=0.02)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--echo", type=int, default=1,
                        help="optimizer steps per drawn batch (above 1 where drawing, not the GPU, is the limit)")
    parser.add_argument("--window", type=int, default=1,
                        help="drawn batches that steps mix samples from (with --echo above 1)")
    parser.add_argument("--workers", type=int, default=min(15, max(0, (os.cpu_count() or 1) - 1)),
                        help="processes drawing samples (0: draw in the training process)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads when training on the CPU")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds the whole run may take; lowers --steps to fit")
    parser.add_argument("--validate-every", type=int, default=250)
    parser.add_argument("--dense-weight", type=float, default=1.0,
                        help="weight of the per-patch auxiliary loss (0: answer tokens only)")
    parser.add_argument("--out", type=Path, default=Path("edgeinfer/demo_model"))
    args = parser.parse_args(argv)
    config = TrainConfig(seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                         weight_decay=args.weight_decay, echo=args.echo, window=args.window, workers=args.workers, device=args.device,
                         threads=args.threads, time_budget=args.time_budget, validate_every=args.validate_every,
                         dense_weight=args.dense_weight)
    return config, args.out


def main(argv: list[str] | None = None) -> None:
    config, out = parse_args(argv)
    train(config, recipe.DemoSpec(), out)


if __name__ == "__main__":
    main()
