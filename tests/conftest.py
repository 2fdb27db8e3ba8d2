"""Shared fixtures live in tests/fixtures/*, one module per area, loaded as plugins here."""

pytest_plugins = [
    "tests.fixtures.common",
    "tests.fixtures.emulator",
    "tests.fixtures.sshd",
    "tests.fixtures.prefect",
]
