"""The datagen flow's parameters as Prefect's custom-run form shows them: a type with choices or
bounds for each, and one description per parameter.

Prefect builds a deployment's parameter schema from the flow's type hints and the ``Args:`` section
of its docstring; :func:`documented` writes that section from :data:`PARAMETER_HELP`, so a new
parameter is one entry there and one argument of the flow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import Field

from tasks.reasoning import PARSERS

__all__ = ["PARAMETER_HELP", "Backend", "MemFraction", "PositiveInt", "ReasoningParser", "documented", "form_schema"]

Backend = Literal["sglang", "emulator"]
if TYPE_CHECKING:
    ReasoningParser = str
else:  # the choices are SGLang's parser names, as tasks.reasoning knows them
    ReasoningParser = Literal[tuple(sorted(PARSERS))]
MemFraction = Annotated[float, Field(gt=0.0, lt=1.0)]  # the config's own check: strictly between 0 and 1
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Regenerate = Literal["last", "all"]  # tasks.inference.REGENERATE_MODES

# Empty (None) keeps the partition's value; the partition key each one overrides is named.
PARAMETER_HELP: dict[str, str] = {
    "partition": "Partition to run: a name in deployments/ (all, demo, ...) or a path to a TOML file.",
    "inputs": "Ad-hoc dataset files (JSONL or Parquet) replacing the partition's [datasets]; each is "
              "named after its file.",
    "model_path": "Model directory on the server's host ([model] path).",
    "out": "Output directory, used as is: no nightly versioning ([output] root).",
    "backend": "Server backend: sglang, or the emulator (no GPU) ([server] backend).",
    "server_url": "Running servers to use (http://host:port; one or a list): no launch, no GPU hygiene "
                  "([run] server_url).",
    "shard_size": "Rows per committed shard ([run] shard_size).",
    "concurrency": "Requests in flight to each server ([run] concurrency).",
    "tp_size": "GPUs the launched server uses, tensor parallel ([server] tp_size).",
    "mem_fraction_static": "SGLang --mem-fraction-static for the first launch of this run: wins over the "
                           "fraction the tuner remembers (a relaunch after a runtime OOM still goes lower) "
                           "([server] mem_fraction_static is only where the tuner starts).",
    "reasoning_parser": "SGLang reasoning parser splitting reasoning from content ([model] reasoning_parser; "
                        "default: the model's).",
    "truncation_retries": "Times a row that finished by length is generated again with a larger budget "
                          "([run.truncation] retries; 0: off).",
    "samples": "Rows per prompt, each with its own sampling seed ([run] samples).",
    "regenerate": "last: regenerate the last assistant turn; all: every assistant turn, each from the model's "
                  "own earlier turns ([run] regenerate).",
}

F = TypeVar("F", bound=Callable[..., object])


def documented(fn: F) -> F:
    """Append an ``Args:`` section built from :data:`PARAMETER_HELP` to ``fn``'s docstring (the
    descriptions Prefect shows in the custom-run form). Apply it under ``@flow``."""
    lines = ["", "Args:"] + [f"    {name}: {text}" for name, text in PARAMETER_HELP.items()]
    doc = (fn.__doc__ or "").rstrip()
    indent = "    "
    fn.__doc__ = doc + "\n" + "\n".join(indent + line if line else line for line in lines) + "\n"
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
