#!/usr/bin/env python
"""A plain PyTorch training loop; the four lines marked `# swapsched` are all the runtime needs.

    python scripts/example_train_loop.py [--steps 20] [--budget 50%] [--policy default]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import swapsched  # swapsched
from swapsched.zoo import Transformer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--policy", default="default")
    args = ap.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, seq = 512, 64
    model = Transformer(vocab, seq, layers=4, d_model=128, heads=4, causal=True).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (64, seq + 1), device=device)

    with swapsched.SwapRuntime(budget=args.budget, policy=args.policy, model=model, optimizer=optimizer) as runtime:  # swapsched
        for step in range(args.steps):
            batch = data[torch.randint(0, len(data), (8,))]
            with runtime.step():  # swapsched
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(runtime.report())  # swapsched

if __name__ == "__main__":
    main()
