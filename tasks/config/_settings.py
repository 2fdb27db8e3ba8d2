"""The run settings: one typed model, :class:`RunSettings`, each field declared once with its type,
bounds, choices and help text.

A run setting is what a single run may override without editing its partition file: a ``datagen
run`` option, a parameter of the ``datagen`` flow (a field of Prefect's custom-run form) and a row
of docs/configuration.md. All three come from the model:

- ``datagen run``'s options: :func:`add_cli_options`, from the model's JSON schema (types, bounds,
  choices, lists) and each field's :class:`Setting` (partition key, option, metavar);
- the flow's signature: flows/datagen.py declares one parameter per field with the field's own
  type (mypy checks the flow against the model), and ``flows.params.declared`` writes its
  ``Args:`` docstring from the descriptions; Prefect builds the parameter schema and the form from
  both. tests/unit/config/test_settings.py proves the three agree with the model;
- the reference table: :func:`reference_table`.

Adding a setting is one field here, its parameter in the flow, and, where it is not a ``[run]`` or
``[model]`` value of the same name, its application in ``PartitionConfig.with_overrides``.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.config._checks import (
    MAX_SAMPLES,
    MAX_SHARD_SIZE,
    ConfigError,
    fraction,
    int_from,
    nonneg_int,
    parser_name,
    positive_int,
    regenerate_mode,
)
from tasks.server import BACKENDS, Backend

__all__ = [
    "BACKENDS",
    "PARTITION",
    "RUN_SETTINGS",
    "Backend",
    "Fraction",
    "NonNegative",
    "ParserName",
    "Positive",
    "RegenerateMode",
    "RunSetting",
    "RunSettings",
    "Samples",
    "Setting",
    "ShardSize",
    "add_cli_options",
    "check_text",
    "flow_parameters",
    "reference_table",
    "settings_of",
]


def check_text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: {key}: {value!r} is not a non-empty string")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str, str], str]:
    def check(value: Any, where: str, key: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where}: {key}: {value!r} is not one of {', '.join(choices)}")
        return str(value)

    return check


def _texts(value: Any, where: str, key: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list | tuple) else None
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise ConfigError(f"{where}: {key}: {value!r} is not a non-empty string or a list of them")
    return items


@dataclass(frozen=True)
class Setting:
    """Where a run setting lands and how it reads on the command line, in its field's metadata
    (pydantic keeps it there and validates nothing with it).

    Args:
        key: the partition key it overrides (``[run] shard_size``), or "" for none.
        check: the config's validator, ``check(value, where, key) -> value``: its ConfigError names
            the setting the way a partition file's error names its key.
        flag: the CLI option when it is not ``--name-with-dashes``.
        metavar: the CLI metavar.
        cli_help: a CLI-only remark appended to the help (e.g. a default that differs).
    """

    key: str
    check: Callable[[Any, str, str], Any] = check_text
    flag: str | None = None
    metavar: str | None = None
    cli_help: str = ""


# The value types of the settings, each with its bounds or choices (the form's, Prefect's validation
# of the flow's parameters, the CLI's choices). BACKENDS and the parser names are checked against
# their owners by the tests; the backends are the server's (tasks.server).
ParserName = Literal["deepseek-r1", "glm45", "gpt-oss", "interns1", "kimi", "kimi_k2", "minimax", "mistral",
                     "nemotron_3", "qwen3", "qwen3-thinking", "step3"]
RegenerateMode = Literal["last", "all"]
ShardSize = Annotated[int, Field(ge=1, le=MAX_SHARD_SIZE)]
Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Samples = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]


class RunSettings(BaseModel):
    """The run settings a run sets (``datagen run`` options, the flow's parameters); an unset one is
    None and keeps the partition's value. A value outside its type raises ``ConfigError`` naming
    the setting ("override: shard_size: ..."); unknown names raise ``TypeError``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    inputs: Annotated[tuple[str, ...] | None, Setting("", _texts, flag="--input", metavar="PATH"), Field(
        description="Ad-hoc dataset files (JSONL or Parquet) replacing the partition's [datasets]; each is "
                    "named after its file.")] = None
    model_path: Annotated[str | None, Setting("[model] path", metavar="DIR"), Field(
        description="Model directory on the server's host (an --input run on the emulator: the bundled demo "
                    "model when not given).")] = None
    out: Annotated[str | None, Setting("[output] root", metavar="DIR"), Field(
        description="Output directory, used as is: no nightly versioning.")] = None
    backend: Annotated[Backend | None, Setting("[server] backend", _choice(BACKENDS)), Field(
        description="Server backend: sglang, or the emulator (no GPU).")] = None
    server_url: Annotated[str | tuple[str, ...] | None, Setting("[run] server_url", _texts, metavar="URL",
                                                                 cli_help="repeatable"), Field(
        description="Running servers to use (http://host:port; one or a list): no launch, no GPU hygiene; "
                    "work goes to whichever is free.")] = None
    shard_size: Annotated[ShardSize | None, Setting("[run] shard_size", int_from(1, MAX_SHARD_SIZE), metavar="N"),
                          Field(description="Rows per committed shard.")] = None
    concurrency: Annotated[Positive | None, Setting("[run] concurrency", positive_int, metavar="N"), Field(
        description="Requests in flight to each server; default: twice the running slots the server reports "
                    "(16..1024).")] = None
    tp_size: Annotated[Positive | None, Setting("[server] tp_size", positive_int, metavar="N"), Field(
        description="GPUs the launched server uses, tensor parallel.")] = None
    mem_fraction_static: Annotated[Fraction | None, Setting(
        "[server] mem_fraction_static is only where the tuner starts", fraction, metavar="F"), Field(
        description="SGLang --mem-fraction-static for the first launch of this run: wins over the fraction "
                    "the tuner remembers (a relaunch after a runtime OOM still goes lower).")] = None
    reasoning_parser: Annotated[ParserName | None, Setting("[model] reasoning_parser", parser_name, metavar="NAME"),
                                Field(description="SGLang reasoning parser splitting reasoning from content; "
                                                  "default: the model's.")] = None
    truncation_retries: Annotated[NonNegative | None, Setting("[run.truncation] retries", nonneg_int, metavar="N"),
                                  Field(description="Times a row that finished by length is generated again "
                                                    "with a larger budget; 0: off.")] = None
    samples: Annotated[Samples | None, Setting("[run] samples", int_from(1, MAX_SAMPLES), metavar="N"), Field(
        description="Rows per prompt, each with its own sampling seed.")] = None
    regenerate: Annotated[RegenerateMode | None, Setting("[run] regenerate", regenerate_mode), Field(
        description="last: regenerate the last assistant turn; all: every assistant turn, each from the "
                    "model's own earlier turns.")] = None

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"not run settings: {', '.join(unknown)} (known: {', '.join(self.names())})")
        clean: dict[str, Any] = {}
        for name, value in values.items():
            if isinstance(value, list | tuple):
                value = tuple(value)
            if value is None or value == ():
                continue
            clean[name] = value
        try:
            super().__init__(**clean)
        except ValidationError as exc:
            raise _config_error(exc, clean) from None

    def items(self) -> list[tuple[RunSetting, Any]]:
        """The set settings with their values, in declaration order."""
        return [(s, getattr(self, s.name)) for s in RUN_SETTINGS if getattr(self, s.name) is not None]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The run settings' names, in declaration order."""
        return tuple(cls.model_fields)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunSettings:
        """The run settings among ``values`` (argparse's namespace, the flow's parameters); other
        keys are ignored, and None values as in the constructor."""
        return cls(**{k: values[k] for k in cls.model_fields if k in values})

    def as_kwargs(self) -> dict[str, Any]:
        """The set settings as keyword arguments of the flow (lists where the flow takes several)."""
        return {s.name: list(v) if isinstance(v, tuple) else v for s, v in self.items()}


def _config_error(exc: ValidationError, values: Mapping[str, Any]) -> ConfigError:
    """The ConfigError of the first invalid setting: its own check's message when the check refuses
    the value too, else pydantic's."""
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else "?"
    setting = _BY_NAME.get(name)
    if setting is not None and name in values:
        try:
            setting.check(values[name], "override", name)
        except ConfigError as mine:
            return mine
    return ConfigError(f"override: {name}: {values.get(name)!r}: {first['msg']}")


@dataclass(frozen=True)
class RunSetting:
    """One run setting as the command line and the reference see it (derived from
    :class:`RunSettings`; ``PARTITION`` is declared so)."""

    name: str
    type: type
    help: str
    key: str
    check: Callable[[Any, str, str], Any] = check_text
    ge: float | None = None
    gt: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    many: bool = False
    one_or_many: bool = False
    flag: str | None = None
    metavar: str | None = None
    cli_help: str = ""

    @property
    def option(self) -> str:
        """The ``datagen run`` option."""
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def description(self) -> str:
        """The help text with the partition key it overrides."""
        return f"{self.help} ({self.key})" if self.key else self.help


_JSON_TYPES: Mapping[str, type] = {"string": str, "integer": int, "number": float}


def settings_of(model: type[BaseModel]) -> tuple[RunSetting, ...]:
    """Each field of ``model`` as a RunSetting: type, bounds, choices and lists from the model's JSON
    schema (what Prefect's form shows), key and option from the field's Setting."""
    props = model.model_json_schema()["properties"]
    out = []
    for name, info in model.model_fields.items():
        (setting,) = [m for m in info.metadata if isinstance(m, Setting)]
        branches = [b for b in props[name].get("anyOf", [props[name]]) if b.get("type") != "null"]
        arrays = [b for b in branches if b.get("type") == "array"]
        one = next((b for b in branches if b.get("type") != "array"), None) or arrays[0]["items"]
        out.append(RunSetting(
            name, _JSON_TYPES[one["type"]], info.description or "", setting.key, setting.check,
            ge=one.get("minimum"), gt=one.get("exclusiveMinimum"), lt=one.get("exclusiveMaximum"),
            le=one.get("maximum"), choices=tuple(one.get("enum", ())), many=bool(arrays) and len(branches) == 1,
            one_or_many=bool(arrays) and len(branches) > 1, flag=setting.flag, metavar=setting.metavar,
            cli_help=setting.cli_help,
        ))
    return tuple(out)


# The partition itself: a flow parameter and a CLI option, not an override of a partition key.
PARTITION = RunSetting(
    "partition", str, "Partition to run: a name in deployments/ (all, demo, ...) or a path to a TOML file.", "",
    metavar="NAME|FILE.toml", cli_help="default: adhoc with --input, else all",
)
RUN_SETTINGS: tuple[RunSetting, ...] = settings_of(RunSettings)
_BY_NAME: Mapping[str, RunSetting] = {s.name: s for s in RUN_SETTINGS}


def add_cli_options(parser: argparse.ArgumentParser, settings: Iterable[RunSetting] = (PARTITION, *RUN_SETTINGS)) -> None:
    """One option per setting: ``--name`` (its ``flag``), its type, choices, repeatability and help."""
    for s in settings:
        kwargs: dict[str, Any] = {"dest": s.name, "help": s.description + (f" [{s.cli_help}]" if s.cli_help else "")}
        if s.type is not str:
            kwargs["type"] = s.type
        if s.choices:
            kwargs["choices"] = s.choices
        if s.many or s.one_or_many:
            kwargs["action"] = "append"
        if s.metavar:
            kwargs["metavar"] = s.metavar
        parser.add_argument(s.option, **kwargs)


def flow_parameters(model: type[BaseModel] = RunSettings) -> list[inspect.Parameter]:
    """The flow's parameters the model says it has: one per field, in order, with the field's type
    (its bounds and choices included) and None for default. flows/datagen.py declares them; the
    tests hold its signature against this."""
    return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                              annotation=info.annotation) for name, info in model.model_fields.items()]


def reference_table(settings: Iterable[RunSetting] = (PARTITION, *RUN_SETTINGS)) -> str:
    """The reference of the run settings as a markdown table (docs/configuration.md)."""
    lines = ["| flow parameter | `datagen run` | type | overrides | what it does |", "|---|---|---|---|---|"]
    for s in settings:
        kind = " \\| ".join(s.choices) if s.choices else s.type.__name__
        bounds = ", ".join(f"{op} {int(v):,}" if float(v).is_integer() else f"{op} {v:g}"
                           for op, v in ((">=", s.ge), (">", s.gt), ("<", s.lt), ("<=", s.le)) if v is not None)
        kind += f" ({bounds})" if bounds else ""
        kind += ", list" if s.many else ", one or a list" if s.one_or_many else ""
        lines.append(f"| `{s.name}` | `{s.option}` | {kind} | {s.key or '-'} | {s.help} |")
    return "\n".join(lines) + "\n"
