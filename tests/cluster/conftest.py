"""The multi-host rig (scripts/netns_cluster.py) as a fixture: two worker hosts, started once for the tier
(each module brings its own SparkSession to it, and a test that stops a host starts it again).

Needs root; under CI (``CI=true``, where the suite runs as root) a rig that cannot start fails
the run instead of skipping it.
"""

from __future__ import annotations

import pytest

from _rig import started_rig


@pytest.fixture(scope="session")
def cluster():
    yield from started_rig(memory="1536m")
