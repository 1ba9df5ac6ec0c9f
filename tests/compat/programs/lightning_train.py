"""A tiny LightningModule trained by Lightning's ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` from a plain ``python lightning_train.py``: Lightning starts the second rank itself
(it runs this command again with the rank in the environment). ``[--steps N] [--compile BACKEND]``
(the module's network compiled with that backend) ``[--attach]`` (a Callback attaches the agent in
``setup``: every rank, once its process group exists, before Lightning wraps the module in DDP)."""

import argparse
import logging
import os
import warnings

import lightning as L
import torch
from _result import dump


class Attach(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import hpar_agent

        hpar_agent.attach(pl_module)


class Tiny(L.LightningModule):
    def __init__(self, compile_backend: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        if compile_backend:
            self.net = torch.compile(self.net, backend=compile_backend)
        self.optimizer_steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_steps += 1  # after each optimizer step Lightning ran

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", default="")
    p.add_argument("--attach", action="store_true")
    args = p.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randn(256, 16), batch_size=8)
    module = Tiny(args.compile)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Attach()] if args.attach else [],
    )
    trainer.fit(module, data)
    dump(
        trainer.global_rank,
        trainer.world_size,
        module.optimizer_steps,
        dp=trainer.world_size,
        global_step=trainer.global_step,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


if __name__ == "__main__":
    main()
