"""sparknet's CUDA paths, checked on a machine with a GPU (CI has none, so they run here or nowhere).

    python scripts/gpu_check.py --out DIR            # needs torch with CUDA; MNIST in the data cache for part E

What runs, each on the GPU and, where a comparison is the point, on the CPU beside it:

A. ``Net`` on ``cuda``: LeNet trained 50 steps from the same seed and batches on both devices; the losses
   and weights must agree to float32 and TF32 rounding (cuDNN's convolutions use TF32 by default).
B. A worker's state carried between rounds, as the rounds engine carries it: solver state exported from a net
   on the GPU, written (``save_tree``), read back onto the GPU (``load_tree``) and loaded into a fresh net; the
   momentum buffers come back exactly and the next steps match those of the net that never stopped.
C. Caffe's update rules (``CaffeSGD``, ``CaffeAdam``): ten steps from the same gradients on both devices.
D. A model folder saved from the GPU net and loaded on the CPU scores as the GPU net does.
F. A rounds-engine task's own code (``_train_round``, no Spark): three rounds of one partition on the device,
   the third in a fresh process's place resuming from the state file, against the same on the CPU and against
   the process that kept going (the weights each round makes).
G. A barrier-engine rank's rounds (``CollectiveExchange``) on the device in a one-rank gloo group, against the CPU.
E. The command a user runs: ``sparknet train --model lenet --dataset mnist --device cuda`` to 99% test accuracy,
   and the same on the CPU with all its cores, each timed from the command's start.

Prints one line per check and writes ``gpu_check.json``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPU = "cuda"
"""The device checked against the CPU (``--device``: another, or ``cpu`` to try the script where there is no GPU)."""
sys.path.insert(0, str(ROOT / "src"))

from sparknet import zoo  # noqa: E402
from sparknet.model_io import load_model, save_model  # noqa: E402
from sparknet._tensortree import load_tree, save_tree  # noqa: E402
from sparknet.net import Net  # noqa: E402
from sparknet.optimizers import build_optimizer  # noqa: E402
from sparknet.solvers import SolverConfig  # noqa: E402
from sparknet.spark.rounds.executor import export_worker_state, import_worker_state  # noqa: E402
from sparknet.strategies import WorkerState  # noqa: E402


def _data(n: int = 4096, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _net(device: str, seed: int = 0) -> Net:
    net = Net(zoo.lenet(batch_size=64), SolverConfig(base_lr=0.01, momentum=0.9, weight_decay=5e-4), batch_size=64,
              seed=seed, device=device)
    net.set_training_data(_data())
    return net


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / max(b.norm(), 1e-30))


def check_net() -> dict:
    cpu, gpu = _net("cpu"), _net(GPU)
    assert _rel(gpu.get_flat(), cpu.get_flat()) == 0.0, "the same seed must give the same initial weights"
    s_cpu, s_gpu = cpu.train(50), gpu.train(50)
    out = {"loss_cpu": s_cpu.loss, "loss_gpu": s_gpu.loss, "weights_rel_diff": _rel(gpu.get_flat(), cpu.get_flat()),
           "eval_cpu": cpu.evaluate(_data(1024, seed=1)).metrics.get("accuracy"),
           "eval_gpu": gpu.evaluate(_data(1024, seed=1)).metrics.get("accuracy")}
    out["ok"] = (abs(s_gpu.loss - s_cpu.loss) <= 0.02 * abs(s_cpu.loss) + 1e-3 and out["weights_rel_diff"] < 0.02
                 and next(gpu.module.parameters()).device.type == torch.device(GPU).type)
    return out


def check_state() -> dict:
    net = _net(GPU)
    net.train(5)
    state = WorkerState()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p0.r0.state"
        save_tree(path, {"version": 0, "worker": export_worker_state(net, state, copy_tensors=False)})
        saved = load_tree(path, net.device)
    fresh = _net(GPU, seed=1)
    fresh.set_flat(net.get_flat())
    import_worker_state(fresh, saved["worker"])
    a, b = net.solver_state(), fresh.solver_state()
    buffers = [(k, x, b_) for k, x, b_ in _tensors(a, b)]
    exact = all(torch.equal(x.cpu(), y.cpu()) for _, x, y in buffers)
    on_gpu = all(y.device.type == torch.device(GPU).type for _, _, y in buffers if y.dtype.is_floating_point)
    net.train(5)
    fresh.train(5)
    diff = _rel(fresh.get_flat(), net.get_flat())
    return {"buffers": len(buffers), "buffers_exact": exact, "buffers_on_gpu": on_gpu, "next_steps_rel_diff": diff,
            "ok": exact and on_gpu and len(buffers) > 0 and diff < 1e-4}


def _tensors(a, b, key=""):
    if isinstance(a, torch.Tensor):
        yield key, a, b
    elif isinstance(a, dict):
        for k in a:
            yield from _tensors(a[k], b[k], f"{key}/{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _tensors(x, y, f"{key}/{i}")


def check_caffe_rules() -> dict:
    out = {}
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(10)]
    rules = {"caffe sgd": SolverConfig(type="sgd", base_lr=0.01, momentum=0.9, weight_decay=5e-4, caffe_history=True),
             "caffe adam": SolverConfig(type="adam", base_lr=0.01, weight_decay=5e-4, caffe_delta=True)}
    for name, cfg in rules.items():
        finals = {}
        for device in ("cpu", GPU):
            w = torch.nn.Parameter(w0.clone().to(device))
            opt, sched = build_optimizer([{"params": [w]}], cfg)
            for grad in grads:
                w.grad = grad.to(device)
                opt.step()
                sched.step()
            finals[device] = w.detach()
        out[name] = _rel(finals[GPU], finals["cpu"])
    out["ok"] = all(v < 1e-5 for k, v in out.items())
    return out


def check_model_folder() -> dict:
    net = _net(GPU)
    net.train(20)
    x, _ = _data(256, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "m", net)
        loaded = load_model(Path(tmp) / "m", device="cpu")
        on_cpu = loaded.predict(x)
    on_gpu = net.predict(x.to(GPU)).cpu()
    diff = float((on_cpu - on_gpu).abs().max())
    return {"max_abs_diff": diff, "ok": diff < 1e-3}


def check_worker_rounds() -> dict:
    """A rounds-engine task's own code on the device, without Spark: three rounds of partition 0, the first from
    its chunks, the second from the process's cache, the third in a "new process" (the cache emptied) that resumes
    from the state file the second wrote; the same on the CPU. The updates must agree to TF32 rounding."""
    import numpy as np

    try:
        import pyspark  # noqa: F401
    except ImportError:  # a GPU machine without Spark: the task's code needs only pyspark's copy of cloudpickle
        import types

        import cloudpickle

        shim = types.ModuleType("pyspark")
        shim.cloudpickle = cloudpickle
        sys.modules["pyspark"] = shim
    from sparknet.config import WorkerConfig
    from sparknet.loop import RoundPlan
    from sparknet.spark import data as spark_data
    from sparknet.spark.rounds import executor as _rounds
    from sparknet.spark.backend import Held
    from sparknet.strategies import make_strategy

    x, y = _data()
    pairs = [(x[i].numpy().reshape(-1), int(y[i])) for i in range(1024)]

    def rounds(device: str, resume: bool) -> tuple[list, list]:
        with tempfile.TemporaryDirectory() as tmp:
            spec = _rounds.WorkerSpec(fit_id=f"check-{device.replace(':', '')}-{int(resume)}",
                                      net=zoo.lenet(batch_size=64), loss=None,
                                      worker=WorkerConfig(solver=SolverConfig(base_lr=0.01, momentum=0.9),
                                                          batch_size=64, seed=4, device=device),
                                      strategy=make_strategy("average"), sample_shape=(1, 28, 28),
                                      staging_dir=tmp)
            spec_bc = Held(_rounds.pack_spec(spec))
            weights = _net("cpu").get_flat().numpy().astype(np.float32)
            got, seen = [], []
            try:
                for r in range(3):
                    if r == 2 and resume:
                        _rounds._CACHE.clear()  # a new Python worker: only the state file of round 1 is left
                    task = _rounds.RoundTask(plan=RoundPlan(round=r, steps=10), numel=weights.size)
                    chunks = spark_data.pair_chunks(784)(iter(pairs))
                    report, delta, _ = _rounds._train_round(spec_bc, Held(weights), task, 0, None, chunks=chunks)
                    assert delta is not None and report.finite, report
                    weights = weights + delta  # one worker: the average is its update
                    got.append(torch.from_numpy(weights.copy()))
                    seen.append(report.source)
            finally:
                _rounds._CACHE.clear()
            return got, seen

    cpu, _ = rounds("cpu", resume=True)
    gpu_on, _ = rounds(GPU, resume=False)
    gpu, sources = rounds(GPU, resume=True)
    # compared as the weights they make (a round's update is small beside the weights, so the devices' rounding,
    # which check A measures on the weights, is a large part of it)
    against_cpu = [_rel(a, b) for a, b in zip(gpu, cpu)]
    resumed = _rel(gpu[2], gpu_on[2])  # the third round from the state file, against the process that kept going
    return {"sources": sources, "weights_rel_diff_vs_cpu": against_cpu, "resumed_vs_kept_going": resumed,
            "ok": sources == ["chunks", "cache", "chunks"] and max(against_cpu) < 0.02 and resumed < 1e-3}


def check_barrier_rank() -> dict:
    """A barrier-engine rank's round (:class:`~sparknet.collective.CollectiveExchange`, the exchange every rank
    runs) on the device, in a one-rank gloo group: three rounds against the same on the CPU."""
    import torch.distributed as dist

    from sparknet.collective import CollectiveExchange
    from sparknet.loop import RoundPlan
    from sparknet.strategies import make_strategy

    means = {}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            for device in ("cpu", GPU):
                net = _net(device)
                exchange = CollectiveExchange(net, make_strategy("average"), rank=0, world=1)
                global_flat, got = net.get_flat().clone(), []
                for r in range(3):
                    update = exchange.run_round(RoundPlan(round=r, steps=10), global_flat)
                    global_flat = global_flat + update.total / update.samples
                    got.append(global_flat)
                means[device] = got
        finally:
            dist.destroy_process_group()
    diffs = [_rel(a, b) for a, b in zip(means[GPU], means["cpu"])]  # the weights each round makes
    return {"weights_rel_diff_vs_cpu": diffs, "ok": max(diffs) < 0.02}


def check_command(device: str, threads: int, out_dir: Path, timeout_s: float) -> dict:
    metrics = out_dir / f"train_{device}.jsonl"
    cmd = [sys.executable, "-m", "sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--lr", "0.05",
           "--steps", "4000", "--target-accuracy", "0.99", "--eval-every", "250", "--device", device,
           "--threads", str(threads), "--quiet", "--metrics-out", str(metrics)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    summary = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "summary":
                summary = record
    acc = summary.get("test_accuracy")
    return {"command": " ".join(cmd[1:]), "rc": proc.returncode, "command_s": wall, "test_accuracy": acc,
            "steps": summary.get("steps"), "samples_per_s": summary.get("samples_per_s"),
            "stderr_tail": proc.stderr[-2000:] if proc.returncode else "",
            "ok": proc.returncode == 0 and acc is not None and acc >= 0.985}  # trains as on the CPU (99% takes luck)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for gpu_check.json and the commands' metrics")
    p.add_argument("--skip-command", action="store_true", help="leave out E (no MNIST in the data cache)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds each command of E may take")
    p.add_argument("--device", default="cuda", help="the device checked (cpu: the script itself, on any machine)")
    args = p.parse_args(argv)
    global GPU
    GPU = args.device
    if GPU.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(0) if GPU.startswith("cuda") else GPU, "torch": torch.__version__, "cpus": os.cpu_count(),
              "load_average_before": list(os.getloadavg())}
    checks = {"A net on cuda": check_net, "B worker state through a file": check_state,
              "C Caffe's rules": check_caffe_rules, "D model folder from the GPU": check_model_folder,
              "F a rounds-engine task's rounds": check_worker_rounds, "G a barrier-engine rank's rounds": check_barrier_rank}
    if not args.skip_command:
        checks[f"E command, {GPU}"] = lambda: check_command(GPU, 1, out_dir, args.timeout)
        checks["E command, cpu"] = lambda: check_command("cpu", os.cpu_count() or 1, out_dir, args.timeout)
    failed = []
    for name, fn in checks.items():
        t = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # a check that breaks is a failed check, reported with the others
            import traceback

            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2500:]}
        result["seconds"] = round(time.perf_counter() - t, 2)
        report[name] = result
        failed += [] if result["ok"] else [name]
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {name}: " + json.dumps(result, default=str)[:3000], flush=True)
    report["load_average_after"] = list(os.getloadavg())
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"gpu_check: {len(checks) - len(failed)} of {len(checks)} checks passed" + (f"; failed: {failed}" if failed
                                                                                       else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
