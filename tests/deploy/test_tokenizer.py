"""The tokenizer the app's builder hands to the ingress replicas (deploy/model_path.py
`driver_tokenizer`, pickled by Serve): after the trip it is AutoTokenizer's (same class, ids,
decoding and chat prompt), and unpickling it loads no torch."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from raydix.deploy.model_path import driver_tokenizer

TEXTS = ["The capital of France is", "  two  spaces, tabs\tand a newline\n", "ünïcödé 日本語 🙂"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_the_handed_over_tokenizer_is_autotokenizers(smollm2: Path) -> None:
    ours = pickle.loads(pickle.dumps(driver_tokenizer(str(smollm2))))
    auto = AutoTokenizer.from_pretrained(smollm2)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.eos_token_id == auto.eos_token_id
    for text in TEXTS:
        ids = auto(text).input_ids
        assert ours(text).input_ids == ids and ours.decode(ids) == auto.decode(ids)
    assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def test_unpickling_the_tokenizer_loads_no_torch(smollm2: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "tokenizer.pkl"
    pickled.write_bytes(pickle.dumps(driver_tokenizer(str(smollm2))))
    probe = ("import pickle, sys\n"
             f"tok = pickle.loads(open({str(pickled)!r}, 'rb').read())\n"
             "assert tok('hi').input_ids\n"
             "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_folder_without_a_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(ValueError, match="no tokenizer could be loaded") as refused:
        driver_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(refused.value)
