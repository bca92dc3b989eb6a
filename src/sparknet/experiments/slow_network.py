"""Wall-clock time to accuracy as the network slows: naive (sync), averaging, DiLoCo, and averaging with its
exchange overlapped (and streamed in fragments) on Spark.

    sparknet experiment slow-network --quick
    sparknet experiment slow-network --link-latency 50ms --link-bandwidth 100Mbit
    sparknet experiment slow-network --schemes average overlap streaming --link-latency 50ms --link-bandwidth 10Mbit

What the SparkNet paper could only model (its Figure 4), measured: the real Spark engines wait, where each
exchange happens, as long as it would take over a link of the given latency and bandwidth (their own link
option, ``EngineOptions(link=...)``, as ``sparknet train --link-latency 50ms --link-bandwidth 100Mbit``;
:class:`sparknet.link.LinkModel`), and the wall clock to the target accuracy is timed. Every worker has its
own link of this speed; what the engines waited (``link_s``) is kept with each run.

A run whose link alone would take more than ``max_seconds`` gets fewer steps; if that keeps it from the
target, the time it would have taken is projected (the link changes when things happen, not what is
computed: the free-link run's training time plus its steps to the target times the link's cost per step)
and marked as projected. Times are counted from the start of each fit's first round: its setup and the
barrier stage's launch, the same for every scheme and link, are recorded beside them (``setup_s``,
``launch_s``); one untimed single-step fit runs first. The cost model's constants
(:func:`sparknet.experiments.scaling.calibrate`) are read just before and just after the runs and kept with
them, so ``sparknet experiment scaling`` prices these runs with this hour's machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparknet.experiments import (SparkExperimentConfig, make_model, make_solver, measured, median_step_time, pyplot,
                                  spark_fit, spark_stage, to_target)
from sparknet.experiments.scaling import calibrate, calibration_around
from sparknet.link import LinkModel

__all__ = ["Config", "QUICK", "SCHEMES", "run", "plot"]

SCHEMES = ("naive", "average", "diloco", "overlap", "streaming")
"""naive = gradients allreduced every step (sync); average = SparkNet; diloco = Nesterov outer step; overlap =
averaging whose exchange runs behind the next round's steps; streaming = that, one of ``fragments`` parts of the
weights an exchange (barrier engine, :class:`sparknet.config.Streaming`)."""
_OVERLAPPED = {"overlap": 1, "streaming": None}  # scheme -> fragments (None: the config's)


@dataclass(kw_only=True)
class Config(SparkExperimentConfig):
    """Settings of the slow-network runs (the learning rate is that of the naive scheme and averaging)."""

    link_latency: tuple[str, ...] = ("10ms", "50ms")
    """Latency of each link to try (paired with link_bandwidth), e.g. 50ms."""
    link_bandwidth: tuple[str, ...] = ("100Mbit", "10Mbit")
    """Bandwidth of each link to try (paired with link_latency), e.g. 100Mbit."""
    include_free_link: bool = True
    """Also run with no delay at all (the reference)."""
    schemes: tuple[str, ...] = ("naive", "average", "diloco")
    """naive, average, diloco, overlap, streaming."""
    fragments: int = 4
    """Parts of the weights the streaming scheme exchanges in turn."""
    engine: str = "barrier"
    """Engine of averaging and DiLoCo: barrier or rounds (the naive scheme needs barrier)."""
    tau: int = 50
    """Local steps per round of averaging and DiLoCo (and steps between evaluations of the naive scheme)."""
    target: float = 0.98
    """Target test accuracy."""
    diloco_lr: float = 1e-3
    """DiLoCo's inner AdamW learning rate."""
    steps: int = 3000
    """Most local steps per worker."""
    max_seconds: float = 100.0
    """About the longest one run may train: its step budget is planned from C and the link."""

    def __post_init__(self):
        super().__post_init__()
        self.link_latency = tuple(str(v) for v in self.link_latency)
        self.link_bandwidth = tuple(str(v) for v in self.link_bandwidth)
        if len(self.link_latency) != len(self.link_bandwidth):
            raise ValueError(f"give one bandwidth per latency: {self.link_latency} vs {self.link_bandwidth}")
        self.links()  # parse errors now
        self.schemes = tuple(self.schemes)
        self._check("tau", "steps", "fragments", target=True,
                    choices={"schemes": SCHEMES, "engine": ("barrier", "rounds")})
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds}")

    def links(self) -> list[LinkModel]:
        """The links to run, the free one first."""
        links = [LinkModel()] if self.include_free_link else []
        links += [LinkModel.parse(lat, bw) for lat, bw in zip(self.link_latency, self.link_bandwidth)]
        if not links:
            raise ValueError("no link to run: give --link-latency/--link-bandwidth or keep the free link")
        return links


QUICK: dict = {"dataset": "mnist-small", "target": 0.93, "link_latency": ("50ms",), "link_bandwidth": ("10Mbit",),
               "tau": 25, "steps": 600, "max_seconds": 20.0}


def _link_s_per_step(config: Config, scheme: str, engine: str, link: LinkModel, nbytes: int) -> float:
    """Seconds the link adds per local step: every step for the naive scheme, every tau steps otherwise."""
    if scheme == "naive":
        return link.allreduce_delay(nbytes, config.workers)
    if scheme == "streaming":  # at most: an exchange hidden behind the steps costs less
        return link.allreduce_delay(nbytes // config.fragments, config.workers) / config.tau
    if engine == "barrier":
        return link.allreduce_delay(nbytes, config.workers) / config.tau
    return 2 * link.delay(nbytes) / config.tau


def _one(config: Config, scheme: str, link: LinkModel, spark, df, test, nbytes: int) -> dict:
    engine = "barrier" if scheme in ("naive", *_OVERLAPPED) else config.engine
    strategy = {"naive": "sync", "diloco": "diloco"}.get(scheme, "average")
    streaming = ({"overlap": True, "fragments": _OVERLAPPED[scheme] or config.fragments}
                 if scheme in _OVERLAPPED else {})
    solver = make_solver("adamw", config.diloco_lr, config.momentum, 1e-4) if scheme == "diloco" else config.solver()
    per_step = _link_s_per_step(config, scheme, engine, link, nbytes)
    steps = config.steps  # or fewer where the link alone would take more than max_seconds
    if per_step > 0:
        steps = min(config.steps, max(config.tau, int(config.max_seconds / per_step) // config.tau * config.tau))
    fit = spark_fit(config, spark, df, test, solver=solver, engine=engine, strategy=strategy, tau=config.tau,
                    target_accuracy=config.target, steps=steps, link=link, **streaming)
    curve = fit.curve
    hit = to_target(curve, config.target)
    s = fit.result.summary
    setup = (s.get("setup_s") or 0.0) + (s.get("launch_s") or 0.0)  # the first round's start
    return {"scheme": scheme, "link": link.to_dict(), "ok": True, "engine": engine, "strategy": strategy, **hit,
            "train_time_to_target_s": hit["time_to_target_s"] - setup if hit["reached"] else None,
            "train_wall_s": (curve[-1]["wall_s"] - setup) if curve else None,
            "step_budget": steps, "wall_s": fit.wall_s, "setup_s": s.get("setup_s"), "launch_s": s.get("launch_s"),
            "samples_per_s": s.get("samples_per_s"), "fragments": s.get("fragments"),
            "bytes_per_exchange": max((h["bytes"] for h in fit.rounds[:-1]), default=None),
            "rounds": s.get("rounds"), "bytes_communicated": s.get("bytes_communicated"),
            "modelled_link_s_per_step": per_step, "link_s": s.get("link_s"), "capped": steps < config.steps,
            "curve": curve}


def run(config: Config, out_dir: Path | None = None, *, quick: bool = False, spark=None) -> dict:
    """Every scheme over every link on one Spark session; returns the result body."""
    train, test = config.data()
    net_params = make_model("lenet", config.batch_size)
    step = median_step_time(net_params, config.solver(), train, batch_size=config.batch_size, steps=20, threads=1)
    nbytes = 4 * sum(p.numel() for p in net_params.build(seed=0).parameters())
    links = config.links()
    before = calibrate().to_dict()  # the cost model's constants of this hour (sparknet experiment scaling)
    with spark_stage(config, train, spark, engine=config.engine) as (session, df, warmup_s):
        runs = [measured(f"slow-network: {scheme} over {link.describe()}",
                         {"scheme": scheme, "link": link.to_dict(), "reached": False},
                         _one, config, scheme, link, session, df, test, nbytes)
                for link in links for scheme in config.schemes]
    after = calibrate().to_dict()
    _project(runs)
    summary = {f"{r['scheme']} @ {r['link']['label']}": (round(r["train_time_to_target_s"], 1) if r.get("reached") else
                                                         f"~{r['projected_train_time_to_target_s']:.0f} projected"
                                                         if r.get("projected_train_time_to_target_s") else
                                                         "failed" if not r.get("ok") else "not reached")
               for r in runs}
    return {"target": config.target, "workers": config.workers, "model_bytes": nbytes, "step_time": step,
            "spark_warmup_s": warmup_s, **calibration_around(before, after),
            "links": [link.to_dict() for link in links], "runs": runs, "summary": summary,
            "how": "the engines' own link option (EngineOptions.link): waits where each exchange happens, "
                   "recorded as link_s (see the module docstring)"}


def _project(runs: list[dict]) -> None:
    """For a run cut short by ``max_seconds``: the time it would have taken (see the module docstring)."""
    free = {r["scheme"]: r for r in runs if r.get("ok") and r["link"]["latency_s"] == 0
            and r["link"]["bandwidth_bits_per_s"] is None}
    for r in runs:
        ref = free.get(r["scheme"])
        if r.get("ok") and not r.get("reached") and r.get("capped") and ref and ref.get("reached"):
            r["projected_train_time_to_target_s"] = (ref["train_time_to_target_s"]
                                                     + ref["steps_to_target"] * r["modelled_link_s_per_step"])


def plot(result: dict, path: str | Path) -> None:
    """Grouped bars: time to the target for each scheme, one group per link."""
    plt = pyplot()
    links = [lk["label"] for lk in result["links"]]
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in result["runs"])]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(links) + 2), 4.2), layout="constrained")
    width = 0.8 / max(len(schemes), 1)
    colors = {"naive": "tab:red", "average": "tab:blue", "diloco": "tab:green", "overlap": "tab:purple",
              "streaming": "tab:orange"}
    top = max([r.get("projected_train_time_to_target_s") or r.get("train_wall_s") or r.get("wall_s") or 0
               for r in result["runs"]] + [1.0])
    for i, scheme in enumerate(schemes):
        for j, label in enumerate(links):
            r = next((r for r in result["runs"] if r["scheme"] == scheme and r["link"]["label"] == label), None)
            if r is None:
                continue
            x = j + (i - (len(schemes) - 1) / 2) * width
            if r.get("reached"):
                t = r["train_time_to_target_s"]
                ax.bar(x, t, width, color=colors[scheme], edgecolor="black", lw=0.5)
                ax.text(x, t, f"{t:.0f}", ha="center", va="bottom", fontsize=7)
            elif r.get("projected_train_time_to_target_s"):
                h = r["projected_train_time_to_target_s"]
                ax.bar(x, h, width, color="white", edgecolor=colors[scheme], hatch="//", lw=0.8)
                ax.text(x, h, f"~{h:.0f}\nprojected", ha="center", va="bottom", fontsize=6)
            else:
                h = r.get("train_wall_s") or 0
                ax.bar(x, h, width, color="white", edgecolor=colors[scheme], hatch="xx", lw=0.8)
                note = "failed" if not r.get("ok") else f">{h:.0f}\n({(r.get('final_accuracy') or 0):.3f})"
                ax.text(x, h, note, ha="center", va="bottom", fontsize=6)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colors[scheme], edgecolor="black", label=scheme) for scheme in schemes]
    ax.set_xticks(range(len(links)), [("no delay" if lb.startswith("0s, inf") else lb) for lb in links])
    ax.set(xlabel="link (latency, bandwidth) of every worker", ylabel="wall-clock seconds to target (after setup)",
           yscale="log", ylim=(1, top * 3))
    ax.legend(handles=handles, fontsize=8, title="hatched: cut at max_seconds, projected", title_fontsize=7)
    ax.set_title(f"Time to {result['target']} test accuracy over a slow link (K = {result['workers']}, "
                 f"LeNet {result['model_bytes'] / 1e6:.2f} MB)", fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)
