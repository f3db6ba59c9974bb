"""Hugging Face's Trainer with hetlb: per-rank batch sizes on an emulated heterogeneous cluster.

A small causal language model built from a transformers config (no weights downloaded) on
random token sequences of varied lengths, trained by ``BalancedTrainer``, a ``Trainer`` whose
training batches a ``hetlb.Balancer`` sizes per rank. Rank r behaves like a worker of speed
``r + 1`` (an emulated time model); LBB moves samples to the fast ranks. The Trainer divides the
loss by the step's token count over all ranks, so every rank's weight is 1/world and the step
trains the token mean of all its sequences. Rank 0 prints each rank's mean batch size.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py [--epochs 2] [--accumulate 2]

Needs ``pip install hetlb[hf]``; see docs/transformers.md.
"""
import argparse
import os
import tempfile

import torch
import transformers

import hetlb
from hetlb.integrations.transformers import BalancedTrainer
from hetlb.sim.emulate import Emulator

VOCAB, LENGTH = 64, 32


def sequences(n: int):
    """Counting sequences (each token the previous plus one, from a random start), of lengths
    8-LENGTH padded to LENGTH; the padding's labels are -100 (not counted)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (start + torch.arange(LENGTH)) % VOCAB
        labels = ids.clone()
        labels[int(torch.randint(8, LENGTH + 1, (1,), generator=g)):] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--per-device-batch", type=int, default=8, help="the average per rank")
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=LENGTH)
    model = transformers.LlamaForCausalLM(config)
    training = transformers.TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(), per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.accumulate, num_train_epochs=args.epochs,
        learning_rate=3e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=4,
        disable_tqdm=True, dataloader_drop_last=True, seed=0)
    emulator = Emulator(hetlb.LinearModel(5e-3, 5e-3), speed=1.0 + rank)  # rank r: speed r + 1
    trainer = BalancedTrainer(model=model, args=training, train_dataset=sequences(256),
                              policy=hetlb.LBB(), balancer_kwargs={"emulator": emulator})
    result = trainer.train()

    bal = trainer.balancer
    if trainer.is_world_process_zero():
        sizes = torch.tensor([r.batch.tolist() for r in bal.history], dtype=torch.float64)
        print(f"{bal.steps} steps (weighting {bal.weighting!r}); mean batch per rank (speeds "
              f"1:2:...), first and last 4 steps: {sizes[:4].mean(0).tolist()} -> "
              f"{sizes[-4:].mean(0).tolist()}; training loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
