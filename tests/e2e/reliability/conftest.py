"""Long runs here carry the `slow` marker: they run only when selected (`pytest -m slow`, or
`make test PYTEST_ARGS="-m slow"`); a plain `pytest` / `make test` reports them skipped with this reason."""

import pytest


@pytest.fixture(autouse=True)
def _slow_only_when_selected(request):
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("long run: select it with -m slow")
