"""The moetune command line: one typer app (common.py) and one module per command group;
each command calls one entry function. Importing the package registers every group."""

from moetune.cli import bench, commands, data, doctor, export, lane, ledger, push, serve, sky  # noqa: F401
from moetune.cli.common import app, main

__all__ = ["app", "main"]
