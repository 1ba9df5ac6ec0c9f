"""What counting a torch.compile'd model's FLOPs costs: the MFU collector's flop counter on a fake copy
of the model (``torch_compat.fake_model.count_flops``, run once on the agent thread) beside one real
forward and backward of the same model and batch, for the reference GPT at two sizes. CPU times of the
calling thread, so they hold on a loaded machine; the first fake count of a process also imports torch's
fake-tensor machinery (a compiled program has it loaded already).

    python -m benchmarks.mfu_count [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hpar_agent.torch_compat.fake_model import count_flops, spec
from hpar_trainer.model import GPT, ModelArgs

SIZES = ((64, 2, 32, 4), (512, 8, 256, 8))  # dim, layers, seq_len, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    dev = ap.parse_args().device
    torch.set_num_threads(1)
    for dim, layers, seq, batch in SIZES:
        torch.manual_seed(0)
        model = GPT(ModelArgs(vocab=8192, dim=dim, heads=8, layers=layers, seq_len=seq)).to(dev)
        x = torch.randint(0, 8192, (batch, seq), device=dev)
        real, fake = [], []
        for _ in range(ap.parse_args().repeat):
            t = time.thread_time()
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            if dev == "cuda":
                torch.cuda.synchronize()
            real.append(time.thread_time() - t)
            t = time.thread_time()
            flops = count_flops(model, [((spec(x),), {})])
            fake.append(time.thread_time() - t)
        print(
            f"dim {dim}, {layers} layers, batch {batch} x {seq}: fake count {min(fake) * 1e3:.0f} ms CPU "
            f"(first {fake[0] * 1e3:.0f}), real forward+backward {min(real) * 1e3:.0f} ms CPU, {flops:.3e} FLOPs"
        )


if __name__ == "__main__":
    main()
