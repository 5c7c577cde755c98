"""Train with ``--adaptive-memory-optimization``: one flag, one call after the model exists.

    python examples/train.py --model llama-tiny --batch-size 4 --seq-len 128 \
        --adaptive-memory-optimization --memory-budget 8MB --steps 12
    python examples/train.py --model hf:llama --batch-size 4 --seq-len 128 \
        --adaptive-memory-optimization --memory-budget 6MB --steps 12
    python examples/train.py --model llama-tiny --memory-plan plan.yaml --compile aot_eager
    torchrun --nproc-per-node 2 examples/train.py --parallel ddp|fsdp|tp|pp \
        --adaptive-memory-optimization --memory-budget 8MB --steps 12

``--compile [BACKEND]`` compiles each repeated layer (per block) after the plan is applied (default inductor).

The training loop below is an ordinary PyTorch loop; the only adaptive-mem lines are
``adaptive_mem.add_arguments(parser)`` and ``adaptive_mem.apply_arguments(model, args)``.
On CPU the "device" is host memory accounted by ``adaptive_mem.DeviceMemory`` with the budget as
its capacity, so running out of it raises ``torch.OutOfMemoryError`` as a GPU would.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys

import torch
import torch.nn.functional as F

import adaptive_mem
from search import Plan, parse_bytes


def build_layout(model: torch.nn.Module, args: argparse.Namespace, batch_size: int):
    """The parallel layout in one place (``--parallel``, under torchrun): DDP, FSDP2, tensor parallel or one
    pipeline stage per rank; None without ``--parallel``. A ``--memory-plan`` for the whole model is cut to the
    rank's stage under ``pp``."""
    if args.parallel is None:
        return None
    import torch.distributed as dist
    from adaptive_mem.models import Parallel, parallelize
    from adaptive_mem.models._parallelize import stage_decisions

    dist.init_process_group("gloo")  # torchrun's environment: rank, world size, address
    layout = parallelize(model, layout=Parallel(args.parallel, dist.get_world_size(), args.micro_batches),
                         batch_size=batch_size)
    if args.parallel == "pp" and args.memory_plan:
        plan = Plan.load(args.memory_plan)
        lo, hi = layout.bounds
        args.memory_plan = Plan(decisions=stage_decisions(plan.decisions, lo=lo, hi=hi, stage=layout.module))
    return layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="llama-tiny, llama-small or hf:<family>")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", default=None, choices=["ddp", "fsdp", "tp", "pp"],
                        help="under torchrun: the layout over its ranks (gloo)")
    parser.add_argument("--micro-batches", type=int, default=1, help="--parallel pp: micro-batches per step")
    adaptive_mem.add_arguments(parser)  # --adaptive-memory-optimization, --memory-budget, ... and Megatron's flags
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    bundle = adaptive_mem.build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    model = bundle.model
    layout = build_layout(model, args, bundle.batch_size)
    model = layout.module if layout is not None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    handle = adaptive_mem.apply_arguments(model, args, optimizer=optimizer,  # the one call
                                          dp_group=layout.dp_group if layout is not None else None)
    show = layout is None or layout.rank == 0
    if not show:  # rank 0 speaks for the group; the others only warn
        logging.getLogger().setLevel(logging.WARNING)

    cap = parse_bytes(args.memory_budget, key="--memory-budget") if args.memory_budget else None
    device = adaptive_mem.DeviceMemory(cap=cap) if bundle.device.type == "cpu" else contextlib.nullcontext()
    try:
        with device:
            for step in range(args.steps):
                input_ids, labels = bundle.batch(seed=args.seed + step)
                if layout is not None:
                    loss = layout.step(*layout.batch(input_ids, labels))
                else:
                    logits = model(input_ids)
                    logits = logits.logits if hasattr(logits, "logits") else logits
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                peak = f", peak {device.peak} bytes" if isinstance(device, adaptive_mem.DeviceMemory) else ""
                if show:
                    print(f"step {step + 1}: loss {loss.item():.4f}{peak}")
                if isinstance(device, adaptive_mem.DeviceMemory):
                    device.reset_peak()
        if layout is not None:  # no collective in flight on any rank when the group goes (gloo's worker
            gc.collect()  # threads must not outlive the interpreter holding tensors); DDP's reducer first
            torch.distributed.barrier()
    finally:
        if handle is not None:
            if hasattr(handle, "summary") and show:
                print(handle.summary())
            handle.remove()
        if layout is not None:
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
