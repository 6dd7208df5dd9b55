"""A user's own training script, written the DeepSpeed way: only the import differs.

    dsrun launch --num_procs 2 examples/train_with_dsrun.py --deepspeed --deepspeed_config examples/ds_config.json

It trains a small regression MLP on a synthetic dataset (y = sin(x·w)), printing the loss on rank 0, and
exits non-zero if the loss did not fall by at least half.
"""
import argparse
import math

import torch

import dsrun  # was: import deepspeed


class SineDataset(torch.utils.data.Dataset):
    def __init__(self, size: int = 4096, dim: int = 16, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=generator)
        w = torch.randn(dim, 1, generator=generator) / math.sqrt(dim)
        self.y = torch.sin(3 * self.x @ w)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser = dsrun.add_config_arguments(parser)  # adds --deepspeed, --deepspeed_config
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    engine, optimizer, loader, scheduler = dsrun.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=SineDataset())

    first = last = None
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary():
                last = loss.item()
                first = last if first is None else first
        if engine.global_rank == 0:
            print(f"epoch {epoch}: step {engine.global_steps}, loss {last:.4f}, lr {engine.get_lr()[0]:.2e}")
    if engine.global_rank == 0:
        print(f"loss {first:.4f} -> {last:.4f}")
    return 0 if last < first / 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
