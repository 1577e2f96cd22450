"""`settle_vector_isa`: inductor's ISA probe once per machine (and key), the same answer after."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch._inductor import config, cpu_vec_isa

from raydix.workers import vec_isa
from raydix.workers.vec_isa import RECORD_NAME, settle_vector_isa

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="inductor probes x86 ISAs only")


class Probe:
    """Inductor's probe, replaced: passes `passing` of the candidates, counts its runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, drop: int = 0) -> None:
        self.runs = 0
        self.drop = drop
        monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", self)

    def __call__(self) -> list[object]:
        self.runs += 1
        return vec_isa._candidates()[self.drop:]


@pytest.fixture(autouse=True)
def unset() -> Iterator[None]:
    """Inductor's flag unset, as in a new process; the process's own value back after."""
    before = config.cpp.vec_isa_ok
    config.cpp.vec_isa_ok = None
    yield
    config.cpp.vec_isa_ok = before


def test_a_start_probes_and_records_and_a_later_start_skips_the_probe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Probe(monkeypatch)
    assert "(probed, recorded)" in settle_vector_isa(tmp_path)
    assert probe.runs == 1 and config.cpp.vec_isa_ok is True
    names = [str(isa) for isa in vec_isa._candidates()]
    assert list(json.loads((tmp_path / RECORD_NAME).read_text()).values()) == [names]

    config.cpp.vec_isa_ok = None  # a new process
    assert "(probed before on this machine)" in settle_vector_isa(tmp_path)
    assert probe.runs == 1 and config.cpp.vec_isa_ok is True


def test_an_isa_that_fails_leaves_the_probe_at_every_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Probe(monkeypatch, drop=1)
    for runs in (1, 2):
        assert "passed inductor's probe (run at every start)" in settle_vector_isa(tmp_path)
        assert probe.runs == runs and config.cpp.vec_isa_ok is None
    assert not (tmp_path / RECORD_NAME).exists()


def test_another_compiler_probes_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Probe(monkeypatch)
    settle_vector_isa(tmp_path)
    config.cpp.vec_isa_ok = None
    monkeypatch.setattr(cpu_vec_isa, "_get_isa_dry_compile_fingerprint",
                        lambda flags: f"g++ (another version)={flags}")
    assert "(probed, recorded)" in settle_vector_isa(tmp_path)
    assert probe.runs == 2
    assert len(json.loads((tmp_path / RECORD_NAME).read_text())) == 2  # both keys kept


def test_a_record_that_cannot_be_written_leaves_the_start_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only cache folder: the probe's answer is used (same key as every start's) and
    the next start probes again."""
    probe = Probe(monkeypatch)
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the record's folder would be inside a file: mkdir fails
    for runs in (1, 2):
        assert "not recorded" in settle_vector_isa(blocked / "cache")
        assert probe.runs == runs and config.cpp.vec_isa_ok is True
        config.cpp.vec_isa_ok = None


@pytest.mark.parametrize("users", [True, False])
def test_a_users_setting_is_left_alone(users: bool, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Probe(monkeypatch)
    config.cpp.vec_isa_ok = users
    assert "as set" in settle_vector_isa(tmp_path)
    assert probe.runs == 0 and config.cpp.vec_isa_ok is users


def test_the_recorded_start_picks_what_the_probing_start_picked(tmp_path: Path) -> None:
    """Two processes (the real probe in the first): the second runs no base probe and sees
    the same ISAs, with the same AVX-512-BF16 finding, and picks the same one."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from torch._inductor import cpu_vec_isa\n"
        "from raydix.workers.vec_isa import settle_vector_isa\n"
        "message = settle_vector_isa(Path(sys.argv[1]))\n"
        "isas = [[str(i), getattr(i, '_is_avx512_bf16_supported', None)]\n"
        "        for i in cpu_vec_isa.valid_vec_isa_list()]\n"
        "print(json.dumps([message, isas, str(cpu_vec_isa.pick_vec_isa())]))\n"
    )
    runs = [json.loads(subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
        check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    (first_message, *first), (second_message, *second) = runs
    assert "(probed, recorded)" in first_message
    assert "(probed before on this machine)" in second_message
    assert first == second and first[0]
