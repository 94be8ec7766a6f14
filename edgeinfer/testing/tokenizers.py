"""A word-level tokenizer built locally, with a family's special tokens."""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "what is in the image describe this picture a an of and color shape how many are there left right top "
    "bottom red green blue yellow circle square triangle big small one two three four five six yes no "
    "User Assistant user assistant system You helpful ? . , : ! ' - ( ) answer question"
).split()


def build_word_tokenizer(vocab_size: int, specials: list[str], *, bos: str | None, eos: str,
                         pad: str = "<pad>", unk: str = "<unk>", add_bos: bool = False,
                         named: dict[str, str] | None = None):
    """A PreTrainedTokenizerFast of exactly ``vocab_size`` entries: specials, common words, fillers.
    ``named`` special tokens become attributes (``tokenizer.<name>``, ``<name>_id``), as a
    family's processor reads them (InternVL's ``context_image_token``; Gemma 3's ``boi_token``,
    ``eoi_token``, ``image_token``), saved with the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    base = [unk, pad, eos] + ([bos] if bos else [])
    ordered = list(dict.fromkeys(base + specials + list(WORDS)))
    if len(ordered) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(ordered)} fixed entries")
    ordered += [f"w{i}" for i in range(vocab_size - len(ordered))]
    vocab = {tok: i for i, tok in enumerate(ordered)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([t for t in base + specials])
    if add_bos and bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
        additional_special_tokens=[s for s in specials if s not in base],
        **({"extra_special_tokens": named} if named else {}),
    )


def save_chat_template(path: Path, template: str) -> None:
    (path / "chat_template.jinja").write_text(template)
