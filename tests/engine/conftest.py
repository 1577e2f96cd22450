"""Engine fixtures: tiny random Llamas saved as safetensors, and engines over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.engine.engine import Engine
from raydix.workers.config import WorkerConfig
from tests.ray_start import init_ray
from tests.tiny_models import TOKENIZER_FILES, copy_tokenizer, save_tiny_llama

VOCAB = 128
EOS = 1  # kept out of prompts; the engine stops on it unless ignore_eos
TOK_EOS = 2  # tiny_tok's: the default model's end of text


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=4321, vocab_size=VOCAB,
                           max_position_embeddings=1024, initializer_range=0.3,
                           eos_token_id=EOS, bos_token_id=0, tie_word_embeddings=False)


EngineFactory = Callable[..., Engine]


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[None]:
    """One local Ray with 2 fake GPUs for the TP modules of this package (test_engine_tp.py,
    test_engine_hicache_tp.py): a start and a stop take 5-10 s on 2 cores. Each test shuts its
    engines down, which frees their ranks and placement groups."""
    import ray

    init_ray(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def make_engine(tiny_llama: Path) -> EngineFactory:
    def make(*, max_total_tokens: int = 4096, tp_size: int = 1, **sched: object) -> Engine:
        defaults: dict[str, object] = dict(max_running_requests=48, max_context_len=512)
        defaults.update(sched)
        worker = WorkerConfig(
            model_path=str(tiny_llama), tp_size=tp_size, max_total_tokens=max_total_tokens
        )
        config = EngineConfig.build(worker, SchedulerConfig(**defaults))  # type: ignore[arg-type]
        engine = Engine(config)
        engine.step_hook = lambda sched: sched.cache.check_integrity()
        return engine

    return make


def random_prompts(
    seed: int, groups: int, per_group: int, prefix_len: int, question_len: tuple[int, int]
) -> list[list[int]]:
    """Shared-prefix prompts: ``groups`` prefixes, each with ``per_group`` questions."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        prefix = rng.integers(2, VOCAB, size=prefix_len).tolist()
        for _ in range(per_group):
            num = int(rng.integers(question_len[0], question_len[1] + 1))
            prompts.append(prefix + rng.integers(2, VOCAB, size=num).tolist())
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer and vocabulary (what grammars
    compile against): unconstrained it writes garbage."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-tok"), seed=1234, vocab_size=49152,
                             max_position_embeddings=1024, initializer_range=0.3,
                             eos_token_id=TOK_EOS, bos_token_id=1, tie_word_embeddings=True)
    copy_tokenizer(smollm2, folder, TOKENIZER_FILES[:2] + TOKENIZER_FILES[3:])
    return folder
