"""Session set-up shared by all tests."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def built_cpu_adam():
    """Build the CPU Adam op once, here, before rank processes need it: a cold build takes ~30 s, which must not
    be spent inside a distributed test's timeout (and several ranks would wait on one build lock)."""
    from zero_engine.ops import OpBuildError, load_op

    try:
        load_op("cpu_adam")
    except OpBuildError:
        pass  # the engine falls back to torch's AdamW; test_ops covers this path
