"""Benchmark: ms per training step of a prepared loop vs the raw engine's loop.

    python tools/bench/engines.py [--engine fsdp2|zero2|zero3|hsdp|tp] [--pairs 20] [--block 5]
                                  [--no-accel | --no-accelerate] [--device cpu|cuda] [--bf16]
                                  [--accelerate-python PYTHON] [--json FILE]

Run it with an interpreter that has accel installed (e.g. .venv/bin/python); Accelerate 1.15
runs from its own venv (tools/reference_venv.py creates it; for zero2/zero3 its DeepSpeed
flavour, ``--deepspeed``), or from ``--accelerate-python`` (an interpreter that already has it,
e.g. on a machine without network). One torchrun launch per library,
2 ranks on CPU (gloo) by default, or 1 rank per GPU with ``--device cuda`` (nccl).

The model: an input layer, 4 residual blocks (512 -> 512, tanh) and a head, AdamW, batch 16 x
512 of fixed random data. FSDP2: the raw loop shards it with torch's ``fully_shard`` (each
block, then the root: what the engine does for TRANSFORMER_BASED_WRAP) and runs
``loss.backward(); opt.step(); opt.zero_grad()``; the prepared loop is
``accelerator.prepare(model, optimizer)`` with
``FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")`` and
``accelerator.backward``. ZeRO-2/3: the raw loop is ``deepspeed.initialize`` of the model with
a client AdamW and ``engine.backward(loss); engine.step()``; the prepared loop is the same
model under ``DeepSpeedPlugin(zero_stage=...)`` (Accelerate needs
``InitProcessGroupKwargs(backend="gloo")`` for DeepSpeed on CPU, engines.md §8). Both run in
the same processes on two copies of the model, timed in paired blocks of ``--block`` steps
(order alternating), so drift hits both halves of a pair alike. Accelerate drops an FSDP
plugin on a CPU run; its FSDP2 code runs when the state is forced to FSDP after construction
(engines.md §8), which this script does for it.

Reported (rank 0): median ms/step of each loop, the median of the per-pair ratios
prepared/raw with its interquartile range, and the per-rank bytes of parameters, gradients and
AdamW state after a step (tensor accounting: the local shards), prepared vs raw. Prints a
Markdown table for docs/benchmarks.md; ``--json FILE`` also writes each library's figures.

Device meshes (``ParallelismConfig``): ``hsdp`` runs 4 CPU ranks as ``dp_replicate_size=2 x
dp_shard_size=2`` (raw: ``fully_shard`` over the same 2-D ``init_device_mesh``); ``tp`` runs 2
ranks as ``tp_size=2`` on a model whose blocks are ``up`` (512 -> 1024) and ``down`` (1024 ->
512) split Megatron-style (raw: torch's ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``; prepared: ``accel.utils.apply_tensor_parallel`` with ``{"blocks.*.up":
"colwise", "blocks.*.down": "rowwise"}``), both ranks on the same batch. Accelerate 1.15
refuses a ParallelismConfig on a CPU run (``ParallelismConfig is only compatible
DistributedType.FSDP ...``, engines.md §5), so these rows have no Accelerate side on CPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
WIDTH = 512
BLOCKS = 4
BATCH = 16
SEED = 0


def build(torch: Any) -> Any:
    """The benchmark model (its blocks are the FSDP units)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: Any) -> Any:
            return x + torch.tanh(self.lin(x))

    class Net(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
            self.out = nn.Linear(WIDTH, 8)

        def forward(self, x: Any) -> Any:
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(SEED)
    return Net()


TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def build_tp(torch: Any) -> Any:
    """The tensor-parallel benchmark model: residual MLP blocks (up 2x wide, tanh, down)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(WIDTH, 2 * WIDTH)
            self.down = nn.Linear(2 * WIDTH, WIDTH)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.tanh(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
            self.out = nn.Linear(WIDTH, 8)

        def forward(self, x: Any) -> Any:
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(SEED)
    return Net()


def _ds_config(stage: int, bf16: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,  # explicit: every side clips alike
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def _accelerator(impl: str, bf16: bool, engine: str) -> Any:
    top = importlib.import_module(impl)
    utils = importlib.import_module(f"{impl}.utils")
    precision = "bf16" if bf16 else "no"
    if engine == "tp":
        config = top.ParallelismConfig(tp_size=2)
        return top.Accelerator(parallelism_config=config, mixed_precision=precision)
    if engine == "hsdp":
        config = top.ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
        plugin = utils.FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP"
        )
        return top.Accelerator(
            parallelism_config=config, fsdp_plugin=plugin, mixed_precision=precision
        )
    if engine != "fsdp2":
        config = _ds_config(int(engine[-1]), bf16)
        ds_plugin = utils.DeepSpeedPlugin(hf_ds_config=config)
        handlers = []
        if impl == "accelerate":
            handlers = [utils.InitProcessGroupKwargs(backend="gloo")]
        return top.Accelerator(
            deepspeed_plugin=ds_plugin, mixed_precision=precision, kwargs_handlers=handlers
        )
    plugin = utils.FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP"
    )
    accelerator = top.Accelerator(fsdp_plugin=plugin, mixed_precision=precision)
    if impl == "accelerate" and accelerator.distributed_type != utils.DistributedType.FSDP:
        state = importlib.import_module("accelerate.state")
        accelerator.state.distributed_type = utils.DistributedType.FSDP
        state.PartialState._shared_state["distributed_type"] = utils.DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        if bf16:
            plugin.set_mixed_precision("bf16")
    return accelerator


def _zero_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO optimizer inside the wrappers around it (None outside ZeRO-1/2/3)."""
    found = optimizer
    for _ in range(4):
        if hasattr(found, "single_partition_of_fp32_groups") or hasattr(
            found, "fp32_partitioned_groups_flat"
        ):
            return found
        found = getattr(found, "engine_optimizer", None) or getattr(found, "optimizer", None)
        if found is None:
            return None
    return None


def _bytes(model: Any, optimizer: Any) -> int:
    """Per-rank bytes of parameters, gradients and optimizer state (ZeRO: its partitions)."""
    zero = _zero_optimizer(optimizer)
    if zero is not None:  # the fp32 partitions plus the wrapped torch optimizer's state
        flat = getattr(zero, "single_partition_of_fp32_groups", None)
        if flat is None:
            flat = zero.fp32_partitioned_groups_flat
        state = getattr(zero.optimizer, "state", {})
        return sum(t.numel() * t.element_size() for t in flat) + sum(
            v.numel() * v.element_size()
            for s in state.values()
            for v in s.values()
            if hasattr(v, "dim") and v.dim() > 0
        )
    return _local_bytes(model, optimizer)


def _local_bytes(model: Any, optimizer: Any) -> int:
    def size(tensor: Any) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return int(tensor.numel() * tensor.element_size())

    total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(size(v) for v in state.values() if hasattr(v, "dim") and v.dim() > 0)
    return total


def _raw_deepspeed(torch: Any, engine: str, bf16: bool, device: Any) -> tuple[Any, Any]:
    """The raw DeepSpeed loop's model and step function."""
    import deepspeed

    model = build(torch).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=_ds_config(int(engine[-1]), bf16)
    )

    def step(x: Any, y: Any) -> None:
        loss = torch.nn.functional.mse_loss(ds_engine(x).float(), y)
        ds_engine.backward(loss)
        ds_engine.step()

    return ds_engine, step


def _raw_tensor_parallel(model: Any, device: Any) -> None:
    """Split ``model`` with torch's own API over a fresh 2-rank ``tp`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("tp",))
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    parallelize_module(model, mesh, plan)


def worker(impl: str, pairs: int, block: int, bf16: bool, engine: str) -> None:
    """Time raw vs prepared steps in this process; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    accelerator = _accelerator(impl, bf16, engine)
    device = accelerator.device
    # tensor-parallel peers work on the same batch
    rank_seed = 0 if engine == "tp" else accelerator.process_index
    generator = torch.Generator().manual_seed(SEED + rank_seed)
    x = torch.randn(BATCH, WIDTH, generator=generator).to(device)
    y = torch.randn(BATCH, 8, generator=generator).to(device)
    loss_fn = torch.nn.functional.mse_loss

    if engine in ("fsdp2", "hsdp", "tp"):
        raw_model = (build_tp if engine == "tp" else build)(torch).to(device)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        if engine == "tp":
            _raw_tensor_parallel(raw_model, device)
        else:
            mesh = None
            if engine == "hsdp":
                from torch.distributed.device_mesh import init_device_mesh

                names = ("dp_replicate", "dp_shard")
                mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=names)
            for unit in raw_model.blocks:
                fully_shard(unit, mesh=mesh, mp_policy=policy)
            fully_shard(raw_model, mesh=mesh, mp_policy=policy)
        raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)

        def raw_step(x: Any, y: Any) -> None:
            loss = loss_fn(raw_model(x).float(), y)
            loss.backward()
            raw_opt.step()
            raw_opt.zero_grad()

    else:
        raw_model, raw_step = _raw_deepspeed(torch, engine, bf16, device)
        raw_opt = raw_model.optimizer
        if bf16:
            x = x.to(torch.bfloat16)
    prepared_model = build(torch)
    if engine == "tp":
        from accel.utils import apply_tensor_parallel

        prepared_model = build_tp(torch)
        apply_tensor_parallel(prepared_model, accelerator.torch_device_mesh, TP_PLAN)
    model, optimizer = accelerator.prepare(
        prepared_model, torch.optim.AdamW(prepared_model.parameters(), lr=1e-3)
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def raw_block() -> float:
        sync()
        start = time.perf_counter()
        for _ in range(block):
            raw_step(x, y)
        sync()
        return (time.perf_counter() - start) / block * 1e3

    def prepared_block() -> float:
        sync()
        start = time.perf_counter()
        for _ in range(block):
            loss = loss_fn(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        sync()
        return (time.perf_counter() - start) / block * 1e3

    raw_block(), prepared_block()  # warm-up (optimizer state allocated)
    memory = {"raw": _bytes(raw_model, raw_opt), "prepared": _bytes(model, optimizer)}
    times: dict[str, list[float]] = {"raw": [], "prepared": []}
    gc.disable()
    try:
        for index in range(pairs):
            order = ("raw", "prepared") if index % 2 else ("prepared", "raw")
            for name in order:
                times[name].append(raw_block() if name == "raw" else prepared_block())
    finally:
        gc.enable()
    dist.barrier()
    if accelerator.is_main_process:
        world = dist.get_world_size()
        print(json.dumps({"impl": impl, "world": world, "memory": memory, **times}))


def run(python: str, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun launch of the worker; rank 0's result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("ACCEL_USE_CPU", None)
    if args.device == "cpu" and args.engine == "fsdp2":
        env["ACCELERATE_USE_CPU"] = "1"  # Accelerate: a CPU process group (then forced FSDP)
    processes = (4 if args.engine == "hsdp" else 2) if args.device == "cpu" else args.gpus
    script = [str(Path(__file__).resolve()), "--worker", impl, "--pairs", str(args.pairs)]
    script += ["--block", str(args.block), "--engine", args.engine]
    script += ["--bf16"] if args.bf16 else []
    command = [python, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(processes), *script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def main() -> None:
    """Parse options, run each library, print the Markdown rows."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=20, help="paired blocks per run")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpus", type=int, default=1, help="ranks with --device cuda")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduce")
    parser.add_argument(
        "--engine", choices=["fsdp2", "zero2", "zero3", "hsdp", "tp"], default="fsdp2"
    )
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--no-accel", action="store_true", help="skip the accel side")
    skip.add_argument("--no-accelerate", action="store_true", help="skip the Accelerate side")
    parser.add_argument(
        "--accelerate-python", help="interpreter with Accelerate 1.15 (default: the reference venv)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--worker", choices=["accel", "accelerate"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pairs < 4 or args.block < 1:
        parser.error("--pairs must be >= 4 and --block >= 1")
    if args.worker:
        worker(args.worker, args.pairs, args.block, args.bf16, args.engine)
        return
    pythons: dict[str, str] = {}
    if not args.no_accel:
        pythons["accel"] = sys.executable
    if args.engine in ("hsdp", "tp") and args.device == "cpu" and not args.no_accelerate:
        print(
            "(no Accelerate side: Accelerate 1.15 refuses a ParallelismConfig on a CPU run)",
            file=sys.stderr,
        )
        args.no_accelerate = True
    if not args.no_accelerate and args.accelerate_python:
        pythons["accelerate"] = args.accelerate_python
    elif not args.no_accelerate:
        ensure: Callable[..., Path] = importlib.import_module(
            "reference_venv"
        ).ensure_accelerate_venv
        pythons["accelerate"] = str(ensure(deepspeed=args.engine != "fsdp2"))
    print("| measurement | prepared ms/step | raw ms/step | ratio | bytes/rank prepared / raw |")
    print("|---|---|---|---|---|")
    summary: dict[str, Any] = {"engine": args.engine, "device": args.device, "bf16": args.bf16}
    for impl, python in pythons.items():
        result = run(python, impl, args)
        ratios = [p / r for p, r in zip(result["prepared"], result["raw"], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        memory = result["memory"]
        summary[impl] = {
            "world": result["world"],
            "prepared_ms": statistics.median(result["prepared"]),
            "raw_ms": statistics.median(result["raw"]),
            "ratio": statistics.median(ratios),
            "iqr": [q1, q3],
            "memory_ratio": memory["prepared"] / memory["raw"],
        }
        if args.json is not None:  # after each library, so a later failure keeps this one
            args.json.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        where = (
            f"{result['world']} gloo ranks, cpu"
            if args.device == "cpu"
            else (f"{result['world']} GPU(s), nccl")
        )
        precision = "bf16" if args.bf16 else "fp32"
        what = {
            "fsdp2": "FSDP2 step vs raw fully_shard",
            "zero2": "ZeRO-2 step vs raw deepspeed.initialize loop",
            "zero3": "ZeRO-3 step vs raw deepspeed.initialize loop",
            "hsdp": "HSDP 2x2 (ParallelismConfig) step vs raw fully_shard on the 2-D mesh",
            "tp": "TP=2 (ParallelismConfig) step vs raw parallelize_module",
        }[args.engine]
        print(
            f"| {impl} {what}, {BLOCKS} blocks of {WIDTH}, {precision}, "
            f"AdamW, batch {BATCH}, {where} (median of {len(ratios)} paired {args.block}-step "
            f"blocks, IQR {q1:.3f}-{q3:.3f}) | {statistics.median(result['prepared']):.2f} | "
            f"{statistics.median(result['raw']):.2f} | {statistics.median(ratios):.3f}× | "
            f"{memory['prepared'] / memory['raw']:.3f}× |"
        )


if __name__ == "__main__":
    main()
