"""A tiny GPT-2 (built from a config: nothing downloaded) trained by the Hugging Face ``Trainer``. Under
torchrun or ``accelerate launch`` the Trainer creates the process group itself (building the
TrainingArguments) and wraps the model in DDP (in ``train``). ``python hf_trainer.py [--steps N]
[--compile BACKEND] [--device cuda] [--attach]`` (on CUDA the group is NCCL's; ``--attach``:
``hpar_agent.attach(model)`` once the Trainer is built, before ``train``)."""

import argparse
import os
import tempfile

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
        )
        trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64, 16, cfg.vocab_size))
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
        )


if __name__ == "__main__":
    main()
