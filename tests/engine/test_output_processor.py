"""The output processor: text once per token, stop strings end a request and cut what the core
computed after them, and the final usage counts only the tokens kept."""

from __future__ import annotations

from collections.abc import Sequence

from raydix.engine.output_processor import RequestOutputProcessor
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput, Usage


class ByteDecoder:
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def _out(tokens: bytes, done: int, reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", tuple(tokens), "", reason, Usage(3, 0, done),
                         tuple(-0.5 for _ in tokens))


def test_stop_string_ends_the_request_and_drops_later_tokens() -> None:
    proc = RequestOutputProcessor(ByteDecoder(), list(b"Q: "), GenerationParams(
        stop_strings=("END",)))
    texts = [proc.process(_out(bytes([b]), i + 1)) for i, b in enumerate(b"okE")]
    assert [o.text for o in texts if o is not None] == ["o", "k", ""]  # "E" could start END
    final = proc.process(_out(b"N", 4))
    assert final is not None and final.text == ""
    final = proc.process(_out(b"D", 5))
    assert final is not None
    assert (final.finish_reason, final.text, final.new_token_ids) == (FinishReason.STOP, "", (68,))
    assert final.usage.completion_tokens == 5 and final.logprobs == (-0.5,)
    assert proc.finished and proc.stopped_early  # the core still runs it: abort it
    assert proc.process(_out(b"x", 6)) is None  # computed after the stop: dropped


def test_core_finish_flushes_the_held_text() -> None:
    proc = RequestOutputProcessor(ByteDecoder(), [], GenerationParams(stop_strings=("ab",)))
    first = proc.process(_out(b"a", 1))
    assert first is not None and first.text == ""  # held: "a" could start "ab"
    final = proc.process(_out(b"", 1, FinishReason.LENGTH))
    assert final is not None and final.text == "a" and final.finish_reason is FinishReason.LENGTH
    assert proc.finished and not proc.stopped_early


def test_multibyte_characters_are_emitted_whole() -> None:
    proc = RequestOutputProcessor(ByteDecoder(), [], GenerationParams())
    pieces = [proc.process(_out(bytes([b]), 1)) for b in "é!".encode()]
    assert [p.text for p in pieces if p is not None] == ["", "é", "!"]
