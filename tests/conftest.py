"""Fixtures of every test package: the default model, converted once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model (SmolLM2-135M-Instruct), converted from its packaged GGUF once per
    session: tests/deploy, tests/engine and tests/workers share the folder (each conversion
    takes 10-20 s on 2 cores)."""
    from raydix.workers.gguf_convert import convert_gguf, find_packaged_gguf

    return convert_gguf(find_packaged_gguf(), tmp_path_factory.mktemp("raydix-cache"),
                        show_progress=False)
