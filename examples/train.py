"""Train with ``--adaptive-memory-optimization``: one flag, one call after the model exists.

    python examples/train.py --model llama-tiny --batch-size 4 --seq-len 128 \
        --adaptive-memory-optimization --memory-budget 8MB --steps 12
    python examples/train.py --model hf:llama --batch-size 4 --seq-len 128 \
        --adaptive-memory-optimization --memory-budget 6MB --steps 12
    python examples/train.py --model llama-tiny --memory-plan plan.yaml --compile aot_eager

``--compile [BACKEND]`` compiles each repeated layer (per block) after the plan is applied (default inductor).

The training loop below is an ordinary PyTorch loop; the only adaptive-mem lines are
``adaptive_mem.add_arguments(parser)`` and ``adaptive_mem.apply_arguments(model, args)``.
On CPU the "device" is host memory accounted by ``adaptive_mem.DeviceMemory`` with the budget as
its capacity, so running out of it raises ``torch.OutOfMemoryError`` as a GPU would.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import torch
import torch.nn.functional as F

import adaptive_mem
from search import parse_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="llama-tiny, llama-small or hf:<family>")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    adaptive_mem.add_arguments(parser)  # --adaptive-memory-optimization, --memory-budget, ... and Megatron's flags
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    bundle = adaptive_mem.build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    model = bundle.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    handle = adaptive_mem.apply_arguments(model, args, optimizer=optimizer)  # the one call

    cap = parse_bytes(args.memory_budget, key="--memory-budget") if args.memory_budget else None
    device = adaptive_mem.DeviceMemory(cap=cap) if bundle.device.type == "cpu" else contextlib.nullcontext()
    try:
        with device:
            for step in range(args.steps):
                input_ids, labels = bundle.batch(seed=args.seed + step)
                logits = model(input_ids)
                logits = logits.logits if hasattr(logits, "logits") else logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                peak = f", peak {device.peak} bytes" if isinstance(device, adaptive_mem.DeviceMemory) else ""
                print(f"step {step + 1}: loss {loss.item():.4f}{peak}")
                if isinstance(device, adaptive_mem.DeviceMemory):
                    device.reset_peak()
    finally:
        if handle is not None:
            if hasattr(handle, "summary"):
                print(handle.summary())
            handle.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
