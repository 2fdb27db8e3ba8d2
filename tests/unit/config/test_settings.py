"""Each run setting is declared once (tasks.config.RUN_SETTINGS): the `datagen run` options, the
flow's signature and the deployment's form schema are generated from that declaration."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.utilities.callables import parameter_schema

from datagen.cmd_run import build_parser
from flows.datagen import datagen
from flows.params import declared, form_schema
from tasks.config import (
    PARTITION,
    RUN_SETTINGS,
    ConfigError,
    Overrides,
    RunSetting,
    add_cli_options,
    load_partition,
    reference_table,
)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def _schema(fn: Any) -> dict[str, Any]:
    return form_schema(parameter_schema(fn).model_dump())["properties"]


def test_cli_flow_and_form_have_exactly_the_declared_settings() -> None:
    names = [s.name for s in (PARTITION, *RUN_SETTINGS)]
    options = _options(build_parser())
    assert list(options) == names
    assert list(inspect.signature(datagen).parameters) == names
    props = _schema(datagen)
    assert list(props) == names
    for s in RUN_SETTINGS:
        opt, prop = options[s.name], props[s.name]
        assert opt.option_strings == [s.option]
        assert s.description in (opt.help or "")
        assert prop["description"] == s.description
        assert (opt.choices or ()) == (s.choices or ())
        assert isinstance(opt, argparse._AppendAction) == (s.many or s.one_or_many)
        assert inspect.signature(datagen).parameters[s.name].default is None
        if s.choices:
            assert prop["enum"] == list(s.choices)
        if s.ge is not None:
            assert prop["minimum"] == s.ge
        if s.le is not None:
            assert prop["maximum"] == s.le
        if s.gt is not None:
            assert prop["exclusiveMinimum"] == s.gt and prop["exclusiveMaximum"] == s.lt


def test_a_new_declaration_appears_in_the_cli_the_signature_and_the_form() -> None:
    extra = RunSetting("top_k_cap", int, "Cap on top_k.", "[run.sampling] top_k", ge=2, metavar="K")
    settings = (*RUN_SETTINGS, extra)

    parser = argparse.ArgumentParser()
    add_cli_options(parser, settings)
    assert parser.parse_args(["--top-k-cap", "5"]).top_k_cap == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--top-k-cap", "five"])

    def body(partition: str = "all", **values: Any) -> dict[str, Any]:
        return values

    f = flow(name="probe")(declared(body, settings))
    assert inspect.signature(f).parameters["top_k_cap"].default is None
    prop = _schema(f)["top_k_cap"]
    assert prop == {"description": "Cap on top_k. ([run.sampling] top_k)", "minimum": 2, "position": len(settings),
                    "title": "top_k_cap", "type": "integer"}
    assert f.validate_parameters({"top_k_cap": 3})["top_k_cap"] == 3
    with pytest.raises(Exception, match="greater than or equal to 2"):
        f.validate_parameters({"top_k_cap": 1})


def test_overrides_take_only_declared_names_and_check_them_with_the_declaration() -> None:
    with pytest.raises(TypeError, match="not run settings: nope"):
        Overrides(nope=1)
    cfg = load_partition("demo")
    with pytest.raises(ConfigError, match=r"^override: samples: 0 is not a positive integer"):
        cfg.with_overrides(Overrides(samples=0))
    with pytest.raises(ConfigError, match=r"^override: backend: 'vllm' is not one of sglang, emulator"):
        cfg.with_overrides(Overrides(backend="vllm"))
    assert cfg.with_overrides(Overrides(mem_fraction_static=0.8)).server.launch.mem_fraction_static == 0.8


def test_the_configuration_reference_is_generated_from_the_declarations() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    start = text.index("-->\n", text.index("<!-- run-settings")) + 4
    assert text[start:text.index("<!-- /run-settings -->")] == reference_table(), (
        "docs/configuration.md's run settings differ from RUN_SETTINGS: paste tasks.config.reference_table()")
