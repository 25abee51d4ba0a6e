"""Where each ``Recipe`` value comes from: flag > env ``TRAIN_*`` > config file > default.

- A config file (``--config PATH`` or ``TRAIN_CONFIG``) is YAML (``.yaml``/``.yml``) or JSON
  (``.json``): one mapping of field names (``snake_case``; ``kebab-case`` accepted) to values.
- ``TRAIN_<FIELD>`` environment variables, e.g. ``TRAIN_LEARNING_RATE=1e-5``.
- ``--<field-in-kebab-case>`` flags, e.g. ``--learning-rate 1e-5``; booleans are ``--flag`` /
  ``--no-flag``. For a field that may be unset, the value ``none`` unsets it.

Strings from env and flags are converted and validated by the ``Recipe`` model, so a bad value is
reported with the field name and the source it came from. Unknown keys in a file are an error with
a suggestion, never silently ignored; so is a ``TRAIN_*`` variable close to a field's name.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer.recipe import Recipe

ENV_PREFIX = "TRAIN_"
CONFIG_ENV = f"{ENV_PREFIX}CONFIG"
_NONE_WORDS = frozenset({"none", "null", ""})


class ConfigError(ValueError):
    """The configuration is unusable; the message names the field and where its value came from."""


@dataclass(frozen=True)
class LoadedConfig:
    """The validated recipe, plus where every non-default value came from (for logs)."""

    recipe: Recipe
    sources: dict[str, str]  # field -> "flag" | "env TRAIN_X" | "file PATH" | "default"
    print_config: bool = False


def _is_bool(name: str) -> bool:
    return Recipe.model_fields[name].annotation is bool


def _allows_none(name: str) -> bool:
    annotation = Recipe.model_fields[name].annotation
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _none_words(values: dict[str, Any]) -> dict[str, Any]:
    """Map the textual 'none' to None for fields that may be unset."""
    return {
        k: None
        if isinstance(v, str) and v.strip().lower() in _NONE_WORDS and _allows_none(k)
        else v
        for k, v in values.items()
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-train",
        description="Run the published AsyncGRPO + LoRA recipe through the rollout proxy. "
        f"Every option is also an env var ({ENV_PREFIX}<NAME>) and a config-file key; "
        "precedence: flag > env > file > default.",
        argument_default=argparse.SUPPRESS,  # only flags actually given appear in the namespace
    )
    parser.add_argument(
        "--config", metavar="PATH", help=f"YAML or JSON config file (or {CONFIG_ENV})"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration with the source of each value, then exit",
    )
    for name, field in Recipe.model_fields.items():
        help_text = f"{field.description} [default: {field.default!r}]"
        if _is_bool(name):
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(_flag(name), dest=name, metavar="VALUE", help=help_text)
    return parser


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML/JSON mapping of recipe fields; unknown keys are an error with a suggestion."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    text = file.read_text()
    suffix = file.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml  # type: ignore[import-untyped]

            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {file}: use .yaml, .yml or .json, not {suffix!r}")
    except (json.JSONDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config file {file} is not valid {suffix[1:].upper()}: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError and friends
        raise ConfigError(f"config file {file} could not be parsed: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {file} must hold a mapping of options, not {type(data).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in Recipe.model_fields:
            close = difflib.get_close_matches(name, list(Recipe.model_fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"config file {file}: unknown option {key!r}{hint}")
        values[name] = value
    return _none_words(values)


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``TRAIN_<FIELD>`` variables in ``environ``.

    A ``TRAIN_`` variable that is no field but close to one (``TRAIN_LEARNING_RAT``) is a typo and
    an error; one that resembles no field belongs to someone else (``TRAIN_CMD``, read by
    ``deploy/train_with_proxy.sh``) and is left alone.
    """
    values: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in Recipe.model_fields:
            close = difflib.get_close_matches(name, list(Recipe.model_fields), n=1, cutoff=0.8)
            if close:
                suggestion = ENV_PREFIX + close[0].upper()
                raise ConfigError(f"unknown environment variable {key}; did you mean {suggestion}?")
            continue
        values[name] = value
    return _none_words(values)


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Resolve the recipe from flags, environment and config file, in that order of precedence."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(list(argv) if argv is not None else None))
    print_config = bool(args.pop("print_config", False))
    config_path = args.pop("config", None) or environ.get(CONFIG_ENV)

    layers: list[tuple[str, dict[str, Any]]] = []
    if config_path:
        layers.append((f"file {config_path}", read_config_file(config_path)))
    layers.append(("env", read_env(environ)))
    layers.append(("flag", _none_words(args)))

    merged: dict[str, Any] = {}
    sources: dict[str, str] = dict.fromkeys(Recipe.model_fields, "default")
    for label, values in layers:
        for name, value in values.items():
            merged[name] = value
            sources[name] = f"env {ENV_PREFIX}{name.upper()}" if label == "env" else label
    try:
        recipe = Recipe.model_validate(merged)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            loc = error.get("loc") or ()
            name = str(loc[0]) if loc else ""
            where = f" (from {sources[name]})" if name in sources else ""
            label = name or "configuration"
            problems.append(f"{label}{where}: {error['msg']}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from exc
    return LoadedConfig(recipe=recipe, sources=sources, print_config=print_config)


def describe(loaded: LoadedConfig) -> str:
    """One line per field: value and source, for ``--print-config`` and the run log."""
    width = max(len(n) for n in Recipe.model_fields)
    lines = []
    for name in Recipe.model_fields:
        lines.append(
            f"{name:<{width}}  {getattr(loaded.recipe, name)!r:<40}  {loaded.sources[name]}"
        )
    return "\n".join(lines)
