"""A tiny GPT-2 (built from a config: nothing downloaded) trained by the Hugging Face ``Trainer``. Under
torchrun or ``accelerate launch`` the Trainer creates the process group itself (building the
TrainingArguments) and wraps the model in DDP (in ``train``). ``python hf_trainer.py [--steps N]
[--compile BACKEND] [--device cuda] [--attach] [--eval-every N --eval-size M]`` (on CUDA the group is
NCCL's; ``--attach``: ``hpar_agent.attach(model)`` once the Trainer is built, before ``train``;
``--eval-every``: the Trainer evaluates M sequences every N steps, through the model DDP wraps, and the
seconds in ``Trainer.evaluate`` are the result's ``evaluated_s``)."""

import argparse
import os
import tempfile
import time

import torch
from _result import dump
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Deterministic synthetic token sequences (language modelling: labels are the inputs)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", default="")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--attach", action="store_true")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=0)
    args = p.parse_args()
    cpu = args.device == "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1000,
            save_strategy="no",
            report_to=[],
            use_cpu=cpu,
            ddp_backend="gloo" if cpu else "nccl",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
            torch_compile=bool(args.compile),
            torch_compile_backend=args.compile or None,
            eval_strategy="steps" if args.eval_every else "no",
            eval_steps=args.eval_every or None,
            per_device_eval_batch_size=4,
        )
        evals = Tokens(args.eval_size, 16, cfg.vocab_size) if args.eval_every else None
        trainer = Trainer(
            model=model, args=targs, train_dataset=Tokens(64, 16, cfg.vocab_size), eval_dataset=evals
        )
        evaluate, evaluated = trainer.evaluate, [0.0]

        def timed(*a: object, **kw: object) -> dict:
            t0 = time.perf_counter()
            try:
                return evaluate(*a, **kw)
            finally:
                evaluated[0] += time.perf_counter() - t0

        trainer.evaluate = timed
        if args.attach:
            import hpar_agent

            hpar_agent.attach(model)
        trainer.train()
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        group = torch.distributed.is_initialized()
        dump(
            rank,
            world,
            int(trainer.state.global_step),
            dp=world,
            backend=str(torch.distributed.get_backend()) if group else "none",
            evaluated_s=evaluated[0],
        )


if __name__ == "__main__":
    main()
