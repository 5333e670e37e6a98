"""The engine contract: cluster/ uses exactly ServingEngine's members, and LLMEngine and every
fake engine (bench.cluster's, tests/cluster's) have them with the same signatures."""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.cluster import FakeEngine, PacedEngine
from replica import LLMEngine
from replica.config import EngineConfig
from replica.protocol import ServingEngine
from tests.cluster.inprocess import GatedEngine
from tests.cluster.test_engine_process import BrokenEngine
from tests.cluster.test_transport_batches import UnevenEngine

REPO = Path(__file__).resolve().parents[2]
METHODS = ("add_request", "abort", "has_unfinished", "device_busy", "step", "stats")
ATTRIBUTES = ("model_config", "tokenizer", "max_model_len")


@pytest.fixture(scope="module")
def llm_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="gpt2-tiny", device="cpu", max_num_seqs=4))


def engines(llm_engine: LLMEngine) -> dict[str, Any]:
    return {
        "LLMEngine": llm_engine,
        "FakeEngine": FakeEngine("r0"),
        "PacedEngine": PacedEngine(llm_engine, 0.0),
        "GatedEngine": GatedEngine("r0"),
        "BrokenEngine": BrokenEngine("r0", 0.01),
        "UnevenEngine": UnevenEngine(),
    }


def test_the_protocol_declares_these_members() -> None:
    members = {n for n in vars(ServingEngine) if not n.startswith("_")}
    members |= set(ServingEngine.__annotations__)
    assert members == set(METHODS) | set(ATTRIBUTES)


def test_cluster_uses_no_engine_member_outside_the_protocol() -> None:
    """Every `engine.X` / `self._engine.X` in cluster/ names a member of ServingEngine, and
    each member is used: the protocol is what cluster/ needs, no more, no less."""
    used: set[str] = set()
    for path in (REPO / "cluster").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if (isinstance(value, ast.Name) and value.id == "engine") or (
                isinstance(value, ast.Attribute) and value.attr == "_engine"
            ):
                used.add(node.attr)
    assert used == set(METHODS) | set(ATTRIBUTES)


def _hints(fn: Callable) -> dict[str, Any]:
    return typing.get_type_hints(inspect.unwrap(getattr(fn, "__func__", fn)))


def _accepts(declared: Any, implemented: Any) -> bool:
    """A parameter may take what the protocol passes: the same type, or Any."""
    return implemented is Any or implemented == declared


def _returns(declared: Any, implemented: Any) -> bool:
    """The result is the declared type or a subtype (StepOutputs is a Sequence[RequestOutput])."""
    if implemented == declared:
        return True
    origin, args = typing.get_origin(declared) or declared, typing.get_args(declared)
    if typing.get_origin(implemented) is not None:  # e.g. list[RequestOutput]
        return issubclass(typing.get_origin(implemented), origin) and (
            typing.get_args(implemented) == args
        )
    bases = getattr(implemented, "__orig_bases__", ())  # e.g. StepOutputs(Sequence[...])
    return any(typing.get_origin(b) is origin and typing.get_args(b) == args for b in bases)


def _params(fn: Callable) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


ENGINES = ["LLMEngine", "FakeEngine", "PacedEngine", "GatedEngine", "BrokenEngine", "UnevenEngine"]


@pytest.mark.parametrize("name", ENGINES)
def test_engine_satisfies_the_protocol_with_its_signatures(llm_engine, name: str) -> None:
    engine = engines(llm_engine)[name]
    assert isinstance(engine, ServingEngine)
    for method in METHODS:
        declared = getattr(ServingEngine, method)
        implemented = getattr(engine, method)  # bound (through __getattr__ for wrappers)
        # The protocol's function still has self: drop it to compare with a bound method.
        assert _params(implemented) == _params(declared)[1:], f"{name}.{method}"
        want, got = _hints(declared), _hints(implemented)
        for param in inspect.signature(implemented).parameters:
            assert _accepts(want[param], got.get(param, Any)), f"{name}.{method}({param})"
        assert _returns(want["return"], got["return"]), f"{name}.{method} -> {got['return']}"
    assert isinstance(engine.max_model_len, int)
    assert isinstance(engine.model_config.vocab_size, int)
    assert engine.model_config.eos_token_id is None or isinstance(
        engine.model_config.eos_token_id, int
    )
    assert hasattr(engine, "tokenizer")


def test_a_mismatched_signature_is_caught() -> None:
    """The comparison fails on a renamed parameter, a changed default or a narrower type."""

    class Renamed(FakeEngine):
        def abort(self, rid: str) -> bool:  # type: ignore[override]
            return super().abort(rid)

    class Defaulted(FakeEngine):
        def stats(self, with_hashes: bool = False):  # type: ignore[override]
            return super().stats(with_hashes)

    class Narrower(FakeEngine):
        def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
            super().add_request(request_id, prompt_token_ids, params)

    assert _params(Renamed("r0").abort) != _params(ServingEngine.abort)[1:]
    assert _params(Defaulted("r0").stats) != _params(ServingEngine.stats)[1:]
    want = _hints(ServingEngine.add_request)["prompt_token_ids"]
    assert not _accepts(want, _hints(Narrower("r0").add_request)["prompt_token_ids"])
    assert not _returns(_hints(ServingEngine.step)["return"], int)
