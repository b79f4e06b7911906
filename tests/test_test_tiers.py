"""The guard behind the test tiers (docs/development.md, Test tiers): a test that starts the cascade adapter or
Chromium without its mark fails before anything starts, so `make test-fast` never loads a model by accident."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import launch_chromium
from tests.conftest import require_mark, spawn_engine, start_server


def test_an_unmarked_test_may_not_start_a_cascade_server() -> None:
    with pytest.raises(
        pytest.fail.Exception, match="starts a server on the 'cascade' adapter but is not marked"
    ):
        start_server(adapter="cascade")


def test_an_unmarked_test_may_not_start_a_cascade_engine() -> None:
    # The engine's default adapter is the cascade.
    with pytest.raises(
        pytest.fail.Exception, match="starts an engine on the 'cascade' adapter but is not marked"
    ):
        spawn_engine()


def test_an_unmarked_test_may_not_start_chromium(tmp_path: Path) -> None:
    with (
        pytest.raises(pytest.fail.Exception, match="starts Chromium but is not marked 'browser'"),
        launch_chromium(tmp_path),
    ):
        pass


def test_a_marked_test_passes_the_guard(request: pytest.FixtureRequest) -> None:
    request.node.add_marker(pytest.mark.models)
    require_mark("models", "loads a model")
    with pytest.raises(pytest.fail.Exception, match="is not marked 'browser'"):
        require_mark("browser", "starts Chromium")
