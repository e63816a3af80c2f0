"""Every test sees 8 simulated CPU devices; this must run before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from mtx.data_path import shared_data_dir  # noqa: E402


def pytest_configure(config):
    assert len(jax.devices()) >= 8, "tests need 8 simulated devices; XLA_FLAGS was set too late"


@pytest.fixture
def shared_data():
    """The reference data folder (../shared/data or $MTX_DATA_DIR); tests that need it skip where it is absent."""
    path = shared_data_dir()
    if path is None:
        pytest.skip("reference data not found: set MTX_DATA_DIR to the folder holding gpt2/, wikitext-2/, ...")
    return path
