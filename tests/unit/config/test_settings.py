"""The run settings are one typed model (tasks.config.RunSettings): the `datagen run` options, the
flow's signature and the deployment's form schema all come from it, and a new field appears in
all three."""

from __future__ import annotations

import argparse
import inspect
import typing
from pathlib import Path
from typing import Annotated, Any, get_args

import pytest
from prefect import flow
from prefect.utilities.callables import parameter_schema
from pydantic import BaseModel, ConfigDict, Field

from datagen.cmd_run import build_parser
from flows.datagen import datagen
from flows.params import declared, form_schema
from tasks.config import (
    BACKENDS,
    PARTITION,
    RUN_SETTINGS,
    ConfigError,
    ParserName,
    RunSettings,
    add_cli_options,
    flow_parameters,
    load_partition,
    reference_table,
    settings_of,
)
from tasks.config._settings import Setting
from tasks.reasoning import PARSERS
from tasks.server import ServerConfig, ServerConfigError


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def _schema(fn: Any) -> dict[str, Any]:
    return form_schema(parameter_schema(fn).model_dump())["properties"]


def _typed(prop: dict[str, Any]) -> dict[str, Any]:
    """A form property without what only labels it (title, position, description)."""
    return {k: v for k, v in prop.items() if k not in ("title", "position", "description")}


def _signature(fn: Any) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(fn, include_extras=True)
    return [p.replace(annotation=hints[p.name]) for p in inspect.signature(fn).parameters.values()]


def test_the_flow_signature_is_the_models_fields() -> None:
    params = _signature(datagen.fn)
    assert params[0] == inspect.Parameter("partition", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="all",
                                          annotation=str)
    assert params[1:] == flow_parameters(RunSettings)
    assert [p.name for p in params[1:]] == list(RunSettings.model_fields)


def test_the_form_is_the_models_schema() -> None:
    model = form_schema(RunSettings.model_json_schema())["properties"]
    props = _schema(datagen)
    assert list(props) == ["partition", *model]
    for name, prop in model.items():
        assert _typed(props[name]) == _typed(prop), name
        key = settings_of(RunSettings)[list(model).index(name)].key
        assert props[name]["description"] == prop["description"] + (f" ({key})" if key else "")


def test_the_cli_is_the_models_fields() -> None:
    options = _options(build_parser())
    assert list(options) == [s.name for s in (PARTITION, *RUN_SETTINGS)]
    model = RunSettings.model_json_schema()["properties"]
    for s in RUN_SETTINGS:
        opt, typed = options[s.name], [b for b in model[s.name]["anyOf"] if b["type"] != "null"]
        assert opt.option_strings == [s.option] and s.description in (opt.help or "")
        assert isinstance(opt, argparse._AppendAction) == any(b["type"] == "array" for b in typed)
        one = next((b for b in typed if b["type"] != "array"), None) or typed[0]["items"]
        assert (opt.choices or None) == (tuple(one["enum"]) if "enum" in one else None)
        assert (opt.type or str) is {"string": str, "integer": int, "number": float}[one["type"]]
        assert (s.ge, s.le, s.gt, s.lt) == (one.get("minimum"), one.get("maximum"), one.get("exclusiveMinimum"),
                                            one.get("exclusiveMaximum"))


def test_the_literal_choices_are_their_owners() -> None:
    assert set(get_args(ParserName)) == set(PARSERS)
    for backend in BACKENDS:  # the server's own list (tasks.server), which its config enforces
        assert ServerConfig(model_path="m", backend=backend).backend == backend  # type: ignore[arg-type]
    with pytest.raises(ServerConfigError, match="backend"):
        ServerConfig(model_path="m", backend="vllm")  # type: ignore[arg-type]


TopK = Annotated[int, Field(ge=2)]
_NEW = Annotated[TopK | None, Setting("[run.sampling] top_k", metavar="K"), Field(description="Cap on top_k.")]


class _Extra(RunSettings):
    top_k_cap: _NEW = None


class _Probe(BaseModel):
    """A model of the new field alone, for a probe flow that declares only it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    top_k_cap: _NEW = None


def test_a_new_field_appears_in_the_cli_the_signature_and_the_form() -> None:
    parser = argparse.ArgumentParser()
    add_cli_options(parser, settings_of(_Extra))
    assert parser.parse_args(["--top-k-cap", "5"]).top_k_cap == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--top-k-cap", "five"])

    assert [x.name for x in settings_of(_Extra)] == [*RunSettings.model_fields, "top_k_cap"]

    def missing(partition: str = "all") -> None:
        return None

    def mistyped(partition: str = "all", top_k_cap: int | None = None) -> None:
        return None

    def probe(partition: str = "all", top_k_cap: TopK | None = None) -> None:
        return None

    # the flow must declare it, with its type: a signature without it, or with another type, is refused
    for wrong in (missing, mistyped):
        with pytest.raises(TypeError, match="top_k_cap"):
            declared(wrong, _Probe)
    f = flow(name="probe")(declared(probe, _Probe))
    prop = _schema(f)["top_k_cap"]
    assert prop == {"description": "Cap on top_k. ([run.sampling] top_k)", "minimum": 2, "position": 1,
                    "title": "top_k_cap", "type": "integer"}
    assert f.validate_parameters({"top_k_cap": 3})["top_k_cap"] == 3
    with pytest.raises(Exception, match="greater than or equal to 2"):
        f.validate_parameters({"top_k_cap": 1})


def test_overrides_take_only_declared_names_and_check_them_with_the_declaration() -> None:
    with pytest.raises(TypeError, match="not run settings: nope"):
        RunSettings(nope=1)
    cfg = load_partition("demo")
    with pytest.raises(ConfigError, match=r"^override: samples: 0 is not a positive integer"):
        cfg.with_overrides(RunSettings(samples=0))
    with pytest.raises(ConfigError, match=r"^override: backend: 'vllm' is not one of sglang, emulator"):
        cfg.with_overrides(RunSettings(backend="vllm"))
    assert cfg.with_overrides(RunSettings(mem_fraction_static=0.8)).server.launch.mem_fraction_static == 0.8


def test_the_configuration_reference_is_generated_from_the_declarations() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    start = text.index("-->\n", text.index("<!-- run-settings")) + 4
    assert text[start:text.index("<!-- /run-settings -->")] == reference_table(), (
        "docs/configuration.md's run settings differ from RunSettings: paste tasks.config.reference_table()")
