#!/usr/bin/python3
"""The dense-vs-DSA table of docs/convergence.md ("The same text with
DeepSeek Sparse Attention") from two `laga train --log` files of the same schedule.

    python/dsa_text_summary.py DENSE.jsonl DSA.jsonl

Prints, per run, the last step's training loss, every validation's loss
(nats and bits per byte), the DSA run's gap to dense (absolute and relative)
at the last step and at each validation, the largest relative training-loss
gap over the sparse stage's steps (each step's loss, and the mean of its last
20 steps, since one batch's loss is noisy), and the indexer's KL at the first
and last step of each stage.
"""
import json
import math
import sys


def read(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    dense, dsa = read(sys.argv[1]), read(sys.argv[2])
    n = min(len(dense), len(dsa))
    if n == 0:
        sys.exit("no steps in common")
    bits = 1 / math.log(2)
    d, s = dense[n - 1], dsa[n - 1]
    print(f"steps in common: {n}")
    print(f"last step {n}: train loss dense {d['loss']:.4f}, DSA {s['loss']:.4f}, "
          f"gap {s['loss'] - d['loss']:+.4f} ({(s['loss'] - d['loss']) / d['loss']:+.2%})")
    for a, b in zip(dense[:n], dsa[:n]):
        if "val_loss" in a and "val_loss" in b:
            g = b["val_loss"] - a["val_loss"]
            print(f"  val step {a['step']}: dense {a['val_loss']:.4f} ({a['val_loss'] * bits:.3f} "
                  f"bits/byte), DSA {b['val_loss']:.4f} ({b['val_loss'] * bits:.3f}), gap "
                  f"{g:+.4f} ({g / a['val_loss']:+.2%})")
    sparse = [i for i in range(n) if dsa[i].get("dsa_stage") == "sparse"]
    if sparse:
        worst = max(sparse, key=lambda i: abs(dsa[i]["loss"] - dense[i]["loss"]) / dense[i]["loss"])
        print(f"  largest per-step train gap in the sparse stage: step {worst + 1}, "
              f"{(dsa[worst]['loss'] - dense[worst]['loss']) / dense[worst]['loss']:+.2%}")
        tail = sparse[-20:]
        md = sum(dense[i]["loss"] for i in tail) / len(tail)
        ms = sum(dsa[i]["loss"] for i in tail) / len(tail)
        print(f"  mean train loss, steps {tail[0] + 1}-{tail[-1] + 1}: dense {md:.4f}, "
              f"DSA {ms:.4f}, gap {(ms - md) / md:+.2%}")
    for stage in ("dense_warmup", "sparse"):
        steps = [r for r in dsa[:n] if r.get("dsa_stage") == stage]
        if steps:
            a, b = steps[0], steps[-1]
            print(f"  index_kl {stage}: step {a['step']} {a['index_kl']:.4f} -> step "
                  f"{b['step']} {b['index_kl']:.4f} ({(b['index_kl'] - a['index_kl']) / a['index_kl']:+.1%})")


if __name__ == "__main__":
    main()
