"""GPU-grade workers, each beside its baseline in the same run: what issue "GPU-grade workers" asks to show.

    python benchmarks/gpu_workers.py --out benchmarks/results/gpu_workers.json            # every section
    python benchmarks/gpu_workers.py --only alexnet --out ...                             # one of them
    python benchmarks/gpu_workers.py --smoke --out ...                                    # the plumbing, on a CPU

Sections (a GPU machine; the Spark lab of ``../shared/tools/spark-bundle`` brings Java and Spark there):

- ``alexnet``: AlexNet (zoo.alexnet, the BVLC model) on ImageNet-shaped rows (``--dataset imagenet-synthetic``,
  made on the executors), batch 256: images/s of one sparknet worker through Spark (the barrier engine, its rounds
  after the first) against a bare PyTorch loop of the same module on the same GPU after the same number of warm-up
  steps, in bf16 with channels-last and in float32.
- ``transformer``: the GPT character transformer (zoo.gpt_char, nanoGPT's ``shakespeare_char``) on Shakespeare:
  tokens/s of the bare loop and of one sparknet worker through Spark, and the time to a validation loss of 1.50
  from each command's start, one worker and two sharing the GPU.
- ``lenet``: LeNet to 99% on MNIST, two barrier workers sharing one GPU against one GPU process, each from its
  command's start.

Every sparknet run is the user's command, timed from its start (:func:`_bench.timed_command`); the bare loops run
in this process, after a warm-up. The load average is sampled before and during each; time nothing else meanwhile.
``--smoke`` runs each section's commands for a few steps on the CPU with small models, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, last_summary, save_json, timed_command  # noqa: E402

from sparknet import zoo  # noqa: E402


def _sparknet(args: list[str], metrics: Path, timeout_s: float) -> dict:
    """``sparknet train ARGS`` timed from its start; its summary's figures beside the wall time."""
    run = timed_command([sys.executable, "-m", "sparknet", "train", *args, "--metrics-out", str(metrics), "--quiet"],
                        cwd=ROOT, timeout_s=timeout_s)
    summary = last_summary(metrics)
    run.pop("stdout_tail", None)
    keys = ("samples_per_s", "train_s", "setup_s", "total_steps", "test_accuracy", "test_loss", "stop_reason",
            "gpu_scheduling", "barrier_workers")
    return {**run, "command": "python -m sparknet train " + " ".join(args),
            **{k: summary.get(k) for k in keys if k in summary}, **_steady(metrics)}


def _steady(metrics: Path) -> dict:
    """Samples/s of the workers' local steps in every round after the first (whose first steps pay for CUDA's and
    cuDNN's start, as the bare loop's warm-up does), over the slowest worker's compute seconds of each round."""
    rounds = [json.loads(line) for line in metrics.read_text().splitlines() if '"event": "round"' in line]
    later = rounds[1:]
    if not later:
        return {}
    samples = sum(r["samples"] for r in later)
    compute = sum(max(w["compute_s"] for w in r["per_worker"]) for r in later)
    return {"steady_samples_per_s": round(samples / compute, 1), "steady_rounds": len(later),
            "first_round_compute_s": round(max(w["compute_s"] for w in rounds[0]["per_worker"]), 2)}


def _bare_loop(module: torch.nn.Module, batches, *, steps: int, warmup: int, device: str, bf16: bool,
               channels_last: bool, optimizer, clip: float | None = None) -> dict:
    """A hand-written loop of ``module.loss`` (forward, backward, the gradient's norm clipped to ``clip`` where
    given, step) over ``batches``; samples/s after a warm-up."""
    module.to(device).train()
    if channels_last:
        module.to(memory_format=torch.channels_last)
    opt = optimizer(module.parameters())
    samples, t0 = 0, None
    with LoadSampler() as load:
        for step in range(warmup + steps):
            if step == warmup:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0, samples = time.perf_counter(), 0
            x, y = batches(step)
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                loss, _ = module.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            opt.step()
            samples += len(x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {"samples_per_s": round(samples / wall, 1), "steps": steps, "loss": float(loss.detach()), **load.to_dict()}


def alexnet(args, work: Path) -> dict:
    batch, steps, tau = (4, 6, 3) if args.smoke else (256, 300, 50)  # the worker's rounds after its first: its rate
    device = "cpu" if args.smoke else "cuda"
    shape = (3, 227, 227)
    out = {"batch": batch, "steps": steps}
    g = torch.Generator().manual_seed(0)
    x = torch.rand(8 if args.smoke else 1024, *shape, generator=g).to(device)
    y = torch.randint(0, 1000, (len(x),), generator=g).to(device)

    def batches(step: int):
        start = (step * batch) % (len(x) - batch + 1)
        return x[start:start + batch], y[start:start + batch]

    sgd = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=5e-4)  # noqa: E731
    for name, bf16, channels_last in (("bf16, channels-last", True, True), ("float32", False, False)):
        module = zoo.alexnet(batch_size=batch).build(seed=0)
        out[f"bare, {name}"] = _bare_loop(module, batches, steps=steps - tau, warmup=1 if args.smoke else tau,
                                          device=device, bf16=bf16, channels_last=channels_last, optimizer=sgd)
        flags = ["--precision", "bf16", "--channels-last"] if bf16 else []
        model = ["--model", "mlp", "--dataset", "mnist-small"] if args.smoke else \
            ["--model", "alexnet", "--dataset", "imagenet-synthetic"]
        out[f"sparknet worker, {name}"] = _sparknet(
            [*model, "--workers", "1", "--engine", "barrier", "--device", device, *flags, "--batch-size", str(batch),
             "--steps", str(steps), "--tau", str(tau), "--lr", "0.01", "--eval-every-rounds", str(steps)],
            work / f"alexnet-{bf16}.jsonl", args.timeout_s)
    for name in ("bf16, channels-last", "float32"):
        worker = out[f"sparknet worker, {name}"].get("steady_samples_per_s")
        bare = out[f"bare, {name}"]["samples_per_s"]
        out[f"worker / bare, {name}"] = None if not worker else round(worker / bare, 3)
    out["bf16 speedup, bare"] = round(out["bare, bf16, channels-last"]["samples_per_s"] /
                                      out["bare, float32"]["samples_per_s"], 2)
    return out


def lenet(args, work: Path) -> dict:
    device, steps = ("cpu", 100) if args.smoke else ("cuda", 4000)
    common = ["--model", "lenet", "--dataset", "mnist-small" if args.smoke else "mnist", "--lr", "0.05",
              "--batch-size", "64", "--target-accuracy", "0.99", "--device", device]
    return {  # the one process may take twice the steps (at 4,000 it stopped at 98.99% on the lab)
        "one GPU process": _sparknet([*common, "--steps", str(2 * steps), "--eval-every", "50"],
                                     work / "lenet-one.jsonl", args.timeout_s),
        "barrier, 2 workers sharing the GPU": _sparknet(
            [*common, "--steps", str(steps), "--workers", "2", "--engine", "barrier", "--tau", "50"],
            work / "lenet-two.jsonl", args.timeout_s),
    }


def _first_below(metrics: Path, target: float) -> float | None:
    """Seconds from the fit's start to the first evaluation whose loss is at most ``target`` (``None``: never)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    losses = [(r.get("wall_s"), r.get("val_loss")) for r in records if r.get("event") == "round"]
    times = [wall for wall, loss in losses if loss is not None and loss <= target]
    return min(times) if times else None


def transformer(args, work: Path) -> dict:
    """nanoGPT's recipe on both sides: AdamW (lr 1e-3, beta2 0.99, weight decay 0.1), the gradient's norm clipped to
    1, batch 64 of 256-character windows, bf16; sparknet's runs with nanoGPT's schedule (100 warm-up steps, cosine to
    1e-4 over ``steps``), the bare loop, which times 200 steps, at the fixed rate. (nanoGPT reports 1.4697.)"""
    from sparknet.datasets import shakespeare

    device = "cpu" if args.smoke else "cuda"
    steps, every, batch, target = (4, 2, 2, 1.50) if args.smoke else (5000, 250, 64, 1.50)
    corpus = shakespeare()
    train = corpus.sequences("train", 256)
    small = {"width": 32, "num_layers": 1, "num_heads": 2} if args.smoke else {}
    module = zoo.gpt_char(corpus.vocab_size, batch_size=batch, **small).build(seed=0)
    x, y = torch.as_tensor(train.x.copy()).to(device), torch.as_tensor(train.y.copy()).to(device)
    g = torch.Generator(device=device).manual_seed(0)

    def batches(step: int):
        rows = torch.randint(0, len(x), (batch,), generator=g, device=device)
        return x[rows], y[rows]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)

    out = {"steps": steps, "batch": batch, "target_loss": target,
           "bare": _bare_loop(module, batches, steps=min(steps, 200), warmup=1 if args.smoke else 20, device=device,
                              bf16=True, channels_last=False, optimizer=adamw, clip=1.0)}
    out["bare"]["tokens_per_s"] = round(out["bare"]["samples_per_s"] * 256, 1)
    args.keep(out)
    flags = ["--model", "gpt-char", "--dataset", "shakespeare", "--device", device, "--precision", "bf16",
             "--solver-type", "adamw", "--lr", "1e-3", "--weight-decay", "0.1", "--lr-policy", "cosine",
             "--lr-warmup", "100", "--min-lr", "1e-4", "--momentum2", "0.99", "--clip-gradients", "1.0",
             "--batch-size", str(batch), "--steps", str(steps), "--tau", str(every), "--engine", "barrier",
             "--target-loss", str(target)]  # the command stops there: its wall time is the time to the target
    if args.smoke:
        return {**out, "note": "smoke: the bare loop only (a full-size transformer step on a CPU takes seconds)"}
    for workers in (1, 2):
        metrics = work / f"gpt-{workers}.jsonl"
        run = _sparknet([*flags, "--workers", str(workers)], metrics, args.timeout_s)
        run["tokens_per_s"] = None if run.get("samples_per_s") is None else round(run["samples_per_s"] * 256, 1)
        run["fit_s_to_target"] = _first_below(metrics, target)
        out[f"sparknet, {workers} worker(s)"] = run
        args.keep(out)  # a lab call cut short keeps the runs it finished
    one = out["sparknet, 1 worker(s)"].get("tokens_per_s")
    out["worker / bare, tokens/s"] = None if not one else round(one / out["bare"]["tokens_per_s"], 3)
    return out


SECTIONS = {"alexnet": alexnet, "transformer": transformer, "lenet": lenet}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {sorted(SECTIONS)}")
    p.add_argument("--smoke", action="store_true", help="a few steps of each, on the CPU, small models")
    p.add_argument("--timeout-s", type=float, default=900.0, help="the longest a sparknet command may run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_workers.json"))
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --smoke")
    result = {"machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "smoke": args.smoke}
    with tempfile.TemporaryDirectory(prefix="sparknet-gpu-bench-") as tmp:
        for name in args.only.split(","):
            args.keep = lambda part, name=name: save_json({**result, name: part}, args.out)
            try:
                result[name] = SECTIONS[name](args, Path(tmp))
            except (SystemExit, subprocess.TimeoutExpired, RuntimeError, OSError) as e:
                result[name] = {"error": str(e)[-2000:]}  # kept, and the call goes on: a lab call is too dear
            print(json.dumps({name: result[name]}, default=str), flush=True)
            save_json(result, args.out)  # after each section, so that a call cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
