"""The datagen flow's parameters: the fields of the run settings model (tasks.config.RunSettings).

Prefect builds a deployment's parameter schema (and its custom-run form) from the flow's signature
and the ``Args:`` section of its docstring. The flow declares one parameter per field with the
field's type, which mypy checks; :func:`declared` refuses, at import, a signature that differs from
the model's, and writes the ``Args:`` section from the fields' descriptions. :func:`form_schema` then
tidies the optional parameters for the form.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from tasks.config import PARTITION, RUN_SETTINGS, RunSettings, flow_parameters, settings_of

__all__ = ["PARAMETER_HELP", "declared", "form_schema"]

# One description per flow parameter, in order (the form's field descriptions).
PARAMETER_HELP: dict[str, str] = {s.name: s.description for s in (PARTITION, *RUN_SETTINGS)}

F = TypeVar("F", bound=Callable[..., object])


def declared(fn: F, model: type[BaseModel] = RunSettings) -> F:
    """Check that ``fn(partition="all", <one parameter per run setting>)`` has the model's parameters
    (names, order, types, None defaults) and write its ``Args:`` docstring section from the
    settings' descriptions. Apply it under ``@flow``.

    Raises:
        TypeError: the signature differs from the model's (the message names the first difference).
    """
    expected = [inspect.Parameter("partition", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="all",
                                  annotation=str), *flow_parameters(model)]
    hints = typing.get_type_hints(fn, include_extras=True)
    actual = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in inspect.signature(fn).parameters.values()]
    for want, got in itertools.zip_longest(expected, actual):
        if want != got:
            raise TypeError(f"{getattr(fn, '__name__', fn)}: parameter {got} where the run settings model has {want}")
    lines = ["", "Args:"] + [f"    {s.name}: {s.description}" for s in (PARTITION, *settings_of(model))]
    doc = inspect.cleandoc(fn.__doc__ or fn.__name__).rstrip()  # a summary line: the Args section parses after one
    fn.__doc__ = doc + "\n" + "\n".join(lines) + "\n"
    return fn


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The deployment parameter schema as the custom-run form should show it.

    Prefect writes an optional parameter (``X | None = None``) as ``anyOf: [X, null]`` with
    ``default: null``; its form then opens each one on the null branch, which reads "Property is type
    None" and hides the type, bounds and choices. Here such a parameter becomes plain ``X`` (or
    ``anyOf`` of its non-null branches) with no default: the form shows an empty typed input, an empty
    input sends nothing, and the flow keeps the partition's value. The server still accepts an explicit
    null for a single-type parameter (Prefect allows null for an optional property with no default).
    Other properties are left as they are; the input is not changed.
    """
    out = copy.deepcopy(schema)
    for prop in (out.get("properties") or {}).values():
        branches = prop.get("anyOf")
        if not isinstance(branches, list) or "default" not in prop or prop["default"] is not None:
            continue
        typed = [b for b in branches if b != {"type": "null"}]
        if len(typed) == len(branches) or not typed:
            continue
        del prop["default"], prop["anyOf"]
        if len(typed) == 1:
            prop.update({k: v for k, v in typed[0].items() if k not in prop})
        else:
            prop["anyOf"] = typed
    return out
