"""The run settings: each declared once, with its type, bounds, choices and help text.

A run setting is what a single run may override without editing its partition file: a ``datagen
run`` option, a parameter of the ``datagen`` flow (a field of Prefect's custom-run form) and a row
of docs/configuration.md. All three are generated from :data:`RUN_SETTINGS`:

- ``datagen run``'s options: :func:`add_cli_options`;
- the flow's signature, type hints and ``Args:`` docstring (which Prefect turns into the
  deployment's parameter schema and the form): :func:`flow_parameters`, applied by
  ``flows.params.declared``;
- the reference table: :func:`reference_table`.

Adding a setting is one :class:`RunSetting` here and its application in
``PartitionConfig.with_overrides`` (which checks it with ``check`` and says where it goes).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

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
from tasks.prompts import REGENERATE_MODES
from tasks.reasoning import PARSERS

__all__ = [
    "BACKENDS",
    "PARTITION",
    "RUN_SETTINGS",
    "Overrides",
    "RunSetting",
    "add_cli_options",
    "check_text",
    "flow_parameters",
    "reference_table",
]

BACKENDS = ("sglang", "emulator")


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


@dataclass(frozen=True)
class RunSetting:
    """One run setting.

    Args:
        name: the flow parameter, the ``Overrides`` attribute and (dashed) the CLI option.
        type: the value's type (``str``, ``int`` or ``float``).
        help: what it does, for the form, ``--help`` and the reference.
        key: the partition key it overrides (``[run] shard_size``), or "" for none.
        check: the config's validator, ``check(value, where, key) -> value``.
        ge, gt, lt: bounds (the form's and the flow's validation; ``check`` enforces them too).
        choices: the allowed values (a select in the form, ``choices`` in argparse).
        many: a list of values (repeatable on the command line).
        one_or_many: the flow takes one value or a list (``server_url``).
        flag: the CLI option when it is not ``--name-with-dashes``.
        metavar: the CLI metavar.
        cli_help: a CLI-only remark appended to ``help`` (e.g. a default that differs).
    """

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

    def value_type(self) -> Any:
        """One value's type, with its choices or bounds (pydantic reads them for the form)."""
        if self.choices:
            return Literal[self.choices]  # type: ignore[valid-type]
        if self.ge is None and self.gt is None and self.lt is None and self.le is None:
            return self.type
        return Annotated[self.type, Field(ge=self.ge, gt=self.gt, lt=self.lt, le=self.le)]

    def annotation(self) -> Any:
        """The flow parameter's type: None (keep the partition's value) or a value."""
        one = self.value_type()
        if self.many:
            return list[one] | None  # type: ignore[valid-type]
        if self.one_or_many:
            return one | list[one] | None  # type: ignore[valid-type]
        return one | None


# The partition itself: a flow parameter and a CLI option, not an override of a partition key.
PARTITION = RunSetting(
    "partition", str, "Partition to run: a name in deployments/ (all, demo, ...) or a path to a TOML file.", "",
    metavar="NAME|FILE.toml", cli_help="default: adhoc with --input, else all",
)

RUN_SETTINGS: tuple[RunSetting, ...] = (
    RunSetting("inputs", str, "Ad-hoc dataset files (JSONL or Parquet) replacing the partition's [datasets]; "
               "each is named after its file.", "", many=True, flag="--input", metavar="PATH"),
    RunSetting("model_path", str, "Model directory on the server's host (an --input run on the emulator: the "
               "bundled demo model when not given).", "[model] path", metavar="DIR"),
    RunSetting("out", str, "Output directory, used as is: no nightly versioning.", "[output] root", metavar="DIR"),
    RunSetting("backend", str, "Server backend: sglang, or the emulator (no GPU).", "[server] backend",
               check=_choice(BACKENDS), choices=BACKENDS),
    RunSetting("server_url", str, "Running servers to use (http://host:port; one or a list): no launch, no "
               "GPU hygiene; work goes to whichever is free.", "[run] server_url", one_or_many=True,
               metavar="URL", cli_help="repeatable"),
    RunSetting("shard_size", int, "Rows per committed shard.", "[run] shard_size", check=int_from(1, MAX_SHARD_SIZE),
               ge=1, le=MAX_SHARD_SIZE, metavar="N"),
    RunSetting("concurrency", int, "Requests in flight to each server; default: twice the running slots the "
               "server reports (16..1024).", "[run] concurrency", check=positive_int, ge=1, metavar="N"),
    RunSetting("tp_size", int, "GPUs the launched server uses, tensor parallel.", "[server] tp_size",
               check=positive_int, ge=1, metavar="N"),
    RunSetting("mem_fraction_static", float, "SGLang --mem-fraction-static for the first launch of this run: "
               "wins over the fraction the tuner remembers (a relaunch after a runtime OOM still goes lower).",
               "[server] mem_fraction_static is only where the tuner starts", check=fraction, gt=0.0, lt=1.0,
               metavar="F"),
    RunSetting("reasoning_parser", str, "SGLang reasoning parser splitting reasoning from content; default: "
               "the model's.", "[model] reasoning_parser", check=parser_name, choices=tuple(sorted(PARSERS)),
               metavar="NAME"),
    RunSetting("truncation_retries", int, "Times a row that finished by length is generated again with a "
               "larger budget; 0: off.", "[run.truncation] retries", check=nonneg_int, ge=0, metavar="N"),
    RunSetting("samples", int, "Rows per prompt, each with its own sampling seed.", "[run] samples",
               check=int_from(1, MAX_SAMPLES), ge=1, le=MAX_SAMPLES, metavar="N"),
    RunSetting("regenerate", str, "last: regenerate the last assistant turn; all: every assistant turn, each "
               "from the model's own earlier turns.", "[run] regenerate", check=regenerate_mode,
               choices=REGENERATE_MODES),
)

_BY_NAME: Mapping[str, RunSetting] = {s.name: s for s in RUN_SETTINGS}


class Overrides:
    """The run settings a run sets (``datagen run`` options, the flow's parameters): each one of
    :data:`RUN_SETTINGS` by name; an unset one reads None and keeps the partition's value."""

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(_BY_NAME))
        if unknown:
            raise TypeError(f"not run settings: {', '.join(unknown)} (known: {', '.join(self.names())})")
        clean: dict[str, Any] = {}
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, list | tuple):
                value = tuple(str(v) for v in value)
                if not value:
                    continue
            clean[name] = value
        object.__setattr__(self, "_values", clean)

    def __getattr__(self, name: str) -> Any:
        if name in _BY_NAME:
            return self._values.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Overrides is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Overrides) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"Overrides({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def items(self) -> Iterable[tuple[RunSetting, Any]]:
        """The set settings with their values, in declaration order."""
        return [(s, self._values[s.name]) for s in RUN_SETTINGS if s.name in self._values]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The run settings' names, in declaration order."""
        return tuple(_BY_NAME)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Overrides:
        """The run settings among ``values`` (argparse's namespace, the flow's parameters); other
        keys and None values are ignored."""
        return cls(**{k: values[k] for k in _BY_NAME if values.get(k) is not None})

    def as_kwargs(self) -> dict[str, Any]:
        """The set settings as keyword arguments of the flow (lists where the flow takes one)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._values.items()}


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


def flow_parameters(settings: Iterable[RunSetting] = RUN_SETTINGS) -> list[inspect.Parameter]:
    """The flow's keyword parameters, one per setting, each defaulting to None."""
    return [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=s.annotation())
            for s in settings]


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
