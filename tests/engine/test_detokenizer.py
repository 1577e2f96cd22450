"""Incremental detokenization: whole characters only, stop strings on text."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from raydix.engine.detokenizer import IncrementalDetokenizer


class ByteDecoder:
    """Token i is byte i; decoding is UTF-8 with U+FFFD for incomplete characters."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def _run(text: str, stop: Sequence[str] = ()) -> tuple[list[str], bool, str]:
    detok = IncrementalDetokenizer(ByteDecoder(), list(b"prompt: "), stop)
    pieces = []
    hit = False
    for byte in text.encode():
        piece, hit = detok.add(byte)
        pieces.append(piece)
        if hit:
            break
    if not hit:
        pieces.append(detok.flush())
    return pieces, hit, detok.text


def test_multibyte_characters_are_never_split() -> None:
    pieces, hit, text = _run("añ€😀!")
    assert not hit
    assert "".join(pieces) == "añ€😀!" == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["a", "", "ñ"]  # ñ is two bytes: nothing until both arrive


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(["lo w"], "hel"), (["o", "xyz"], "hell"), (["€"], "a "), (["zzz"], "hello world a € b")],
)
def test_stop_strings_match_across_token_boundaries(stop: list[str], expected: str) -> None:
    source = "hello world a € b" if stop != ["€"] else "a € b"
    pieces, hit, text = _run(source, stop)
    assert hit == (stop != ["zzz"])
    assert "".join(pieces) == expected == text  # nothing past the stop string ever left


def test_text_is_held_back_only_while_it_may_start_a_stop_string() -> None:
    detok = IncrementalDetokenizer(ByteDecoder(), [], ["END"])
    out = [detok.add(b)[0] for b in b"abcE"]
    assert "".join(out) == "abc"  # "E" might still become "END"
    assert detok.add(ord("N")) == ("", False)
    assert detok.add(ord("X")) == ("ENX", False)  # "ENX" can no longer
    assert detok.flush() == ""
