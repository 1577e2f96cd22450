"""Building the workers' C kernels (workers/native_build.py): a library's name hashes its
source and the headers it includes, so an edited header is built again; a missing compiler and
a failed compile are errors that say what went wrong."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from raydix.workers import native_build

SOURCE = '#include "answer.h"\nvoid answer(int *out) { *out = ANSWER; }\n'


def _answer(lib: ctypes.CDLL) -> int:
    out = ctypes.c_int(0)
    lib.answer(ctypes.byref(out))
    return out.value


def test_an_edited_header_builds_a_new_library(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_build, "INCLUDE_DIR", tmp_path)
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    (tmp_path / "answer.h").write_text("#define ANSWER 41\n")
    cache = tmp_path / "cache"
    first = native_build.build(source, {}, cache)
    assert native_build.build(source, {}, cache) == first  # nothing changed: the same file
    assert _answer(native_build.load(source, {}, {"answer": [ctypes.c_void_p]}, cache)) == 41
    (tmp_path / "answer.h").write_text("#define ANSWER 42\n")
    second = native_build.build(source, {}, cache)
    assert second != first
    assert _answer(ctypes.CDLL(str(second))) == 42


def test_no_compiler_and_a_failed_compile_say_why(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int broken( {\n")
    with pytest.raises(native_build.NativeBuildError, match="expected"):
        native_build.build(source, {}, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is kept
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(native_build.NativeBuildError, match="no-such-cc"):
        native_build.build(source, {}, tmp_path / "cache")
