"""Test-run options. `--shuffle SEED` runs the collected tests in an order shuffled with SEED: a test that depends on
another having run first fails, and the seed (in the header) reproduces the order. No plugin needed (pytest-randomly,
where installed, does the same with `-p randomly`); .ci/run shuffles the tests whose order once mattered."""
from __future__ import annotations

import random

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", type=int, default=None,
                     help="run the tests in an order shuffled with this seed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle")
    if seed is not None:
        random.Random(seed).shuffle(items)


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle")
    return None if seed is None else f"test order shuffled: --shuffle {seed}"
