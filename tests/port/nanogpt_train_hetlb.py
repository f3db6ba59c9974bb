"""tests/port/nanogpt_train.py (karpathy/build-nanogpt's train_gpt2.py on CPU and Gloo) ported to
hetlb: the changed lines are counted and the training checked in tests/test_port_scripts.py.

    NANOGPT_DATA=<dir with edufineweb_{train,val}_NNNNNN.npy> \
    torchrun --standalone --nproc-per-node 2 nanogpt_train_hetlb.py [--max-steps 10] [--B 4] [--T 16]

What differs from upstream (everything else is upstream's code, line for line):

* Device and backend: CPU and Gloo (``init_process_group(backend='gloo')``, ``DDP(model)`` without
  device_ids, no ``torch.cuda`` calls); float32 throughout: the ``torch.autocast(bfloat16)``
  blocks are dropped.
* Sizes: upstream hard-codes them; here they are arguments with small defaults: GPTConfig
  ``--block-size 16 --vocab-size 64 --n-layer 2 --n-head 2 --n-embd 32`` (upstream GPT-2 124M,
  vocab 50304), ``--total-batch-size 256 --B 4 --T 16`` (grad_accum_steps = 2 on 2 ranks;
  upstream 524288, 64, 1024), ``--max-steps 10 --warmup-steps 2 --max-lr 6e-4`` (upstream
  19073, 715, 6e-4), validation every ``--val-every 5`` steps over ``--val-loss-steps 2``
  batches (upstream 250 and 20), checkpoints every ``--checkpoint-every 5`` steps (upstream 5000)
  into ``--log-dir log`` (upstream's log directory, with its log.txt).
* Data: DataLoaderLite reads the shards in ``$NANOGPT_DATA`` (default upstream's
  ``edu_fineweb10B``); the tests write small uint16 .npy shards named as fineweb.py names them.
* Dropped: ``GPT.from_pretrained`` (transformers), the HellaSwag evaluation (``hellaswag``,
  ``get_most_likely_row``), sampling from the model (tiktoken), ``torch.compile`` (upstream's
  ``use_compile = False`` stays).
* Test instrumentation (PORT_TRACE, the ``port_trace`` calls; kept identical in the port): with
  ``PORT_TRACE=<dir>``, each DataLoaderLite.next_batch appends ``<shard> <position> <B> <T>``
  (where the micro-batch's B sequences of T tokens start) to ``<dir>/<split>-rank<RANK>.txt``,
  and the loop writes ``step <k>`` to the train trace before each step's micro-batches and
  ``val <k>`` to the val trace before each validation.
"""
import os
import math
import time
import inspect
from dataclasses import dataclass
import torch
import torch.nn as nn
from torch.nn import functional as F
# -----------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        # regularization
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)
        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        # nh is "number of heads", hs is "head size", and C (number of channels) = nh * hs
        # e.g. in GPT-2 (124M), n_head=12, hs=64, so nh*hs=C=768 channels in the Transformer
        qkv = self.c_attn(x)
        q, k, v = qkv.split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) # flash attention
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side
        # output projection
        y = self.c_proj(y)
        return y

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu    = nn.GELU(approximate='tanh')
        self.c_proj  = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        return x

class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x

@dataclass
class GPTConfig:
    block_size: int = 1024 # max sequence length
    vocab_size: int = 50257 # number of tokens: 50,000 BPE merges + 256 bytes tokens + 1 <|endoftext|> token
    n_layer: int = 12 # number of layers
    n_head: int = 12 # number of heads
    n_embd: int = 768 # embedding dimension

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            h = nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f = nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        # weight sharing scheme
        self.transformer.wte.weight = self.lm_head.weight

        # init params
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, 'NANOGPT_SCALE_INIT'):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        # idx is of shape (B, T)
        B, T = idx.size()
        assert T <= self.config.block_size, f"Cannot forward sequence of length {T}, block size is only {self.config.block_size}"
        # forward the token and posisition embeddings
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device) # shape (T)
        pos_emb = self.transformer.wpe(pos) # position embeddings of shape (T, n_embd)
        tok_emb = self.transformer.wte(idx) # token embeddings of shape (B, T, n_embd)
        x = tok_emb + pos_emb
        # forward the blocks of the transformer
        for block in self.transformer.h:
            x = block(x)
        # forward the final layernorm and the classifier
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x) # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # start with all of the candidate parameters (that require grad)
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        # create optim groups. Any parameters that is 2D will be weight decayed, otherwise no.
        # i.e. all weight tensors in matmuls + embeddings decay, all biases and layernorms don't.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        if master_process:
            print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
            print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        # Create AdamW optimizer and use the fused version if it is available
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        if master_process:
            print(f"using fused AdamW: {use_fused}")
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=use_fused)
        return optimizer

# -----------------------------------------------------------------------------
import numpy as np

def port_trace(split, line):
    """Test instrumentation: append ``line`` to $PORT_TRACE/<split>-rank<RANK>.txt."""
    trace_dir = os.environ.get("PORT_TRACE")
    if trace_dir:
        with open(os.path.join(trace_dir, f"{split}-rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
            f.write(f"{line}\n")

def load_tokens(filename):
    npt = np.load(filename)
    npt = npt.astype(np.int32) # added after video
    ptt = torch.tensor(npt, dtype=torch.long)
    return ptt

class DataLoaderLite:
    def __init__(self, B, T, process_rank, num_processes, split):
        self.B = B
        self.T = T
        self.process_rank = process_rank
        self.num_processes = num_processes
        assert split in {'train', 'val'}
        self.split = split

        # get the shard filenames
        data_root = os.environ.get("NANOGPT_DATA", "edu_fineweb10B")
        shards = os.listdir(data_root)
        shards = [s for s in shards if split in s]
        shards = sorted(shards)
        shards = [os.path.join(data_root, s) for s in shards]
        self.shards = shards
        assert len(shards) > 0, f"no shards found for split {split}"
        if master_process:
            print(f"found {len(shards)} shards for split {split}")
        self.reset()

    def reset(self):
        # state, init at shard zero
        self.current_shard = 0
        self.tokens = load_tokens(self.shards[self.current_shard])
        self.offset = 0 # the micro-step's first token, the same on every rank

    def next_batch(self, span=None):
        start, stop = span or (self.B * self.process_rank, self.B * (self.process_rank + 1))
        B, T = stop - start, self.T
        self.current_position = self.offset + start * T
        port_trace(self.split, f"{self.current_shard} {self.current_position} {B} {T}")
        buf = self.tokens[self.current_position : self.current_position+B*T+1]
        x = (buf[:-1]).view(B, T) # inputs
        y = (buf[1:]).view(B, T) # targets
        # advance the position in the tensor
        self.offset += self.B * T * self.num_processes
        # if loading the next batch would be out of bounds, advance to next shard
        if self.offset + (self.B * T * self.num_processes + 1) > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.shards)
            self.tokens = load_tokens(self.shards[self.current_shard])
            self.offset = 0
        return x, y

# -----------------------------------------------------------------------------
# simple launch:
# python nanogpt_train.py
# DDP launch for e.g. 2 CPU processes:
# torchrun --standalone --nproc_per_node=2 nanogpt_train.py

# run the training loop
import hetlb
from torch.distributed import init_process_group, destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed as dist

# the sizes upstream hard-codes, as arguments with tiny defaults
import argparse
parser = argparse.ArgumentParser(description="build-nanogpt's train_gpt2.py, tiny, on the CPU")
parser.add_argument("--block-size", type=int, default=16)
parser.add_argument("--vocab-size", type=int, default=64)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=32)
parser.add_argument("--total-batch-size", type=int, default=256)
parser.add_argument("--B", type=int, default=4)
parser.add_argument("--T", type=int, default=16)
parser.add_argument("--max-lr", type=float, default=6e-4)
parser.add_argument("--warmup-steps", type=int, default=2)
parser.add_argument("--max-steps", type=int, default=10)
parser.add_argument("--val-every", type=int, default=5)
parser.add_argument("--val-loss-steps", type=int, default=2)
parser.add_argument("--checkpoint-every", type=int, default=5)
parser.add_argument("--log-dir", default="log")
args = parser.parse_args()

# set up DDP (distributed data parallel).
# torchrun command sets the env variables RANK, LOCAL_RANK, and WORLD_SIZE
ddp = int(os.environ.get('RANK', -1)) != -1 # is this a ddp run?
if ddp:
    # DDP on the CPU, with Gloo
    init_process_group(backend='gloo')
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    device = 'cpu'
    master_process = ddp_rank == 0 # this process will do logging, checkpointing etc.
else:
    # vanilla, non-DDP run
    ddp_rank = 0
    ddp_local_rank = 0
    ddp_world_size = 1
    master_process = True
    device = "cpu"
    print(f"using device: {device}")

# added after video, pytorch can be serious about it's device vs. device_type distinction
device_type = "cuda" if device.startswith("cuda") else "cpu"

torch.manual_seed(1337)

total_batch_size = args.total_batch_size # upstream 524288, 2**19, ~0.5M, in number of tokens
B = args.B # micro batch size
T = args.T # sequence length
assert total_batch_size % (B * T * ddp_world_size) == 0, "make sure total_batch_size is divisible by B * T * ddp_world_size"
grad_accum_steps = total_batch_size // (B * T * ddp_world_size)
if master_process:
    print(f"total desired batch size: {total_batch_size}")
    print(f"=> calculated gradient accumulation steps: {grad_accum_steps}")

train_loader = DataLoaderLite(B=B, T=T, process_rank=ddp_rank, num_processes=ddp_world_size, split="train")
val_loader = DataLoaderLite(B=B, T=T, process_rank=ddp_rank, num_processes=ddp_world_size, split="val")

torch.set_float32_matmul_precision('high')

# create model
model = GPT(GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size,
                      n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
model.to(device)
use_compile = False # torch.compile interferes with HellaSwag eval and Generation. TODO fix
if use_compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model # always contains the "raw" unwrapped model
bal = hetlb.Balancer(model, global_batch=B * ddp_world_size, accumulate=grad_accum_steps)

max_lr = args.max_lr
min_lr = max_lr * 0.1
warmup_steps = args.warmup_steps
max_steps = args.max_steps
def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_steps:
        return max_lr * (it+1) / warmup_steps
    # 2) if it > lr_decay_iters, return min learning rate
    if it > max_steps:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) # coeff starts at 1 and goes to 0
    return min_lr + coeff * (max_lr - min_lr)

# optimize!
optimizer = raw_model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type)

# create the log directory we will write checkpoints to and log to
log_dir = args.log_dir
os.makedirs(log_dir, exist_ok=True)
log_file = os.path.join(log_dir, f"log.txt")
with open(log_file, "w") as f: # open for writing to clear the file
    pass

for step in range(max_steps):
    t0 = time.time()
    last_step = (step == max_steps - 1)

    # once in a while evaluate our validation loss
    if step % args.val_every == 0 or last_step:
        model.eval()
        port_trace("val", f"val {step}")
        val_loader.reset()
        with torch.no_grad():
            val_loss_accum = 0.0
            val_loss_steps = args.val_loss_steps
            for _ in range(val_loss_steps):
                x, y = val_loader.next_batch()
                x, y = x.to(device), y.to(device)
                logits, loss = model(x, y)
                loss = loss / val_loss_steps
                val_loss_accum += loss.detach()
        if ddp:
            dist.all_reduce(val_loss_accum, op=dist.ReduceOp.AVG)
        if master_process:
            print(f"validation loss: {val_loss_accum.item():.4f}")
            with open(log_file, "a") as f:
                f.write(f"{step} val {val_loss_accum.item():.4f}\n")
            if step > 0 and (step % args.checkpoint_every == 0 or last_step):
                # optionally write model checkpoints
                checkpoint_path = os.path.join(log_dir, f"model_{step:05d}.pt")
                checkpoint = {
                    'model': raw_model.state_dict(),
                    'config': raw_model.config,
                    'step': step,
                    'val_loss': val_loss_accum.item()
                }
                # you might also want to add optimizer.state_dict() and
                # rng seeds etc., if you wanted to more exactly resume training
                torch.save(checkpoint, checkpoint_path)

    # do one step of the optimization
    model.train()
    optimizer.zero_grad()
    port_trace("train", f"step {step}")
    for micro_step in range(grad_accum_steps):
        x, y = train_loader.next_batch(bal.span)
        x, y = x.to(device), y.to(device)
        with bal.step():
            logits, loss = model(x, y)
            bal.log_loss(loss)
            # we have to scale the loss to account for gradient accumulation,
            # because the gradients just add on each successive backward().
            # addition of gradients corresponds to a SUM in the objective, but
            # instead of a SUM we want MEAN. Scale the loss here so it comes out right
            loss = loss / grad_accum_steps
            loss.backward()
    assert bal.synced # the window ends with the micro-steps: the gradient is complete
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    # determine and set the learning rate for this iteration
    lr = get_lr(step)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    optimizer.step()
    t1 = time.time()
    dt = t1 - t0 # time difference in seconds
    tokens_processed = train_loader.B * train_loader.T * grad_accum_steps * ddp_world_size
    tokens_per_sec = tokens_processed / dt
    if master_process:
        print(f"step {step:5d} | loss: {bal.finished.loss:.6f} | lr {lr:.4e} | norm: {norm:.4f} | dt: {dt*1000:.2f}ms | tok/sec: {tokens_per_sec:.2f}")
        with open(log_file, "a") as f:
            f.write(f"{step} train {bal.finished.loss:.6f}\n")

if ddp:
    destroy_process_group()
