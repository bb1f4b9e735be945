#!/usr/bin/env python3
"""`laga train` on a DeepSeek Sparse Attention model from the command line
(issue 55; model/dsa_layer.hpp).

    test_train_dsa_cli.py LAGA_BINARY SCRATCH_DIR

- the model from --index-heads/--index-head-dim/--index-topk: every --log
  line holds index_kl (finite, >= 0) and dsa_stage (dense_warmup for the
  first --index-warmup steps, then sparse);
- a DSA --config (ModelArgs keys index_n_heads, index_head_dim, index_topk)
  trains, where laga train refused it before; its checkpoint holds every
  layer's indexer under DeepSeek's names (layers.N.attn.indexer.*);
- --dtype bf16 (bf16 mixed precision; docs/forms.md, "DSA in bf16"): 6
  steps (2 of dense warm-up) follow fp32's loss within 2^-8 of it (one bf16
  unit roundoff of the loss) and its index_kl within 2^-7 (the KL is a sum
  of log-ratios of probabilities whose scores carry two bf16 roundings, of
  q and k), at --sp 1 (the DSA block) and --sp 2 (the latent gather), and
  --sp 2 follows --sp 1 within the same margins; the bf16 losses are not
  fp32's (the bf16 path ran);
- refused, exit 2, one message naming the option: --form/--attention beside
  a DSA model, --index-warmup on a dense model, --index-topk without the
  other two, DSA without --q-lora-rank, --index-topk above --seq;
- the memory check: a dense warm-up step that cannot fit refused up front
  (exit 2), naming --index-warmup 0.
Only the standard library.
"""
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys

LAGA, SCRATCH = sys.argv[1], os.path.join(sys.argv[2], "train_dsa_cli")
shutil.rmtree(SCRATCH, ignore_errors=True)
os.makedirs(SCRATCH)
MODEL = ["--vocab", "64", "--layers", "2", "--d-model", "32", "--heads", "4",
         "--q-lora-rank", "16", "--seq", "32", "--batch", "2", "--quiet"]
INDEX = ["--index-heads", "2", "--index-head-dim", "8", "--index-topk", "8"]
failures = []


def run(args):
    return subprocess.run([LAGA, "train"] + args, capture_output=True, text=True, timeout=120)


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


# ---- options, the log's fields
log = os.path.join(SCRATCH, "dsa.jsonl")
r = run(MODEL + INDEX + ["--steps", "4", "--index-warmup", "2", "--log", log])
check(r.returncode == 0, f"DSA by options should train: {r.stderr}")
lines = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
check(len(lines) == 4, f"4 log lines expected, got {len(lines)}")
for i, j in enumerate(lines):
    check(math.isfinite(j.get("index_kl", float("nan"))) and j["index_kl"] >= 0,
          f"step {i + 1}: index_kl missing or not finite: {j}")
    want = "dense_warmup" if i < 2 else "sparse"
    check(j.get("dsa_stage") == want, f"step {i + 1}: dsa_stage {j.get('dsa_stage')}, want {want}")

# ---- bf16 mixed precision against fp32, and at --sp 2 against --sp 1


def losses(tag, extra):
    path = os.path.join(SCRATCH, tag + ".jsonl")
    r = run(MODEL + INDEX + ["--steps", "6", "--index-warmup", "2", "--log", path] + extra)
    check(r.returncode == 0, f"{tag}: should train: {r.stderr.strip()[-300:]}")
    if not os.path.exists(path):
        return []
    return [(j["loss"], j["index_kl"]) for j in map(json.loads, open(path))]


def follows(tag, got, want, want_tag):
    check(len(got) == 6 and len(want) == 6, f"{tag}: 6 log lines each expected")
    for step, ((l, kl), (lw, klw)) in enumerate(zip(got, want), 1):
        check(abs(l - lw) <= lw / 256,
              f"{tag} step {step}: loss {l} vs {want_tag}'s {lw}: beyond 2^-8 of it")
        check(abs(kl - klw) <= 1 / 128,
              f"{tag} step {step}: index_kl {kl} vs {want_tag}'s {klw}: beyond 2^-7")


fp32 = losses("fp32_sp1", [])
bf16_sp1 = losses("bf16_sp1", ["--dtype", "bf16"])
bf16_sp2 = losses("bf16_sp2", ["--dtype", "bf16", "--sp", "2"])
follows("bf16 --sp 1", bf16_sp1, fp32, "fp32 --sp 1")
follows("bf16 --sp 2", bf16_sp2, fp32, "fp32 --sp 1")
follows("bf16 --sp 2", bf16_sp2, bf16_sp1, "bf16 --sp 1")
check(any(abs(l - lw) > 1e-6 * lw for (l, _), (lw, _) in zip(bf16_sp1, fp32)),
      "bf16 losses equal fp32's to 1e-6: the bf16 path did not run")

# ---- a DSA config, and its checkpoint's names
cfg = os.path.join(SCRATCH, "dsa.json")
json.dump({"dim": 32, "n_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 32,
           "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
           "n_layers": 2, "vocab_size": 64, "inter_dim": 96,
           "index_n_heads": 2, "index_head_dim": 8, "index_topk": 8}, open(cfg, "w"))
ck = os.path.join(SCRATCH, "ck")
r = run(["--config", cfg, "--seq", "32", "--batch", "2", "--steps", "2", "--quiet",
         "--checkpoint", ck])
check(r.returncode == 0, f"a DSA --config should train: {r.stderr}")
tensors = [f for f in os.listdir(ck) if f.endswith(".safetensors")] if os.path.isdir(ck) else []
check(len(tensors) == 1, f"one checkpoint expected in {ck}: {tensors}")
if tensors:
    with open(os.path.join(ck, tensors[0]), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        names = set(json.loads(f.read(n)))
    for l in range(2):
        for t in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                  "weights_proj.weight"):
            name = f"param.layers.{l}.attn.indexer.{t}"
            check(name in names, f"checkpoint lacks {name}")

# ---- refusals
for args, words in [
        (MODEL + INDEX + ["--steps", "2", "--form", "laga"], "--form chooses among"),
        (MODEL + INDEX + ["--steps", "2", "--attention", "eager"], "drop --attention"),
        (MODEL + ["--steps", "2", "--index-warmup", "1"], "the model has no indexer"),
        (MODEL + ["--steps", "2", "--index-topk", "8"], "index_n_heads"),
        ([a if a != "16" else "0" for a in MODEL] + INDEX + ["--steps", "2"], "q_lora_rank"),
        (MODEL + ["--index-heads", "2", "--index-head-dim", "8", "--index-topk", "64",
                  "--steps", "2"], "index_topk 64 is above --seq 32"),
        (MODEL + INDEX + ["--steps", "2", "--dp", "2"], "--dp 2 is not supported"),
        (MODEL + INDEX + ["--steps", "2", "--invariant"], "--invariant is not offered")]:
    r = run(args)
    check(r.returncode == 2 and words in r.stderr,
          f"{' '.join(args[len(MODEL) - 1:])}: want exit 2 naming '{words}', got "
          f"{r.returncode}: {r.stderr.strip()[-300:]}")

# ---- the up-front memory check covers a DSA model: predict_train_memory runs
# one step of each stage the run has (model/dsa_layer.hpp). Under a 3 GB
# address space, --seq 40000 with a dense warm-up step (every causal key:
# 32.6 GB predicted) is refused before anything is allocated, naming the
# warm-up; laga before this checked only the state's lower bound (0.00 GB),
# started the step and failed allocating a 12.8 GB tensor.
i = MODEL.index("--seq")
big = MODEL[:i + 1] + ["40000"] + MODEL[i + 2:]
r = subprocess.run([LAGA, "train"] + big + INDEX + ["--steps", "2", "--index-warmup", "1"],
                   capture_output=True, text=True, timeout=120,
                   preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)))
check(r.returncode == 2 and "laga train would need" in r.stderr and "RLIMIT_AS" in r.stderr
      and "--index-warmup 0, not 1" in r.stderr,
      f"DSA --seq 40000 under RLIMIT_AS 3 GB: want exit 2 from the memory check naming the "
      f"warm-up, got {r.returncode}: {r.stderr.strip()[-400:]}")

if failures:
    sys.exit(f"{len(failures)} failure(s)")
print("ok")
