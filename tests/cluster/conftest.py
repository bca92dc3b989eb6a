"""The multi-host rig (scripts/netns_cluster.py) as a fixture: two worker hosts, started once for the tier
(each module brings its own SparkSession to it, and a test that stops a host starts it again).

Needs root; under CI (``CI=true``, where the suite runs as root) a rig that cannot start fails
the run instead of skipping it.
"""

from __future__ import annotations

import os

import pytest

from _rig import netns_cluster


@pytest.fixture(scope="session")
def cluster():
    why = netns_cluster.rig_unavailable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host rig cannot start under CI: {why}")
        pytest.skip(why)
    rig = netns_cluster.NetnsCluster(workers=2, memory="1536m")
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()
