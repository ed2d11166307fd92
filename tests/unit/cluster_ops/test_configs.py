"""Shipped cluster configs: valid against Ray's own cluster schema, and sized so trajectories scale out."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml

from cluster.fake_cluster import FAKE_MULTINODE_CONFIG, TRAJECTORY_RESOURCE, load_autoscaling_config
from runtime.errors import InputError

CLUSTER_DIR = Path(__file__).resolve().parents[3] / "cluster"
RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", ["fake_multinode.yaml", "aws.yaml"])
def test_autoscaler_configs_match_rays_cluster_schema(name: str) -> None:
    config = load_autoscaling_config(CLUSTER_DIR / "autoscaler" / name)

    jsonschema.validate(config, RAY_SCHEMA)  # raises on any unknown or mistyped key


@pytest.mark.parametrize("name", ["fake_multinode.yaml", "aws.yaml"])
def test_trajectories_only_fit_on_workers_that_start_from_zero(name: str) -> None:
    config = load_autoscaling_config(CLUSTER_DIR / "autoscaler" / name)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = [t for n, t in types.items() if n != config["head_node_type"]]

    assert head["resources"].get(TRAJECTORY_RESOURCE, 0) == 0
    assert any(w["resources"].get(TRAJECTORY_RESOURCE, 0) >= 1 for w in workers)
    assert all(w["min_workers"] == 0 for w in workers)


def test_fake_cluster_is_small_and_quick_to_scale_down() -> None:
    config = load_autoscaling_config(FAKE_MULTINODE_CONFIG)

    assert config["provider"]["type"] == "fake_multinode"
    assert config["idle_timeout_minutes"] <= 0.5
    assert config["max_workers"] <= 2


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_manifests_turn_the_autoscaler_on_and_declare_the_trajectory_resource(name: str) -> None:
    manifest = yaml.safe_load((CLUSTER_DIR / "kuberay" / name).read_text())
    spec = manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]

    assert spec["enableInTreeAutoscaling"] is True
    for group in spec["workerGroupSpecs"]:
        # KubeRay passes rayStartParams.resources through a shell: JSON inside one more quoting layer.
        declared = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert declared[TRAJECTORY_RESOURCE] >= 1
        assert group["minReplicas"] == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- a list", "mapping"),
        ("cluster_name: x\nprovider: {type: aws}\n", "missing required key"),
        (
            "cluster_name: x\nprovider: {type: aws}\navailable_node_types: {a: {}}\nhead_node_type: b\n",
            "head_node_type 'b'",
        ),
        ("cluster_name: [unclosed", "YAML"),
    ],
)
def test_bad_autoscaling_configs_are_refused_naming_the_problem(
    tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)

    with pytest.raises(InputError, match=fragment):
        load_autoscaling_config(path)
