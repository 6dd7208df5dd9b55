"""A user's training script for ``dsrun launch --autotuning`` (tests/integration/test_launch_autotuning.py):
it reads its micro batch from ``--per_device_train_batch_size`` (an ``arg_mappings`` target) and checks the
engine agrees, trains ``--steps`` optimizer steps and writes what it ran to ``--out``."""
import argparse
import json

import torch

import dsrun

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", required=True)
parser.add_argument("--per_device_train_batch_size", type=int, required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine, _, _, _ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed)
micro = engine.train_micro_batch_size_per_gpu()
if micro != args.per_device_train_batch_size:
    raise SystemExit(f"--per_device_train_batch_size {args.per_device_train_batch_size} != the config's {micro}")
for _ in range(args.steps * engine.gradient_accumulation_steps()):
    x = torch.randn(micro, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
with open(args.out, "w") as f:
    json.dump({"steps": engine.global_steps, "micro": micro, "stage": engine.zero_optimization_stage()}, f)
