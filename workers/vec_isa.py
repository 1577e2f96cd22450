"""Inductor's vector-ISA probe, run once per machine instead of at every start.

Before its first CPU compile in a process, inductor checks each vector ISA the CPU reports
(AVX-512 with VNNI, AVX-512, AVX2, AMX where present): it builds a test library with that ISA's
flags against torch's vector headers and loads it in a child Python, because a compiler unlike
the one torch was built with can produce code that fails to load. On 2 cores that cost 1.3-1.6 s
of every engine start on the CPU (the loads of the three libraries that link torch, 0.4 s each;
the engine waits on them), for the same answer each time.

`settle_vector_isa` keys the answer by what decides it (torch's version, the CPU's ISA flags,
and per ISA inductor's own fingerprint of its dry compile: the compiler's version, the ISA's
flags, torch's version) and records it in a file beside inductor's cache. Where the probe
passed every ISA the CPU reports, it sets inductor's `cpp.vec_isa_ok`, which skips those base
checks: at later starts with the same key the probe is not run (0.3 s instead of 1.3-1.6 s; the
finer checks, AVX-512-BF16, VNNI and AMX's permission from Linux, still run, fast). The flag is
part of inductor's cache key, so it is set in the probing start too, after its probe: every
start compiles under the same key. Where any ISA failed, nothing is recorded or set, and every
start probes as inductor does by itself; where the record cannot be written (a read-only cache),
the probing start's answer is used and the next start probes again. A value the user gave (`TORCHINDUCTOR_VEC_ISA_OK`) is
left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

RECORD_NAME = "raydix-vec-isa.json"


def _candidates() -> list[object]:
    """The ISAs inductor would probe here: those whose flags the CPU reports."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def _key(candidates: list[object]) -> str:
    from torch._inductor import cpu_vec_isa

    parts = [torch.__version__, sorted(cpu_vec_isa.x86_isa_checker()),
             [cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags())  # type: ignore[attr-defined]
              for isa in candidates]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _read(record: Path) -> dict[str, list[str]]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(record: Path, data: dict[str, list[str]]) -> None:
    """Atomically (ranks of one machine may start together)."""
    record.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".vec-isa-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, record)


def settle_vector_isa(record_dir: Path | None = None) -> str:
    """Run or skip inductor's ISA probe as the module's docstring says, before this process's
    first CPU compile; returns what was done (logged)."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None:
        return f"vector ISA check: as set (vec_isa_ok={config.cpp.vec_isa_ok})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return "vector ISA check: inductor's probe (not x86)"
    if record_dir is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        record_dir = Path(cache_dir())
    record = record_dir / RECORD_NAME
    candidates = _candidates()
    names = [str(isa) for isa in candidates]
    key = _key(candidates)
    recorded = _read(record)
    if names and recorded.get(key) == names:
        config.cpp.vec_isa_ok = True
        message = f"vector ISA check: {', '.join(names)} (probed before on this machine)"
    else:
        passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        if names and passed == names:
            config.cpp.vec_isa_ok = True
            try:
                _write(record, {**recorded, key: names})
                message = f"vector ISA check: {', '.join(names)} (probed, recorded)"
            except OSError as e:  # a read-only cache: probe again at the next start
                message = (f"vector ISA check: {', '.join(names)} (probed; not recorded: "
                           f"{e})")
        else:
            message = (f"vector ISA check: {', '.join(passed) or 'none'} of "
                       f"{', '.join(names) or 'none'} passed inductor's probe (run at every start)")
    logger.info(message)
    return message
