"""A single-process loop without an optimizer and without a process group. argv[1]: steps; argv[2]
``mark``: apply the fix the agent suggests (``hpar_agent.current().step()`` per iteration)."""

import sys

import torch

mark = sys.argv[2:] == ["mark"]

torch.set_num_threads(1)
w = torch.randn(8, 8, requires_grad=True)
for _ in range(int(sys.argv[1])):
    loss = (torch.randn(4, 8) @ w).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        w -= 0.01 * w.grad
        w.grad = None
    if mark:
        import hpar_agent

        hpar_agent.current().step()
print("no-optimizer loop done")
