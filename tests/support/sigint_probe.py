"""A command for tests/unit/test_cli_exit_codes.py: Ctrl-C arrives while a library runs, and the
library wraps the ``KeyboardInterrupt`` in its own error (pydantic does, inside a wrap serializer:
Prefect's settings are serialized this way while a run starts up)."""

from __future__ import annotations

import os
import signal
from typing import Any

from pydantic import BaseModel, model_serializer

from datagen._cli import reports_errors


class _Settings(BaseModel):
    home: str = "/tmp"

    @model_serializer(mode="wrap")
    def _ser_model(self, handler: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, delivered inside the serializer
        return handler(self)


@reports_errors("datagen probe")
def main(argv: list[str]) -> int:
    _Settings().model_dump()
    return 0
