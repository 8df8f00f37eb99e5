"""Load ``config.yaml``: YAML, ``${VAR}`` interpolation, validation, readable errors.

Errors name the file, the YAML path (``brokers.events.stream.name``) and what is wrong. They
never repeat a value, because after interpolation a value may be a password or a key.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from yaml.nodes import MappingNode, Node, SequenceNode

from brokers import AnyBrokerSettings, UnsetSecret
from envelopes import ConfigError
from router._db import missing_driver
from router.config import RouterConfig
from router.errors import ConfigDeprecationWarning

__all__ = ["load_config", "parse_config", "require_clients"]

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


def load_config(
    path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    *,
    require_secrets: bool = True,
) -> RouterConfig:
    """Read, interpolate and validate a config file.

    ``require_secrets=False`` loads it to stage events only: a secret that only connecting to
    a broker or serving HTTP reads (a broker's URL, password or connection string,
    ``http.token``) may name an unset variable, and becomes an ``UnsetSecret``.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read config file: {exc.strerror}") from None
    config = parse_config(text, source=str(file), env=env, require_secrets=require_secrets)
    return config.with_base_dir(file.parent)


def parse_config(
    text: str,
    *,
    source: str = "config.yaml",
    env: Mapping[str, str] | None = None,
    require_secrets: bool = True,
) -> RouterConfig:
    """Validate config text; relative paths start at the working directory.
    ``require_secrets``: as ``load_config``'s."""
    try:
        data, duplicates = _read_yaml(text, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        raise ConfigError(f"{source}: invalid YAML at {where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if duplicates:
        raise ConfigError(_report(source, duplicates))
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping (databases:, brokers:, ...)")
    problems: list[str] = []
    environment = os.environ if env is None else env
    unset = _Unset(data, require_secrets)
    data = _interpolate(data, (), environment, problems, unset)
    if problems:
        raise ConfigError(_report(source, problems))
    try:
        config = RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_report(source, _describe(exc, data))) from None
    _warn_replaced(config, source)
    return config


def _warn_replaced(config: RouterConfig, source: str) -> None:
    """A ``ConfigDeprecationWarning`` for each setting a config of an earlier release may
    hold that this one accepts but no longer uses."""
    if "open_after" in config.outbox.circuit.model_fields_set:
        warnings.warn(
            f"{source}: outbox.circuit.open_after is ignored: a host's circuit now opens at the "
            "first publish its broker leaves unanswered; delete the key "
            "(outbox.circuit.probe_max_delay sets how soon a host claims again once its "
            "broker answers)",
            ConfigDeprecationWarning,
            stacklevel=4,  # the caller of load_config
        )


def require_clients(config: RouterConfig, source: str = "config.yaml") -> None:
    """Raise ``ConfigError`` naming each broker whose client library, and each database whose
    driver, is not installed.

    Only the kinds the config uses count; nothing is imported to find out.
    """
    problems = [
        problem
        for name, database in config.databases.items()
        if (problem := missing_driver(database.kind, f"databases.{name}")) is not None
    ]
    problems += [
        f"brokers.{name}: {hint}"
        for name, settings in config.brokers.items()
        if (hint := settings.missing_client()) is not None
    ]
    if problems:
        raise ConfigError(_report(source, problems))


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that notes every mapping key given twice, with its YAML path and lines.

    Plain YAML keeps the last of two equal keys: a second broker of one name, or a setting
    given twice, would silently replace the first.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[int, str]] = []
        # Parents are constructed before their children, so a child's path is known by then.
        self._paths: dict[Node, tuple[str | int, ...]] = {}

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        """Check the keys written in this mapping, then build it as SafeLoader does."""
        path = self._paths.get(node, ())
        first_line: dict[Any, int] = {}
        # Only the mapping's own keys are compared, before ``<<`` merges are flattened in:
        # overriding a merged key is what merge keys are for.
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                seen = first_line.get(key)
            except TypeError:  # unhashable: SafeLoader reports it below
                continue
            if seen is None:
                first_line[key] = line
            else:
                where = f"lines {seen} and {line}" if seen != line else f"line {line}"
                problem = f"{_dotted((*path, str(key)))}: key given twice ({where})"
                self.duplicates.append((line, problem))
            self._paths.setdefault(value_node, (*path, str(key)))
        return super().construct_mapping(node, deep=deep)

    def construct_sequence(self, node: SequenceNode, deep: bool = False) -> list[Any]:
        """Build a list as SafeLoader does, noting its items' paths."""
        path = self._paths.get(node, ())
        for index, item in enumerate(node.value):
            self._paths.setdefault(item, (*path, index))
        return super().construct_sequence(node, deep=deep)


def _read_yaml(text: str, source: str) -> tuple[Any, list[str]]:
    """The document, and a problem for each key given twice.

    Raises ConfigError, before building anything, for a document whose aliases make it
    explode (a "billion laughs") or contain itself.
    """
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        _check_expansion(node, source)
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    # Nested mappings are built after their parents: list the problems as the file reads.
    return data, [problem for _, problem in sorted(loader.duplicates)]


# Values aliases may add to a document. A config has hundreds; the alias bomb of nine lines
# has 387 million, which interpolation and validation would walk one by one (minutes, GBs).
_MAX_EXPANDED = 100_000


def _check_expansion(root: Node, source: str) -> None:
    """Refuse a document whose aliases expand it past ``_MAX_EXPANDED`` values, or that
    contains itself; each node is visited once, so the bomb costs microseconds."""
    sizes: dict[Node, int] = {}
    open_nodes: set[Node] = set()

    def size(node: Node) -> int:
        if node in sizes:
            return sizes[node]
        if node in open_nodes:
            raise _SelfContaining(node)
        open_nodes.add(node)
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [part for pair in node.value for part in pair]
        total = 1 + sum(size(child) for child in children)
        open_nodes.discard(node)
        sizes[node] = total
        return total

    try:
        expanded = size(root)
    except _SelfContaining as loop:
        raise ConfigError(f"{source}: {loop}") from None
    except RecursionError:  # deeper than any config: nested thousands of levels
        raise ConfigError(f"{source}: the YAML is nested too deeply to be a config") from None
    if expanded - len(sizes) > _MAX_EXPANDED:
        raise ConfigError(
            f"{source}: its aliases (*name) expand it to more than {_MAX_EXPANDED} values "
            f"({len(sizes)} written): refused, as a config never needs that many; write "
            "repeated parts out, or use fewer aliases"
        )


class _SelfContaining(Exception):
    """A node reached again from inside itself: an alias within its own anchor."""

    def __init__(self, node: Node) -> None:
        super().__init__()
        self.node = node

    def __str__(self) -> str:
        mark = self.node.start_mark
        return (
            f"refused: the value at line {mark.line + 1}, column {mark.column + 1} contains "
            "itself (an alias *name inside its own anchor &name)"
        )


def _interpolate(
    node: Any,
    path: tuple[str | int, ...],
    env: Mapping[str, str],
    problems: list[str],
    unset: _Unset,
) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(v, (*path, str(k)), env, problems, unset) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, (*path, i), env, problems, unset) for i, v in enumerate(node)]
    if not isinstance(node, str) or "$" not in node:
        return node
    missing: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        missing.append(f"{_dotted(path)}: environment variable {name} is not set")
        return ""

    # Always text: a password of digits must stay a string; numeric and boolean settings
    # accept their text form ("4222", "true") when the model validates them.
    text = _VAR.sub(substitute, node)
    if missing and unset.may_stay(path):
        return UnsetSecret("; ".join(missing))
    problems.extend(missing)
    return text


class _Unset:
    """Which settings may keep an unset variable: none, unless the config is loaded to stage
    events; then the secrets only connecting to a broker or serving HTTP read (staging needs
    the databases' URLs, and every broker's routing settings, but no broker's credentials)."""

    def __init__(self, data: dict[str, Any], require_secrets: bool) -> None:
        self.data = data
        self.require_secrets = require_secrets

    def may_stay(self, path: tuple[str | int, ...]) -> bool:
        """True when the setting at ``path`` may be an ``UnsetSecret``."""
        if self.require_secrets or not path or path[0] == "databases":
            return False
        if path[0] != "brokers":
            return _is_secret(RouterConfig, path)
        if len(path) < 3:
            return False
        brokers = self.data.get("brokers")
        broker = brokers.get(path[1]) if isinstance(brokers, dict) else None
        kind = _BROKER_KINDS.get(broker.get("type")) if isinstance(broker, dict) else None
        return kind is not None and _is_secret(kind, path[2:])


# type: -> the settings class of that kind of broker
_BROKER_KINDS: dict[Any, type[BaseModel]] = {
    get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in get_args(get_args(AnyBrokerSettings)[0])
}


def _is_secret(model: type[BaseModel], path: Sequence[str | int]) -> bool:
    """Whether ``path`` in ``model`` names a ``SecretStr`` setting (in nested models too)."""
    field = model.model_fields.get(str(path[0])) if path else None
    if field is None:
        return False
    for kind in get_args(field.annotation) or (field.annotation,):
        if not isinstance(kind, type):
            continue
        if len(path) == 1 and issubclass(kind, SecretStr):
            return True
        if len(path) > 1 and issubclass(kind, BaseModel) and _is_secret(kind, path[1:]):
            return True
    return False


def _describe(exc: ValidationError, data: dict[str, Any]) -> list[str]:
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = _drop_union_tags(error["loc"], data)
        if loc and loc[-1] == "[key]":  # pydantic's mark for a refused mapping key
            loc = loc[:-1]
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see docs/reference/configuration.md)"
        elif error["type"] == "missing":
            message = "required key is missing"
        elif error["type"] == "union_tag_invalid":
            ctx = error.get("ctx", {})
            message = f"unknown type {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
        elif error["type"] == "union_tag_not_found":
            message = "'type' is missing (which kind of broker is this?)"
        problems.append(f"{_dotted(loc)}: {message}" if loc else message)
    return problems


def _drop_union_tags(loc: tuple[int | str, ...], data: Any) -> tuple[int | str, ...]:
    """Pydantic puts a discriminated union's tag ('nats') into the path; YAML has no such key."""
    kept: list[int | str] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part not in node and part == node.get("type"):
            continue
        kept.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(kept)


def _dotted(path: tuple[int | str, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _report(source: str, problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    noun = "problem" if len(problems) == 1 else "problems"
    return f"{source}: {len(problems)} {noun}:\n{lines}"
