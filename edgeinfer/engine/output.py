"""From generated tokens to what a caller reads: incremental text, stop conditions, results.

The text of a sequence is its answer: for models that think, the tokens of its thinking
spans are its reasoning, handed out apart (``GenerationResult.reasoning``). The answer is
decoded on demand (once per new token at most) and handed out in deltas that hold back
what a stop string could still cut and a split UTF-8 character.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from edgeinfer.engine.sequence import FinishReason, Sequence, Status


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    cache: dict[str, int]
    reasoning: str | None = None  # the text of the thinking spans, for models that think (``text`` is the answer)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "answer": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
            "usage": self.usage, "timings": self.timings, "cache": self.cache,
        }
        return out if self.reasoning is None else out | {"reasoning": self.reasoning}


@dataclass
class _TextState:
    text: str = ""
    decoded: int = 0  # tokens ``text`` was decoded from
    emitted: int = 0
    stopped: bool = False


class Output:
    """Each live sequence's text, from :meth:`start` until :meth:`result` hands it out."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, _TextState] = {}

    def start(self, seq: Sequence) -> None:
        self._text[seq.seq_id] = _TextState()

    def accept(self, seq: Sequence, token: int) -> FinishReason | None:
        """Append ``token`` to ``seq``; returns why ``seq`` ends with it, or None. A stop string
        cuts the text where it starts."""
        params = seq.sampling
        seq.generated.append(token)
        if seq.thinking is not None:
            seq.thinking.accept(token)
        if seq.timings.first_token is None:
            seq.timings.first_token = time.perf_counter()
        state = self._text[seq.seq_id]
        if params.stop:  # only stop strings need the text at every token
            self._decoded(seq)
        if token in seq.stop_token_ids:
            return FinishReason.STOP
        if params.stop and any(s in state.text for s in params.stop) and len(seq.generated) >= params.min_new_tokens:
            cut = min(state.text.find(s) for s in params.stop if s in state.text)
            state.text, state.stopped = state.text[:cut], True
            return FinishReason.STOP
        if len(seq.generated) >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def text_delta(self, seq: Sequence) -> str:
        """New text of ``seq`` since the last call, holding back what a stop string could still cut."""
        state = self._decoded(seq)
        safe = len(state.text)
        if seq.status is not Status.FINISHED:
            safe -= max((len(s) - 1 for s in seq.sampling.stop), default=0)
            while safe > state.emitted and state.text[safe - 1] == "\ufffd":
                safe -= 1  # an incomplete UTF-8 character
        delta = state.text[state.emitted:max(safe, state.emitted)]
        state.emitted += len(delta)
        return delta

    def result(self, seq: Sequence) -> GenerationResult:
        """``seq``'s answer so far (its text state is dropped: call once, at its end)."""
        state = self._decoded(seq) if seq.seq_id in self._text else _TextState()
        self._text.pop(seq.seq_id, None)
        t = seq.timings
        timings = {
            "wake_s": t.wake_s, "wake_capture_s": t.wake_capture_s, "vision_s": t.vision_s, "prefill_s": t.prefill_s,
            "ttft_s": t.ttft_s,
            "total_s": (t.finished or time.perf_counter()) - t.created,
            "decode_tokens_per_s": t.decode_tokens_per_s(len(seq.generated)),
        }
        usage = {"prompt_tokens": seq.prompt_len, "image_tokens": seq.image_tokens,
                 "completion_tokens": len(seq.generated), "total_tokens": seq.num_tokens}
        cache = {"prefix_tokens_reused": seq.prefix_tokens_reused, "vision_reused": seq.vision_reused,
                 "spilled_blocks": seq.spilled_blocks, "restored_blocks": seq.restored_blocks,
                 "recomputed_blocks": seq.recomputed_blocks}
        reason = seq.finish_reason.value if seq.finish_reason else "running"
        return GenerationResult(state.text.strip(), list(seq.generated), reason, usage, timings, cache,
                                self._reasoning(seq))

    def _reasoning(self, seq: Sequence) -> str | None:
        """The text thought inside ``seq``'s thinking spans; None where it thought nothing."""
        thinking = seq.thinking
        if thinking is None or not (thinking.reasoning_ids or thinking.spent):
            return None
        return self.tokenizer.decode(thinking.reasoning_ids, skip_special_tokens=True).strip()

    def _decoded(self, seq: Sequence) -> _TextState:
        """``seq``'s text state, decoded up to its last token (once per new token, on demand: a
        decode of the whole answer at every token would cost more than a GPU decode step)."""
        state = self._text[seq.seq_id]
        answer = seq.generated if seq.thinking is None else seq.thinking.answer_ids  # thinking is not the answer
        if not state.stopped and state.decoded != len(answer):
            state.text = self.tokenizer.decode(answer, skip_special_tokens=True)
            state.decoded = len(answer)
        return state
