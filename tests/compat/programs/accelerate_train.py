"""A tiny loop with Hugging Face ``accelerate`` (``Accelerator``, prepared model, optimizer and data),
for ``accelerate launch --multi_gpu --num_processes 2`` on CPU (gloo). ``[--steps N] [--attach]``
(``--attach``: ``hpar_agent.attach(model, optimizer=opt)`` once ``prepare`` wrapped them)."""

import argparse

import torch
from _result import dump
from accelerate import Accelerator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--attach", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.randn(8 * args.steps * acc.num_processes, 16), batch_size=8)
    model, opt, data = acc.prepare(model, opt, data)
    if args.attach:
        import hpar_agent

        hpar_agent.attach(model, optimizer=opt)
    steps = 0
    for batch in data:
        loss = model(batch).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        steps += 1
    dump(acc.process_index, acc.num_processes, steps, dp=acc.num_processes)
    acc.end_training()


if __name__ == "__main__":
    main()
