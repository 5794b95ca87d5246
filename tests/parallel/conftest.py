"""The sharding tests run on 8 virtual CPU devices. XLA reads the flag when
the backend starts, so these tests run in their own pytest process
(tests/stages.py: `pytest tests/parallel`), which this file prepares, and
every test here carries the `mesh` marker."""

import os

DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    if jax.device_count() != DEVICES:
        pytest.fail(f"tests/parallel need {DEVICES} CPU devices, found {jax.device_count()}: run them in their own "
                    f"process (make test does), with XLA_FLAGS={_FLAG}")


def pytest_collection_modifyitems(items):
    here = __file__.rpartition("/")[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.mesh)
