"""The deployments' pull step: enter the datagen checkout named by ``DATAGEN_HOME`` before a flow run.

A worker loads ``flows/datagen.py`` relative to the directory this step enters; without
``DATAGEN_HOME`` there is nothing to enter, and the run must say so instead of failing on an empty
path.
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.config import ConfigError

__all__ = ["enter_datagen_home"]

_ENTRYPOINT = Path("flows") / "datagen.py"


def enter_datagen_home() -> dict[str, str]:
    """Change to ``$DATAGEN_HOME`` (a Prefect pull step, see prefect.yaml).

    Returns:
        ``{"directory": <the checkout>}``, as Prefect's own ``set_working_directory`` does.

    Raises:
        ConfigError: ``DATAGEN_HOME`` is unset or empty, or names no datagen checkout.
    """
    home = os.environ.get("DATAGEN_HOME", "").strip()
    if not home:
        raise ConfigError(
            "DATAGEN_HOME is not set in the Prefect worker's environment: set it to the datagen checkout "
            "(the directory holding flows/ and deployments/) before `prefect worker start`, or start the "
            "worker with `datagen up`, which sets it")
    path = Path(home).expanduser()
    if not (path / _ENTRYPOINT).is_file():
        raise ConfigError(
            f"DATAGEN_HOME={home} is not a datagen checkout (no {_ENTRYPOINT} there): set it to the "
            "directory holding flows/ and deployments/")
    os.chdir(path)
    return {"directory": os.getcwd()}
