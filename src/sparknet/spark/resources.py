"""Spark schedules the workers' GPUs: a stage-level ``ResourceProfile`` on the training stage only (driver side).

A worker asks for ``gpus_per_worker`` GPUs (a fraction lets several workers share one). The training stage's
RDD carries a task-only profile (Spark's ``TaskResourceProfile``): the stages before it, which read and stage
the data, ask for no GPU, and the training tasks reuse the executors the application already has. Spark honours
such a profile on a standalone cluster (and ``local-cluster``), YARN and Kubernetes with dynamic allocation off.
Where it cannot, the training stage runs without a profile and the fit's summary says why, as Spark's own
TorchDistributor and ``xgboost.spark`` fall back: in local mode the tasks share the driver's GPUs; with dynamic
allocation on, ``spark.task.resource.gpu.amount`` (when set) still assigns every task its share.
"""

from __future__ import annotations

import logging

from sparknet.config import check_gpu_share
from sparknet.spark.session import (executor_slots, is_connect, is_local_master, local_slots, session_master,
                                   spark_setting)

__all__ = ["gpu_profile", "with_profile"]

log = logging.getLogger(__name__)


def _gpu_slots(sc, master: str, profile_id: int, per_task: float, have: float, cpus: int) -> int | None:
    """Training tasks the cluster runs at once under the profile; ``None`` where Spark cannot say yet."""
    if master.startswith("local-cluster"):
        cores = executor_slots(master)
        return local_slots(master) // cores * min(cores // cpus, int(have / per_task + 1e-9))
    try:
        jsc = sc._jsc.sc()  # a Spark Connect session has none: no count
        slots = int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().resourceProfileFromId(profile_id)))
    except Exception:  # an internal Spark method: a version without it gives no count
        log.debug("could not count the training stage's task slots", exc_info=True)
        return None
    return slots or None  # no executor registered yet: Spark's own barrier check waits for them


def gpu_profile(sc, gpus: float | None, workers: int | None = None, procs: int = 1):
    """The resource profile a training stage asks for ``gpus`` GPUs per task with, and what was decided.

    Parameters
    ----------
    sc : pyspark.SparkContext
    gpus : float, optional
        GPUs per worker; ``None`` asks for none.
    workers : int, optional
        Tasks that must run at once (a barrier stage's): refused when the executors' GPUs hold fewer.
    procs : int
        Processes (tasks) a worker is made of: each asks for ``gpus / procs`` (one GPU each, or a share of one).

    Returns
    -------
    (ResourceProfile or None, dict or None)
        The profile to give the training stage's own RDD (``rdd.withResources``: the stages that stage its input
        ask for no GPU), ``None`` where Spark cannot take one; and ``{"gpus_per_worker", "profile", "reason"}``
        for the fit's summary (``profile``: the profile's id, or ``None`` with the reason), ``None`` without
        ``gpus``.

    Raises
    ------
    ValueError
        On a cluster whose executors have no GPUs, fewer than a worker asks for, or too few for ``workers``
        tasks at once: the stage could never be scheduled, and Spark would wait for it.
    """
    if gpus is None:
        return None, None
    check_gpu_share(gpus)
    master = session_master(sc)
    record = {"gpus_per_worker": gpus, "profile": None}
    if procs > 1:
        try:
            check_gpu_share(gpus / procs)
        except ValueError:
            raise ValueError(f"--gpus-per-worker {gpus} over --procs-per-worker {procs} gives each process "
                             f"{gpus / procs:g} GPUs, which Spark cannot schedule: give each process a whole number "
                             f"of GPUs or 1/n of one (e.g. --gpus-per-worker {procs})") from None
        record["gpus_per_process"] = gpus = gpus / procs

    def without(reason: str):
        log.warning("--gpus-per-worker: %s", reason)
        return None, {**record, "reason": reason}

    if is_local_master(master) and not master.startswith("local-cluster"):
        return without(f"Spark cannot schedule GPUs by stage in local mode ({master}): the workers share this "
                       "machine's GPUs, task i on GPU i modulo their number")
    have = spark_setting(sc, "spark.executor.resource.gpu.amount")
    if have is None:
        raise ValueError(f"--gpus-per-worker {gpus} asks Spark for GPUs, but the executors of {master} have none: "
                         "set spark.executor.resource.gpu.amount and spark.executor.resource.gpu.discoveryScript "
                         "(or spark.worker.resource.gpu.* on a standalone cluster)")
    if gpus > float(have):
        raise ValueError(f"--gpus-per-worker {gpus} asks for more GPUs than an executor has "
                         f"(spark.executor.resource.gpu.amount={have})")
    if (spark_setting(sc, "spark.dynamicAllocation.enabled") or "false").lower() == "true":
        task = spark_setting(sc, "spark.task.resource.gpu.amount")
        return without("Spark takes a task-only resource profile only with dynamic allocation off; " +
                       (f"every task gets spark.task.resource.gpu.amount={task} GPUs instead" if task else
                        "set spark.task.resource.gpu.amount to give every task its share"))
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    cpus = int(spark_setting(sc, "spark.task.cpus") or 1)
    profile = ResourceProfileBuilder().require(TaskResourceRequests().cpus(cpus).resource("gpu", gpus)).build
    try:  # no job runs; a Spark Connect session registers the profile with its server
        record["profile"] = profile.id if is_connect(sc) else \
            sc.parallelize([0], 1).withResources(profile).getResourceProfile().id
    except Exception as exc:  # this cluster manager refuses the profile: Spark's reason, and none
        return without(f"Spark refused the training stage's resource profile: {str(exc).splitlines()[0][:300]}")
    slots = _gpu_slots(sc, master, record["profile"], gpus, float(have), cpus)
    if workers is not None and slots is not None and slots < workers:
        raise ValueError(f"the training stage runs all {workers} workers at once, each asking for {gpus} GPU(s), but "
                         f"the executors of {master} hold {slots} such worker(s) at a time "
                         f"(spark.executor.resource.gpu.amount={have}); use fewer workers or a smaller GPU share")
    return profile, record


def with_profile(rdd, profile):
    """``rdd`` asking for ``profile``'s resources (itself when there is none)."""
    return rdd if profile is None else rdd.withResources(profile)
