"""Builds a C source of the workers into a shared library for this machine and loads it.

The library is compiled for the host's CPU (`-march=native`) with OpenMP, the way torch's own
compiler builds its CPU kernels, and kept on disk under a name that hashes everything it was
built from (source, defines, flags, compiler, CPU), so a later start loads it in milliseconds.
Compiling takes well under a second: a plain C file, no torch headers.

The float flags let the compiler reorder and vectorise the reductions (finite math: the
kernels' inputs are finite numbers); they are given when compiling only, not when linking, so
the library does not switch the process's float mode (flush-to-zero) as a fast-math executable
would.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CACHE_DIR = Path.home() / ".cache" / "raydix" / "kernels"
INCLUDE_DIR = Path(__file__).parent  # the workers' shared headers (native_math.h)
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-fno-math-errno",
                 "-funsafe-math-optimizations", "-ffinite-math-only")
LINK_FLAGS = ("-shared", "-fopenmp")


class NativeBuildError(RuntimeError):
    """No C compiler, or it failed on the source."""


def compiler() -> str:
    """The C compiler: $CC, else `cc` on the PATH."""
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise NativeBuildError(f"no C compiler: {name!r} is not on the PATH (set CC)")
    return path


def load(source: Path, defines: dict[str, int],
         functions: Mapping[str, Sequence[type[Any]]] | None = None,
         cache_dir: Path | None = None) -> ctypes.CDLL:
    """The library built from `source` with these `-D` defines, compiled on first use; each of
    `functions` (name: ctypes argument types) declared as returning nothing."""
    lib = ctypes.CDLL(str(build(source, defines, cache_dir)))
    for name, argtypes in (functions or {}).items():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = list(argtypes)
    return lib


def build(source: Path, defines: dict[str, int], cache_dir: Path | None = None) -> Path:
    """Path of the shared library built from `source`, compiled unless already on disk."""
    cc = compiler()
    args = (tuple(f"-D{name}={value}" for name, value in sorted(defines.items()))
            + COMPILE_FLAGS + (f"-I{INCLUDE_DIR}",))
    text = source.read_text()
    headers = [(INCLUDE_DIR / name).read_text()
               for name in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE)]
    key = hashlib.sha256("\0".join(
        (text, *headers, *args, *LINK_FLAGS, cc, _cc_version(cc), _cpu())).encode())
    folder = cache_dir or Path(os.environ.get("RAYDIX_KERNEL_CACHE", CACHE_DIR))
    target = folder / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # the same file system: an atomic move
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        _run([cc, *args, "-c", str(source), "-o", str(obj)])
        _run([cc, *LINK_FLAGS, str(obj), "-o", str(lib)])
        os.replace(lib, target)  # processes building at once each write their own, then move
    return target


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NativeBuildError(f"{' '.join(command)} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")


@functools.cache  # a process's kernels share it: a subprocess each load was tens of ms
def _cc_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    return done.stdout


@functools.cache
def _cpu() -> str:
    """What `-march=native` compiles for: the CPU's model and flags (Linux), else nothing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in text.splitlines() if line.startswith(wanted)}))
