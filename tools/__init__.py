"""Checks run by `make lint` beside ruff and mypy; not part of the installed package."""
