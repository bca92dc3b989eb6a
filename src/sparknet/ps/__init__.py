"""Asynchronous training through a parameter server on the driver (TensorOnSpark; docs/PARAMETER_SERVER.md).

A :class:`ParameterServer` runs on the Spark driver; every partition's task trains its own copy and, every
``tau`` steps, pushes its weights (or its change) and gets the server's copy back in the same round trip,
waiting for no other worker. A :class:`Combiner` merges a push into the server's copy. Messages use an
authenticated binary format (:mod:`sparknet.ps.wire`); nothing unpickles network bytes. The command line's
``--strategy async`` calls :func:`run_async`; pyspark is imported only when a Spark session is used.
"""

from sparknet._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("PSClient", "RejectedError", "Reply"), "sparknet.ps.client"),
    **dict.fromkeys(("COMBINERS", "Combiner", "DeltaCombiner", "ElasticCombiner", "MeanCombiner",
                     "StalenessAwareDeltaCombiner", "make_combiner", "register_combiner"), "sparknet.ps.combiners"),
    "ParameterServer": "sparknet.ps.server",
    "AsyncConfig": "sparknet.ps.config",
    **dict.fromkeys(("AsyncSession", "run_async"), "sparknet.ps.session"),
    **dict.fromkeys(("JobCredentials", "Kind", "Reason", "Status"), "sparknet.ps.wire"),
}
"""Each name and the module that defines it, imported on first use: the command line reads the combiners' names
(:mod:`sparknet.ps.combiners`) without loading torch."""

__all__ = [
    "AsyncSession", "AsyncConfig", "run_async",
    "ParameterServer", "PSClient", "Reply", "RejectedError", "JobCredentials", "Kind", "Reason", "Status",
    "Combiner", "MeanCombiner", "DeltaCombiner", "StalenessAwareDeltaCombiner", "ElasticCombiner", "COMBINERS",
    "make_combiner", "register_combiner",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
