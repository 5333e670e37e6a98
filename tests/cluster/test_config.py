"""ClusterConfig validation and building apps from the deploy/ config files (no Ray started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve import Application

from cluster import ClusterConfig, build_app
from cluster.app import app_builder

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", ""),
        ("num_replicas", 0),
        ("router", "random"),
        ("block_size", 0),
        ("num_blocks", -1),
        ("max_num_seqs", 0),
        ("dtype", "int8"),
        ("kv_cache_dtype", "int8"),
        ("device", "tpu"),
        ("stats_period_s", 0.0),
        ("stats_period_s", 5.0),
        ("carrier_messages_per_step", 0),
        ("carrier_messages_per_step", 2.5),
        ("high_watermark", 1.5),
        ("queue_fraction", -1.0),
        ("on_overload", "drop"),
        ("max_hold_s", -1.0),
        ("balance_band", 1.5),
        ("num_gpus_per_replica", -1),
        ("num_gpus_per_replica", float("nan")),
        ("num_gpus_per_replica", float("inf")),
        ("num_gpus_per_replica", True),
        ("num_cpus_per_replica", -1),
        ("num_cpus_per_replica", "2"),
        ("num_cpus_per_replica", float("inf")),
        ("num_cpus_per_replica", float("nan")),
        ("http", "yes"),
        ("access_log", 1),
        ("engine_process", "yes"),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{field: value})


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ClusterConfig.from_dict({"replicas": 2})


def test_num_gpus_auto() -> None:
    assert ClusterConfig().resolve_num_gpus(cluster_gpus=0) == 0
    assert ClusterConfig().resolve_num_gpus(cluster_gpus=8) == 1
    assert ClusterConfig(device="cpu").resolve_num_gpus(cluster_gpus=8) == 0
    with pytest.raises(ValueError, match="GPUs"):
        ClusterConfig(device="cuda").resolve_num_gpus(cluster_gpus=0)
    assert ClusterConfig(num_gpus_per_replica=0.5).resolve_num_gpus(cluster_gpus=0) == 0.5


def test_router_and_engine_configs_follow_cluster_config() -> None:
    config = ClusterConfig(
        router="prefix", high_watermark=0.8, on_overload="reject", num_blocks=64, balance_band=0.2,
        kv_cache_dtype="fp8",
    )  # fmt: skip
    router = config.router_config()
    assert (router.policy, router.high_watermark, router.on_overload) == ("prefix", 0.8, "reject")
    assert router.balance_band == 0.2
    engine = config.engine_config("r1", num_gpus=0)
    assert (engine.device, engine.num_blocks, engine.replica_id) == ("cpu", 64, "r1")
    assert engine.kv_cache_dtype == "fp8"
    assert config.engine_config("r1", num_gpus=1).device == "cuda"


@pytest.mark.parametrize("access_log", [False, True])
def test_access_log_reaches_both_deployments(access_log: bool) -> None:
    ingress = build_app(ClusterConfig(http=True, access_log=access_log), num_gpus_in_cluster=0)
    (llm,) = ingress._bound_deployment.init_args[:1]
    for deployment in (ingress._bound_deployment, llm._bound_deployment):
        assert deployment._deployment_config.logging_config["enable_access_log"] is access_log


@pytest.mark.parametrize(
    ("fields", "gpus", "expected"),
    [({}, 0, (0.0, 1.0)), ({}, 8, (1.0, 0.0)), ({"num_cpus_per_replica": 2}, 0, (0.0, 2.0))],
)
def test_replica_actors_ask_for_cpus_and_gpus(fields: dict, gpus: int, expected: tuple) -> None:
    """Ray sets a replica's OMP_NUM_THREADS to its num_cpus: torch's threads on a CPU one."""
    options = build_app(ClusterConfig(**fields), num_gpus_in_cluster=gpus)._bound_deployment
    assert (
        options.ray_actor_options["num_gpus"],
        options.ray_actor_options["num_cpus"],
    ) == expected


def _app_args(serve_config: dict) -> dict:
    (app,) = serve_config["applications"]
    assert app["import_path"] == "cluster.app:app_builder"
    return app["args"]


def test_serve_yaml_builds() -> None:
    args = _app_args(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))
    assert isinstance(app_builder(args), Application)
    assert ClusterConfig.from_dict(args).http


def test_kuberay_rayservice_builds() -> None:
    manifest = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    args = _app_args(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    config = ClusterConfig.from_dict(args)
    assert config.resolve_num_gpus(cluster_gpus=4) == 1
    assert isinstance(build_app(config, num_gpus_in_cluster=4), Application)


@pytest.mark.parametrize(("flag", "expected"), [([], None), (["--engine", "process"], True),
                                                (["--engine", "thread"], False)])  # fmt: skip
def test_cli_serve_engine_flag(flag: list[str], expected: bool | None) -> None:
    from cluster.__main__ import _parser, serve_config

    config = serve_config(_parser().parse_args(["serve", "--model", "gpt2-tiny", *flag]))
    assert config.engine_process is expected and config.model == "gpt2-tiny"


def test_cli_serve_kv_cache_dtype_flag() -> None:
    from cluster.__main__ import _parser, serve_config

    config = serve_config(_parser().parse_args(["serve"]))
    assert config.kv_cache_dtype == "auto"
    config = serve_config(_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    assert config.engine_config("r0", num_gpus=0).kv_cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_retries", -1),
        ("retry_backoff_s", 0),
        ("carrier_timeout_s", "10"),
        ("route_on_caller_loop", 1),
        ("serve_grpc", "yes"),
    ],
)
def test_client_rejects_bad_options_naming_the_field(field: str, value: object) -> None:
    from cluster import Client

    with pytest.raises(ValueError, match=field):
        Client("kvfleet", **{field: value})


def test_num_cpus_auto() -> None:
    """1 CPU for a replica without a GPU, 0 with one, unless num_cpus_per_replica says."""
    assert ClusterConfig().resolve_num_cpus(num_gpus=0) == 1
    assert ClusterConfig().resolve_num_cpus(num_gpus=1) == 0
    assert ClusterConfig(num_cpus_per_replica=4).resolve_num_cpus(num_gpus=0) == 4
    assert ClusterConfig(num_cpus_per_replica=2).resolve_num_cpus(num_gpus=1) == 2
    with pytest.raises(ValueError, match="num_cpus_per_replica and num_gpus_per_replica"):
        ClusterConfig(replica_resources={"CPU": 2})
