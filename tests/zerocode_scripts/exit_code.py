"""Steps an optimizer once (so the agent attaches), then exits with the status given in argv[1]."""

import sys

import torch

torch.set_num_threads(1)
w = torch.nn.Parameter(torch.ones(1))
w.grad = torch.ones(1)
torch.optim.SGD([w], lr=0.1).step()
sys.exit(int(sys.argv[1]))
