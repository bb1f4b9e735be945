#!/usr/bin/python3
"""A small MLA language model trained with laga's sequence parallelism.

    torchrun --nproc-per-node 2 python/examples/train_mla.py --form laga \
        --backend gloo --device cpu --steps 20

Every rank holds the whole model and its shard of every sequence
(SpLayout.even: uneven lengths are fine; --seq-layout zigzag shards it as
TransformerEngine's load-balanced context parallelism does, two mirrored
chunks a rank, SpLayout.positions); the attention blocks exchange what
their form needs, everything else is per token. The loss is the mean over
every token of the batch, so each rank's gradient is a partial sum: one
all-reduce of all gradients per step (laga_torch.sync_gradients does it for
one block; here the embedding and head are summed the same way). The losses
printed are the same at every P to rounding (--json writes them).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import laga_torch as lt  # noqa: E402

CONFIG = {"dim": 32, "n_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
          "qk_rope_head_dim": 4, "v_head_dim": 8, "max_seq_len": 4096}


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TinyLM(nn.Module):
    def __init__(self, cfg, vocab, layers, **mla):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.dim)
        self.norms = nn.ModuleList(Norm(cfg.dim) for _ in range(layers))
        self.blocks = nn.ModuleList(lt.MLA(cfg, **mla) for _ in range(layers))
        self.head = nn.Linear(cfg.dim, vocab, bias=False)

    def forward(self, tokens, group, seq_len):
        h = self.embed(tokens)
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(norm(h), group=group, seq_len=seq_len)
        return self.head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", default="laga", choices=lt.FORMS)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
    ap.add_argument("--attention", default="eager", choices=["eager", "flash"],
                    help="laga's tape: probabilities saved (eager) or o and lse (flash)")
    ap.add_argument("--seq-layout", default="contiguous", choices=lt.layout.SEQ_LAYOUTS,
                    help="contiguous (rank r one range) or zigzag (chunks r and 2P-1-r of 2P)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=61)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--json", help="rank 0 writes the per-step losses here")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    dev = torch.device(args.device if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL: one device per rank
    dtype = getattr(torch, args.dtype)
    cfg = lt.MLAConfig.from_json(CONFIG)
    torch.manual_seed(0)  # the same initial model on every rank and at every P
    model = TinyLM(cfg, vocab=64, layers=2, form=args.form,
                  attention=args.attention, seq_layout=args.seq_layout).to(dev, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # This rank's tokens of every sequence, in its shard's order.
    own = torch.tensor(lt.SpLayout.even(args.seq, cfg.n_heads, P, args.seq_layout).positions(rank),
                       device=dev)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        # A learnable stream: a random start, then counting up (mod 64).
        start = torch.randint(0, 64, (args.batch, 1), generator=data)
        seq = (start + torch.arange(args.seq + 1)) % 64
        tokens, targets = seq[:, :-1].to(dev), seq[:, 1:].to(dev)
        logits = model(tokens[:, own], None, args.seq)
        n = targets.numel()
        loss = F.cross_entropy(logits.flatten(0, 1).float() if dtype == torch.bfloat16 else
                               logits.flatten(0, 1), targets[:, own].flatten(),
                               reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)  # every rank's partial sum -> the whole batch's
        i = 0
        for p in model.parameters():
            p.grad.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()
        opt.step()
        total = loss.detach().double().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if rank == 0:
            print(f"step {step:3d}  loss {total.item():.12f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"P": P, "form": args.form, "seq_layout": args.seq_layout,
                       "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
