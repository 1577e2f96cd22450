"""Every `ray up` config in ray-clusters/ passes Ray's own preparation and schema check, offline."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parents[2] / "ray-clusters"
YAMLS = sorted(CLUSTER.glob("*.yaml"))


def test_there_are_configs_for_aws_gcp_and_on_premise() -> None:
    providers = {yaml.safe_load(p.read_text())["provider"]["type"] for p in YAMLS}
    assert providers == {"aws", "gcp", "local"}


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_config_is_valid_for_ray_up(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    setup = " ".join(config["setup_commands"])
    assert "raydix[cuda]" in setup and "pip install" in setup
    if raw["provider"]["type"] == "local":  # on premise: ray start declares the GPUs
        starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        assert sum("--num-gpus=" in c for c in starts) == 2
    else:
        gpus = [t["resources"].get("GPU", 0) for t in config["available_node_types"].values()]
        assert max(gpus) >= 4  # GPU counts are given as resources
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


def test_a_broken_config_is_refused() -> None:
    raw = yaml.safe_load((CLUSTER / "aws-h100.yaml").read_text())
    raw["available_node_types"]["head"]["unknown_field"] = 1
    with pytest.raises(Exception, match="unknown_field"):
        validate_config(prepare_config(raw))
