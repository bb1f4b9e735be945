#!/usr/bin/python3
"""Run-to-run loss divergence of an MoE model against a dense control, with
laga's reductions in rank order and under the reduction-order switch
(`laga train --perturb-reductions SEED`): the paper's reproducibility caveat
(its section 8) tested on laga (docs/convergence.md, "Reproducibility under
perturbed reductions").

    python3 scripts/moe_repro.py LAGA OUT_DIR [--steps N] [--sp P] [--data FILE]

For each model (docs/assets/moe_tiny.json, and the same with
first_k_dense_replace = num_hidden_layers: every layer's FFN dense, the
control) it trains four runs with the same --seed: two without the switch
(off_a, off_b) and two with --perturb-reductions 1 and 2 (on_a, on_b), and
compares the pairs step by step: |loss_a - loss_b|. With --log-expert-load
each step's log holds the step's global token count per expert of every MoE
layer; the first step at which the two MoE runs' counts differ is the first
routing flip that counting can see (a flip that one token's swap in the
other direction cancels leaves the counts equal; it is seen one step later
at the latest when the loss moves). The table it prints is what the doc
shows. Stdlib only; the runs use OMP_NUM_THREADS=1.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MOE_TINY = os.path.join(HERE, "..", "docs", "assets", "moe_tiny.json")


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(laga, cfg, log, args, seed):
    cmd = [laga, "train", "--config", cfg, "--sp", str(args.sp), "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--lr", str(args.lr),
           "--warmup", "10", "--clip", "1", "--seed", "0", "--attention", "flash",
           "--log", log, "--log-expert-load", "--quiet"]
    if args.data:
        cmd += ["--data", args.data]
    if seed is not None:
        cmd += ["--perturb-reductions", str(seed)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if os.path.exists(log):
        os.remove(log)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env)
    return read_log(log)


def compare(a, b):
    """Per-step |loss_a - loss_b|, and the first step whose expert loads differ."""
    d = [abs(s["loss"] - t["loss"]) for s, t in zip(a, b)]
    flip = None
    for s, t in zip(a, b):
        if s.get("expert_load") != t.get("expert_load"):
            flip = s["step"]
            break
    return d, flip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("laga")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--reuse", action="store_true",
                    help="read the logs already in OUT_DIR instead of training again")
    ap.add_argument("--data", help="token file (u16, vocab 256: scripts/text_data.py); "
                    "default random")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(MOE_TINY) as f:
        moe = json.load(f)
    dense = dict(moe, first_k_dense_replace=moe["num_hidden_layers"])
    cfgs = {}
    for name, c in (("moe", moe), ("dense", dense)):
        cfgs[name] = os.path.join(args.out, name + ".json")
        with open(cfgs[name], "w") as f:
            json.dump(c, f, indent=1)
    runs = {}
    for name in ("moe", "dense"):
        for run, seed in (("off_a", None), ("off_b", None), ("on_a", 1), ("on_b", 2)):
            log = os.path.join(args.out, f"{name}_{run}.jsonl")
            runs[name, run] = (read_log(log) if args.reuse else
                               train(args.laga, cfgs[name], log, args, seed))
    n = args.steps
    print(f"# {n} steps, --sp {args.sp}, --seq {args.seq} --batch {args.batch} --lr {args.lr}, "
          f"data {args.data or 'random'}")
    print("model  switch  max|dloss|   mean|dloss|  first dloss>0  first load diff  "
          "jump at flip")
    means = {}
    for name in ("moe", "dense"):
        for sw, (ra, rb) in (("off", ("off_a", "off_b")), ("on", ("on_a", "on_b"))):
            d, flip = compare(runs[name, ra], runs[name, rb])
            means[name, sw] = sum(d) / len(d)
            nz = [i for i, x in enumerate(d) if x > 0]
            first = str(runs[name, ra][nz[0]]["step"]) if len(nz) else "-"
            jump = "-"
            if flip is not None and flip >= 2:
                before, at = d[flip - 2], d[flip - 1]  # steps flip-1 and flip
                jump = f"{at:.2e} / {before:.2e}" if before > 0 else f"{at:.2e} / 0"
            print(f"{name:6} {sw:6}  {max(d):11.3e}  {means[name, sw]:12.3e}  {first:>13}  "
                  f"{str(flip) if flip is not None else '-':>15}  {jump}")
    if means["dense", "on"] > 0:
        print(f"moe / dense mean |dloss| with the switch on: "
              f"{means['moe', 'on'] / means['dense', 'on']:.1f}x")
    # Around the MoE runs' first routing flip: mean |dloss| before it, and
    # over the 100 steps from it on, MoE against dense over the same steps.
    dm, flip = compare(runs["moe", "on_a"], runs["moe", "on_b"])
    dd, _ = compare(runs["dense", "on_a"], runs["dense", "on_b"])
    if flip is not None:
        def mean(x):
            return sum(x) / len(x) if x else float("nan")
        lo, hi = flip - 1, min(n, flip - 1 + 100)
        print(f"switch on, steps 1..{flip - 1} (before the flip): moe {mean(dm[:lo]):.3e}, "
              f"dense {mean(dd[:lo]):.3e}, moe/dense {mean(dm[:lo]) / mean(dd[:lo]):.1f}x")
        print(f"switch on, steps {flip}..{hi} (from the flip): moe {mean(dm[lo:hi]):.3e}, "
              f"dense {mean(dd[lo:hi]):.3e}, moe/dense {mean(dm[lo:hi]) / mean(dd[lo:hi]):.1f}x")
        print(f"jump at the flip: |dloss| step {flip - 1} {dm[lo - 1]:.3e} -> step {flip} "
              f"{dm[lo]:.3e} ({dm[lo] / dm[lo - 1]:.0f}x) -> step {flip + 1} {dm[lo + 1]:.3e}")
    # Per-step rows for the doc's table: every 10th step, and the flip.
    print("step  moe_on|dloss|  dense_on|dloss|")
    for i in range(n):
        step = i + 1
        if step in (1, 2, 5) or step % max(1, n // 10) == 0 or (
                flip is not None and abs(step - flip) <= 1):
            print(f"{step:4}  {dm[i]:13.3e}  {dd[i]:15.3e}")


if __name__ == "__main__":
    main()
