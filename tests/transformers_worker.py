"""One worker of a Hugging Face Trainer run (DDP, Gloo, CPU) balanced by
hetlb.integrations.transformers.BalancedTrainer, launched by torchrun
(tests/test_transformers.py). Writes, on rank 0: the samples every rank trained at each step, the
Balancer's sizes, steps and the Trainer's global step, and for the steps named by --check, the
largest difference between the step's gradient and the gradient over the step's samples computed
in one process.

    transformers_worker.py --out FILE --dir DIR --case tokens|classify|mean [--epochs E] [--check S,S]
                           [--stop-at STEP] [--resume] [--idle] [--samples N] [--accumulate K]
                           [--own-token-means] [--then --out FILE --dir DIR --case ...]

Each ``--then`` starts another run in the same processes, with a new model and Trainer.

Cases: "tokens", a transformers Llama (it takes loss kwargs: the Trainer divides the loss by the
step's global label count) on sequences whose label counts differ; "classify", a transformers
Llama classifier (it takes loss kwargs and ignores them: its loss is its batch's mean); "mean", a
module whose loss is its batch's mean (no loss kwargs), under a compute_loss of the trainer's own.
"""
import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from transformers import TrainerCallback, TrainingArguments

import hetlb
from hetlb.core.models import LinearModel
from hetlb.integrations.transformers import BalancedTrainer
from hetlb.sim.emulate import Emulator
from distributed import each_run, union_gradient_errors
from fixed_policy import Scripted

N, PER_RANK, L, VOCAB = 48, 6, 8, 32  # 4 steps an epoch of 12 samples


def sequences(n=N):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, L), generator=g)
    labels = ids.clone()
    labels[torch.rand(n, L, generator=g) < 0.4] = -100  # label counts differ between samples
    y = torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i], "y": y[i], "idx": torch.tensor(i)}
            for i in range(n)]


def llama():
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=L)
    return transformers.LlamaForCausalLM(cfg)


class MeanLoss(torch.nn.Module):
    """A classifier whose loss is the mean over its batch (its forward takes no loss kwargs)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, input_ids, y):
        logits = self.out(self.emb(input_ids).mean(1))
        return {"loss": torch.nn.functional.cross_entropy(logits, y)}


def classifier():
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=L, num_labels=3,
                                   pad_token_id=VOCAB)  # (never in the data: the last token classifies)
    return transformers.LlamaForSequenceClassification(cfg)


MODELS = {"tokens": llama, "classify": classifier, "mean": MeanLoss}


def inputs(case, batch):
    if "idx" not in batch:  # (already the model's inputs)
        return batch
    if case == "tokens":
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if case == "classify":
        return {"input_ids": batch["input_ids"], "labels": batch["y"]}
    return {"input_ids": batch["input_ids"], "y": batch["y"]}


class Recorded(BalancedTrainer):
    """Records each step's samples (and leaves the sample ids out of the model's inputs)."""

    def __init__(self, case, **kwargs):
        super().__init__(**kwargs)
        self.case, self.trained = case, []

    def training_step(self, model, batch, num_items_in_batch=None):
        self.trained.append((self.state.global_step, batch["idx"].tolist()))
        return super().training_step(model, batch, num_items_in_batch)

    def compute_loss(self, model, batch, return_outputs=False, num_items_in_batch=None):
        batch = inputs(self.case, batch)
        if self.case == "mean":  # a loss of the subclass's own: the Trainer's is not called
            out = model(**batch)
            return (out["loss"], out) if return_outputs else out["loss"]
        return super().compute_loss(model, batch, return_outputs, num_items_in_batch)

    def prediction_step(self, model, batch, prediction_loss_only, ignore_keys=None):
        return super().prediction_step(model, inputs(self.case, batch), prediction_loss_only,
                                       ignore_keys)


class Watch(TrainerCallback):
    """The parameters and gradients of the steps in ``check``; a checkpoint and a stop at
    ``stop_at``."""

    def __init__(self, check, stop_at):
        self.check, self.stop_at, self.kept = check, stop_at, {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.check:
            self.kept[state.global_step] = [(p.detach().clone(), p.grad.detach().clone())
                                            for p in model.parameters()]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_save = control.should_training_stop = True


def run(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--case", choices=sorted(MODELS), required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--check", default="")
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--idle", action="store_true")
    p.add_argument("--samples", type=int, default=N)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--own-token-means", action="store_true",
                   help="average_tokens_across_devices=False")
    p.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing=True")
    a = p.parse_args(argv)
    rank = int(os.environ["RANK"])
    data = sequences(a.samples)
    make = MODELS[a.case]

    def loss_of(model, union):
        batch = {k: torch.stack([data[i][k] for i in union]) for k in data[0]}
        return model(**inputs(a.case, batch))["loss"]

    check = {int(s) for s in a.check.split(",") if s}
    watch = Watch(check, a.stop_at)
    args = TrainingArguments(output_dir=a.dir, per_device_train_batch_size=PER_RANK,
                             num_train_epochs=a.epochs, max_steps=a.max_steps, learning_rate=0.05,
                             gradient_accumulation_steps=a.accumulate,
                             average_tokens_across_devices=not a.own_token_means,
                             gradient_checkpointing=a.checkpointing,
                             use_cpu=True, report_to=[], save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True, seed=3,
                             ddp_timeout=120, logging_strategy="no",
                             max_grad_norm=0,  # (the gradients are read after the clipping)
                             eval_strategy="steps", eval_steps=3)  # (evaluation between steps)
    if a.idle:  # rank 0 given no samples in the second step
        policy, balancer = Scripted([[6, 6], [0, 12], [9, 3]]), dict(lower=0)
    else:  # rank 1 emulated twice as fast: LBB moves samples to it, the sizes change every step
        policy = hetlb.LBB()
        balancer = dict(lower=1, emulator=Emulator(LinearModel(2e-3, 1e-3), speed=1.0 + rank))
    trainer = Recorded(a.case, model=make(), args=args, train_dataset=data, eval_dataset=data[:10],
                       policy=policy, balancer_kwargs=balancer, callbacks=[watch])
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    again = None
    if a.case == "mean":  # a second train() on the trained DDP model is refused
        try:
            trainer.train()
        except RuntimeError as e:
            again = str(e)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, trainer.trained)
    bal = trainer.balancer
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"trained": everyone, "steps": bal.steps,
                       "global_step": trainer.state.global_step,
                       "weighting": bal.weighting, "again": again,
                       "checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
                       "sizes": [r.batch.tolist() for r in bal.history],
                       "errors": union_gradient_errors(make, watch.kept, everyone, loss_of)}, f)
    del trainer, bal, watch
    gc.collect()  # (the next run's hetlb finds no DDP model of this one)


def main():
    for argv in each_run(sys.argv[1:]):
        run(argv)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
