"""Helpers shared by tests and benchmarks (no tests here)."""
