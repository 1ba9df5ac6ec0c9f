"""A loop without an optimizer. argv[1]: steps; then ``mark``: apply the fix the agent suggests
(``hpar_agent.current().step()`` per iteration); ``pg``: a rank of a job (``init_process_group``, under
torchrun) that updates its weights by hand."""

import sys

import torch

mark = "mark" in sys.argv[2:]
if "pg" in sys.argv[2:]:
    import torch.distributed as dist

    dist.init_process_group("gloo")

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
