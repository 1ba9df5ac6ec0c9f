"""Imports torch (so the agent attaches), then exits with the status given in argv[1]."""

import sys

import torch

torch.set_num_threads(1)
torch.ones(1).sum()
sys.exit(int(sys.argv[1]))
