"""The code's own checks, in the test command: the import layers (import-linter, with the
contracts in pyproject.toml), ruff's lint and import order on gateway/ and tests/, and
mypy on gateway/. Each runs as a user would run it, from the checkout's root, and a
finding fails the suite with the tool's own report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_runs_down_the_layers():
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("folder", ["gateway", "tests"])
def test_ruff_finds_nothing(folder):
    result = run(str(BIN / "ruff"), "check", "--no-cache", folder)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing_in_the_gateway():
    result = run(sys.executable, "-m", "mypy", "gateway")
    assert result.returncode == 0, result.stdout + result.stderr
