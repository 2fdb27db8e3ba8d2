"""The datagen flow's parameters, generated from the run settings (tasks.config.RUN_SETTINGS).

Prefect builds a deployment's parameter schema (and its custom-run form) from the flow's signature
and the ``Args:`` section of its docstring; :func:`declared` writes both from the declarations, so
a new parameter is one ``RunSetting``. :func:`form_schema` then tidies the optional parameters for
the form.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tasks.config import PARTITION, RUN_SETTINGS, RunSetting, flow_parameters

__all__ = ["PARAMETER_HELP", "declared", "form_schema"]

# One description per flow parameter, in order (the form's field descriptions).
PARAMETER_HELP: dict[str, str] = {s.name: s.description for s in (PARTITION, *RUN_SETTINGS)}

F = TypeVar("F", bound=Callable[..., object])


def declared(fn: F, settings: Sequence[RunSetting] = RUN_SETTINGS) -> F:
    """Give ``fn(partition="all", **settings)`` one typed keyword parameter per run setting and an
    ``Args:`` docstring section describing each. Apply it under ``@flow``.

    Prefect reads the signature (``inspect.signature`` follows ``__signature__``) for the parameter
    schema and for validating a run's parameters; the body receives the settings as keywords.
    """
    params = [inspect.Parameter("partition", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="all",
                                annotation=str), *flow_parameters(settings)]
    returns = inspect.signature(fn).return_annotation
    fn.__signature__ = inspect.Signature(params, return_annotation=returns)  # type: ignore[attr-defined]
    fn.__annotations__ = {p.name: p.annotation for p in params} | {"return": returns}
    lines = ["", "Args:"] + [f"    {s.name}: {s.description}" for s in (PARTITION, *settings)]
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
