"""Asynchronous training through a parameter server on the driver (TensorOnSpark; docs/PARAMETER_SERVER.md).

A :class:`ParameterServer` runs on the Spark driver; every partition's task trains its own copy and, every
``tau`` steps, pushes its weights (or its change) and gets the server's copy back in the same round trip,
waiting for no other worker. A :class:`Combiner` merges a push into the server's copy. Messages use an
authenticated binary format (:mod:`sparknet.ps.wire`); nothing unpickles network bytes. The command line's
``--strategy async`` calls :func:`run_async`; pyspark is imported only when a Spark session is used.
"""

from sparknet.ps.client import PSClient, RejectedError, Reply
from sparknet.ps.combiners import (COMBINERS, Combiner, DeltaCombiner, ElasticCombiner, MeanCombiner,
                                   StalenessAwareDeltaCombiner, make_combiner, register_combiner)
from sparknet.ps.server import ParameterServer
from sparknet.ps.config import AsyncConfig
from sparknet.ps.session import AsyncSession, run_async
from sparknet.ps.wire import JobCredentials, Kind, Reason, Status

__all__ = [
    "AsyncSession", "AsyncConfig", "run_async",
    "ParameterServer", "PSClient", "Reply", "RejectedError", "JobCredentials", "Kind", "Reason", "Status",
    "Combiner", "MeanCombiner", "DeltaCombiner", "StalenessAwareDeltaCombiner", "ElasticCombiner", "COMBINERS",
    "make_combiner", "register_combiner",
]
