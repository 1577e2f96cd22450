"""The output processor: text once per token, stop strings end a request and cut what the core
computed after them, and the final usage counts only the tokens kept."""

from __future__ import annotations

from collections.abc import Sequence

from raydix.engine.output_processor import RequestOutputProcessor
from raydix.engine.request import FinishReason, GenerationParams, RequestOutput, Usage
from raydix.workers.step import SamplingParams


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


class CountingDecoder(ByteDecoder):
    """Records the ids decoded as logprob texts: one id, special tokens kept (the HF default,
    as OpenAI's logprob tokens); the text stream decodes with skip_special_tokens=True."""

    def __init__(self) -> None:
        self.single_ids: list[int] = []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if len(token_ids) == 1 and not skip_special_tokens:
            self.single_ids.append(token_ids[0])
        return super().decode(token_ids, skip_special_tokens)


def _top_out(tokens: bytes, tops: list[bytes], done: int) -> RequestOutput:
    return _out(tokens, done)._replace(top_logprobs=tuple(
        tuple((t, -1.0 - k) for k, t in enumerate(top)) for top in tops))


def test_logprob_texts_are_each_token_alone_decoded_once_per_id() -> None:
    decoder = CountingDecoder()
    params = GenerationParams(SamplingParams(return_logprob=True, top_logprobs=2),
                              stop_strings=("xy",))
    proc = RequestOutputProcessor(decoder, list(b"Q"), params)
    first = proc.process(_top_out(b"ab", [b"ab", b"ba"], 2))
    assert first is not None
    assert first.token_texts == ("a", "b")
    assert first.top_token_texts == (("a", "b"), ("b", "a"))
    second = proc.process(_top_out(b"cxyz", [b"ca", b"xa", b"yb", b"zc"], 6))
    assert second is not None and second.finish_reason is FinishReason.STOP
    # cut at the stop string with the tokens: "z" came after it
    assert second.token_texts == ("c", "x", "y")
    assert second.top_token_texts == (("c", "a"), ("x", "a"), ("y", "b"))
    assert sorted(decoder.single_ids) == sorted(b"abcxy")  # each id once, never again


def test_no_logprob_texts_without_logprobs() -> None:
    decoder = CountingDecoder()
    proc = RequestOutputProcessor(decoder, [], GenerationParams())
    out = proc.process(_top_out(b"ab", [b"ab", b"ba"], 2))
    assert out is not None and out.token_texts == () and out.top_token_texts == ()
    assert decoder.single_ids == []
