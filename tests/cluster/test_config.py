"""ClusterConfig validation and building apps from the deploy/ config files (no Ray started)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve import Application

from cluster import ClusterConfig, build_app
from cluster.app import app_builder
from replica.config import EngineConfig
from replica.options import EngineOptions
from router.config import RouterConfig

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
        ("ingress_replicas", 0),
        ("http_proxy", "nginx"),
        ("access_log", 1),
        ("engine_process", "yes"),
        ("engine", {"block_size": 32}),
        ("routing", "kv"),
        ("max_ongoing_requests", 0),
        ("app_name", ""),
        ("pdl", "no"),
        ("backoff_multiplier", 0.5),
        ("gpu_memory_utilization", 1.5),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{field: value})


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ClusterConfig.from_dict({"replicas": 2})
    with pytest.raises(ValueError, match="engine.blok_size"):
        ClusterConfig.from_dict({"engine": {"blok_size": 32}})
    with pytest.raises(ValueError, match="block_size"):
        ClusterConfig.from_dict({"block_size": 16, "engine": {"block_size": 32}})


def test_flat_and_nested_construction_are_equal() -> None:
    flat = ClusterConfig(
        model="gpt2-tiny", num_replicas=2, router="prefix", block_size=32, max_num_seqs=64,
        high_watermark=0.9, seed=3, pdl=False, app_name="a",
    )  # fmt: skip
    nested = ClusterConfig(
        engine=EngineConfig(
            model="gpt2-tiny", block_size=32, max_num_seqs=64, seed=3,
            options=EngineOptions(pdl=False),
        ),
        routing=RouterConfig(high_watermark=0.9, seed=3),
        num_replicas=2,
        router="prefix",
        app_name="a",
    )  # fmt: skip
    from_yaml = ClusterConfig.from_dict(
        {"num_replicas": 2, "router": "prefix", "app_name": "a", "seed": 3,
         "engine": {"model": "gpt2-tiny", "block_size": 32, "max_num_seqs": 64,
                    "options": {"pdl": False}},
         "routing": {"high_watermark": 0.9}}
    )  # fmt: skip
    assert flat == nested == from_yaml
    assert flat.routing.policy == "prefix"  # router names the policy
    assert (flat.model, flat.block_size, flat.high_watermark, flat.pdl) == (
        "gpt2-tiny", 32, 0.9, False,
    )  # fmt: skip
    assert dataclasses.replace(flat, block_size=64, router="kv").engine.block_size == 64
    with pytest.raises(AttributeError):
        flat.no_such_field  # noqa: B018


def test_flat_keywords_apply_over_the_nested_configs() -> None:
    config = ClusterConfig(engine=EngineConfig(block_size=32, max_num_seqs=8), block_size=64)
    assert (config.block_size, config.max_num_seqs) == (64, 8)


def test_seed_reaches_engine_and_router() -> None:
    config = ClusterConfig(seed=5)
    assert config.engine_config("r0", num_gpus=0).seed == 5
    assert config.router_config().seed == 5


@pytest.mark.parametrize("data", [{"policy": "prefix"}, {"routing": {"policy": "prefix"}}])
def test_policy_is_set_through_router(data: dict) -> None:
    with pytest.raises(ValueError, match="policy.*router"):
        ClusterConfig.from_dict(data)
    with pytest.raises(ValueError, match="policy.*router"):
        ClusterConfig(policy="prefix")


def test_serve_routers_refuse_every_router_field() -> None:
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        ClusterConfig(router="serve-pow2", balance_abs_threshold=0.2)
    assert ClusterConfig(router="serve-pow2", seed=4).seed == 4


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


def _flat_items(args: dict) -> dict:
    """The YAML's settings by flat name (engine: / routing: / options: mappings opened)."""
    items = {}
    for key, value in args.items():
        items |= _flat_items(value) if isinstance(value, dict) else {key: value}
    return items


@pytest.mark.parametrize("name", ["serve.yaml", "kuberay-rayservice.yaml"])
def test_deploy_yaml_maps_onto_the_config_fields(name: str) -> None:
    document = yaml.safe_load((DEPLOY / name).read_text())
    if document.get("kind") == "RayService":
        document = yaml.safe_load(document["spec"]["serveConfigV2"])
    args = _app_args(document)
    config = ClusterConfig.from_dict(args)
    for key, value in _flat_items(args).items():
        assert getattr(config, key) == value, key


def test_serve_yaml_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import constants

    args = _app_args(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))
    # Serve builds it on the cluster, where the YAML's http_proxy wants HAProxy on.
    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    assert isinstance(app_builder(args), Application)
    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", False)
    with pytest.raises(ValueError, match="http_proxy.*RAY_SERVE_ENABLE_HA_PROXY=1"):
        app_builder(args)
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


def _serve_parser() -> argparse.ArgumentParser:
    from cluster.__main__ import _parser

    (commands,) = (a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_every_config_field_has_a_described_serve_flag() -> None:
    from cluster.__main__ import SERVE_EXCLUDED

    serve_p = _serve_parser()
    helps = {opt: a.help for a in serve_p._actions for opt in a.option_strings}
    for cls in (ClusterConfig, EngineConfig, EngineOptions, RouterConfig):
        for f in dataclasses.fields(cls):
            if f.name in SERVE_EXCLUDED or dataclasses.is_dataclass(f.default_factory):
                continue  # excluded, or a config whose own fields are the flags
            flag = "--" + f.name.replace("_", "-")
            assert flag in helps, f"{cls.__name__}.{f.name}: no {flag}"
    for action in serve_p._actions:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings


def test_cli_serve_help_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert "--dtype {auto,float32,float16,bfloat16}" in out
    assert "--replicas" in out and "--no-http" in out and "--no-pdl" in out


def test_cli_serve_round_trip() -> None:
    from cluster.__main__ import _parser, serve_config

    args = _parser().parse_args(
        ["serve", "--replicas", "3", "--router", "prefix", "--block-size", "32",
         "--num-blocks", "none", "--dtype", "bfloat16", "--no-pdl", "--high-watermark", "0.8",
         "--seed", "7", "--replica-resources", '{"slot": 1}', "--engine", "thread",
         "--no-http", "--num-gpus-per-replica", "0.5", "--app-name", "x"]
    )  # fmt: skip
    assert serve_config(args) == ClusterConfig(
        num_replicas=3, router="prefix", block_size=32, dtype="bfloat16", pdl=False,
        high_watermark=0.8, seed=7, replica_resources={"slot": 1}, engine_process=False,
        http=False, num_gpus_per_replica=0.5, app_name="x",
    )  # fmt: skip
    defaults = serve_config(_parser().parse_args(["serve"]))
    assert defaults == ClusterConfig(http=True)  # the served app speaks HTTP unless --no-http
    with pytest.raises(ValueError, match="high_watermark"):
        serve_config(_parser().parse_args(["serve", "--high-watermark", "2"]))


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
