"""replica.config_flags: flags built from the config dataclasses, and flat names."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from replica.config import EngineConfig
from replica.config_flags import add_config_flags, config_from_args, from_mapping, with_flat
from replica.options import EngineOptions


def engine_parser(**kwargs: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig, **kwargs)
    return parser


def test_every_engine_field_and_option_has_a_described_flag() -> None:
    parser = engine_parser()
    helps = {opt: a.help for a in parser._actions for opt in a.option_strings}
    for cls in (EngineConfig, EngineOptions):
        for f in dataclasses.fields(cls):
            if f.name == "options":  # a config itself: its fields are the flags
                continue
            flag = "--" + f.name.replace("_", "-")
            assert helps.get(flag), f"{cls.__name__}.{f.name}: no flag or no help"


def test_a_field_without_help_is_refused() -> None:
    @dataclass(frozen=True)
    class Undocumented:
        documented: int = field(default=1, metadata={"help": "has one"})
        bare: int = 2

    with pytest.raises(ValueError, match="Undocumented.bare"):
        add_config_flags(argparse.ArgumentParser(), Undocumented)


def test_excluding_an_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="replica_idd"):
        engine_parser(exclude=("replica_idd",))


def test_round_trip_args_to_engine_config() -> None:
    args = engine_parser(exclude=("replica_id",)).parse_args(
        ["--block-size", "32", "--num-blocks", "none", "--max-model-len", "512",
         "--no-enable-cuda-graphs", "--no-pdl", "--fuse-silu", "--dtype", "bfloat16",
         "--gpu-memory-utilization", "0.5", "--seed", "7"]
    )  # fmt: skip
    assert config_from_args(EngineConfig, args, model="gpt2") == EngineConfig(
        model="gpt2",
        block_size=32,
        num_blocks=None,
        max_model_len=512,
        enable_cuda_graphs=False,
        dtype="bfloat16",
        gpu_memory_utilization=0.5,
        seed=7,
        options=EngineOptions(pdl=False),
    )
    assert config_from_args(EngineOptions, args) == EngineOptions(pdl=False)
    assert not hasattr(args, "replica_id")


def test_defaults_come_from_the_dataclass() -> None:
    args = engine_parser().parse_args([])
    assert config_from_args(EngineConfig, args) == EngineConfig()
    assert "tokens per KV-cache block (default: 16)" in engine_parser().format_help()


def test_choices_come_from_the_validators_tuple() -> None:
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--block-size", "12"])
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--kv-cache-dtype", "int8"])


def test_a_bad_value_from_the_command_line_names_the_field() -> None:
    args = engine_parser().parse_args(["--max-num-seqs", "0"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        config_from_args(EngineConfig, args)


def test_aliases_keep_older_flag_names() -> None:
    parser = engine_parser(
        aliases={"enable_cuda_graphs": ["--cuda-graphs"], "max_num_batched_tokens": ["--mbt"]}
    )
    args = parser.parse_args(["--no-cuda-graphs", "--mbt", "1024"])
    config = config_from_args(EngineConfig, args)
    assert (config.enable_cuda_graphs, config.max_num_batched_tokens) == (False, 1024)


def test_flat_names_reach_nested_options() -> None:
    config = with_flat(EngineConfig(), {"pdl": False, "block_size": 32})
    assert config == EngineConfig(block_size=32, options=EngineOptions(pdl=False))


def test_engine_from_dict_takes_options_flat_or_nested() -> None:
    nested = EngineConfig.from_dict({"block_size": 32, "options": {"fuse_silu": False}})
    flat = EngineConfig.from_dict({"block_size": 32, "fuse_silu": False})
    assert nested == flat == EngineConfig(block_size=32, options=EngineOptions(fuse_silu=False))


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"blok_size": 32}, "blok_size"),
        ({"options": {"pdll": False}}, "options.pdll"),
        ({"options": {"pdl": False}, "pdl": True}, "pdl"),
        ({"options": {"pdl": "no"}}, "pdl"),
        ({"block_size": 12}, "block_size"),
    ],
)
def test_engine_from_dict_names_the_bad_key(data: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        from_mapping(EngineConfig, data)
