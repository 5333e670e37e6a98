"""Config dataclasses by flat name: every CLI's flags, flat keywords and YAML keys.

A config is a frozen dataclass whose fields may themselves be configs (ClusterConfig
holds an EngineConfig, which holds an EngineOptions; and a RouterConfig). Its *flat
names* are its own field names and, recursively, those of the configs it holds, so one
name reaches a setting wherever it lives: `block_size` is ClusterConfig.engine.block_size,
`pdl` is EngineConfig.options.pdl. A name found in several nested configs sets all of
them (`seed`: the engine's and the router's); reading it reads the first.

The CLI builder (add_config_flags) adds one argparse flag per leaf field (a field that
is not itself a config), named after it (`--block-size`), typed, defaulted and described
from the field: the help is the field's `metadata["help"]` (a field without one is an
error, so nothing undocumented reaches a CLI), choices its `metadata["choices"]` (the
tuple its validator checks), bools `--x/--no-x`, Optional fields accept "none" or
"auto" for None, dicts are JSON. config_from_args turns parsed args back into a config.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def nested_configs(cls: type) -> dict[str, type]:
    """cls's fields that are configs themselves: field name -> its dataclass type."""
    hints = _hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])
    }


@functools.cache
def flat_names(cls: type) -> frozenset[str]:
    """Every name a flat keyword, YAML key or flag of cls may use (see the module doc)."""
    names = {f.name for f in dataclasses.fields(cls)}
    for sub in nested_configs(cls).values():
        names |= flat_names(sub)
    return frozenset(names)


def _default(cls: type, name: str) -> Any:
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _check_known(cls: type, names: Iterable[str], where: str = "") -> None:
    unknown = sorted(set(names) - flat_names(cls))
    if unknown:
        named = ", ".join(where + n for n in unknown)
        raise ValueError(f"unknown {cls.__name__} field(s): {named}")


def resolve(cls: type, values: Mapping[str, Any], base: Any = None) -> dict[str, Any]:
    """The keyword arguments of cls's own fields that apply flat `values`.

    A nested config is taken from `values` when given there, else from `base` (an
    instance of cls) or the field's default, and the flat names below it are applied over
    it. Only fields that `values` touches are returned. Unknown names raise ValueError.
    """
    _check_known(cls, values)
    own = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in values.items() if k in own}
    for name, sub in nested_configs(cls).items():
        below = {k: v for k, v in values.items() if k in flat_names(sub)}
        if below:
            if name in kwargs:
                inner = kwargs[name]
            else:
                inner = getattr(base, name) if base is not None else _default(cls, name)
            kwargs[name] = with_flat(inner, below)
    return kwargs


def with_flat(config: T, values: Mapping[str, Any]) -> T:
    """config with each flat name in values set wherever it lives (dataclasses.replace)."""
    if not values:
        return config
    return dataclasses.replace(config, **resolve(type(config), values, config))


def from_flat(cls: type[T], values: Mapping[str, Any]) -> T:
    """A cls from flat names; what values does not name keeps its default."""
    return cls(**resolve(cls, values))


def get_flat(config: Any, name: str) -> Any:
    """The value of flat name `name` in config: its own field, else the first nested
    config (in field order) that has it."""
    if name in config.__dataclass_fields__:
        return getattr(config, name)
    for field_name, sub in nested_configs(type(config)).items():
        if name in flat_names(sub):
            return get_flat(getattr(config, field_name), name)
    raise AttributeError(f"{type(config).__name__} has no field {name!r}")


def from_mapping(cls: type[T], data: object, where: str = "") -> T:
    """A cls from a YAML/JSON-like mapping of flat names, where a nested config may also
    be given as a mapping under its field name (`engine: {block_size: 32}`). A name
    given both flat and inside such a mapping, or an unknown one, raises ValueError."""
    if not isinstance(data, Mapping):
        name = where.rstrip(".") or cls.__name__
        raise ValueError(f"{name} must be a mapping, got {type(data).__name__}")
    _check_known(cls, data, where)
    configs = _config_names(cls)
    values = dict(data)
    given_nested: set[str] = set()
    for name, value in data.items():
        if name in configs and isinstance(value, Mapping):
            given_nested |= _keys(value)
            values[name] = from_mapping(configs[name], value, f"{where}{name}.")
    twice = sorted(given_nested & set(data))
    if twice:
        raise ValueError(f"{', '.join(where + n for n in twice)}: given both flat and nested")
    return from_flat(cls, values)


def _config_names(cls: type) -> dict[str, type]:
    """Flat names of cls that are configs themselves (engine, routing, options, ...)."""
    found = {}
    for name, sub in nested_configs(cls).items():
        found |= {name: sub} | _config_names(sub)
    return found


def _keys(mapping: Mapping[str, Any]) -> set[str]:
    keys = set(mapping)
    for value in mapping.values():
        if isinstance(value, Mapping):
            keys |= _keys(value)
    return keys


# ---- the CLI builder -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A field that gets a flag: its flat name, the config that declares it, its type."""

    name: str
    owner: type
    field: dataclasses.Field
    hint: Any


def leaves(cls: type) -> dict[str, Leaf]:
    """cls's leaf fields by flat name, in field order (a shared name: its first owner)."""
    found: dict[str, Leaf] = {}
    nested = nested_configs(cls)
    for f in dataclasses.fields(cls):
        if f.name in nested:
            for name, leaf in leaves(nested[f.name]).items():
                found.setdefault(name, leaf)
        else:
            found.setdefault(f.name, Leaf(f.name, cls, f, _hints(cls)[f.name]))
    return found


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _none_or(base: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "auto") else base(text)

    parse.__name__ = f"{base.__name__} or none"
    return parse


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {text!r}")
    return value


_json_object.__name__ = "JSON object"


def _flag_kwargs(leaf: Leaf) -> dict[str, Any]:
    args = typing.get_args(leaf.hint)
    is_union = typing.get_origin(leaf.hint) in (types.UnionType, typing.Union)
    optional = is_union and type(None) in args
    base = next(a for a in args if a is not type(None)) if is_union else leaf.hint
    base_origin = typing.get_origin(base) or base
    kwargs: dict[str, Any] = {"default": _default(leaf.owner, leaf.name), "dest": leaf.name}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif base_origin is dict:
        kwargs |= {"type": _json_object, "metavar": "JSON"}
    elif base in (int, float, str):
        kwargs["type"] = _none_or(base) if optional else base
        choices = leaf.field.metadata.get("choices")
        if choices is not None:
            kwargs["choices"] = choices
    else:
        raise TypeError(f"{leaf.owner.__name__}.{leaf.name}: no flag for type {leaf.hint!r}")
    return kwargs


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    exclude: Collection[str] = (),
    aliases: Mapping[str, Iterable[str]] | None = None,
    grouped: bool = False,
) -> list[str]:
    """A flag for every leaf field of cls (see the module doc) but those in exclude;
    aliases: flat name -> extra option strings; grouped: one argument group in --help per
    config that declares fields (cls's own first). Returns the flat names given flags.

    A field with no help raises ValueError (naming it), as does an excluded or aliased
    name that cls does not have.
    """
    found = leaves(cls)
    aliases = dict(aliases or {})
    for name in (*exclude, *aliases):
        if name not in found:
            raise ValueError(f"{cls.__name__} has no field {name!r} to exclude or alias")
    added = []
    groups: dict[type, Any] = {}
    if grouped:
        groups[cls] = parser.add_argument_group(_group_title(cls))
    for name, leaf in found.items():
        if name in exclude:
            continue
        text = leaf.field.metadata.get("help")
        if not text:
            raise ValueError(f"{leaf.owner.__name__}.{name} has no help (field metadata)")
        target = parser
        if grouped:
            if leaf.owner not in groups:
                groups[leaf.owner] = parser.add_argument_group(_group_title(leaf.owner))
            target = groups[leaf.owner]
        action = target.add_argument(flag(name), *aliases.get(name, ()), **_flag_kwargs(leaf))
        # Set after construction: BooleanOptionalAction appends a default of its own to
        # the help it is given (Python <= 3.12), and every flag should read the same.
        default = " (default: none)" if action.default is None else " (default: %(default)s)"
        action.help = text.replace("%", "%%") + default
        added.append(name)
    return added


def _group_title(cls: type) -> str:
    first_line = (cls.__doc__ or "").strip().split("\n")[0].rstrip(".")
    return f"{cls.__name__}: {first_line}" if first_line else cls.__name__


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flat names of cls that args has (every flag add_config_flags added, and any
    hand-written flag with a field's name as its dest), with their values."""
    return {name: getattr(args, name) for name in leaves(cls) if hasattr(args, name)}


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """The cls that args describe (flag_values), with overrides (flat names) on top."""
    return from_flat(cls, flag_values(cls, args) | overrides)
