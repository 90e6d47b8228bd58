"""Shared fixtures: an isolated RAYCHAT_HOME per test session and one local Ray instance for all
integration tests (starting Ray costs seconds; tests share it and it is shut down at the end)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def raychat_home(tmp_path_factory):
    """Keep every test away from the user's ~/.cache/raychat."""
    home = tmp_path_factory.mktemp("raychat_home")
    old = os.environ.get("RAYCHAT_HOME")
    os.environ["RAYCHAT_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("RAYCHAT_HOME", None)
    else:
        os.environ["RAYCHAT_HOME"] = old


@pytest.fixture(scope="session")
def ray_session(raychat_home):
    """One local Ray instance (small; no dashboard, so parallel test runs never fight over its port) shared by every integration test."""
    import ray

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Logical CPUs: enough for 2 train workers, Ray Data tasks and a few Tune trials; the machine
    # has 2 cores, Ray only does the bookkeeping.
    ray.init(num_cpus=8, include_dashboard=False,
             log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()


# Tests never reach the internet: corpus preparation falls back to the offline sample corpus.
os.environ.setdefault("RAYCHAT_OFFLINE", "1")
