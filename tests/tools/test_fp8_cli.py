#!/usr/bin/env python3
"""--index-fp8 and --kv-fp8-round-trip (tools/cli_common.hpp, Fp8Options;
docs/forms.md, "The fp8 indexer"): the config keys index_fp8 and
kv_fp8_round_trip as options on laga forward, compare and train.

    test_fp8_cli.py LAGA_BINARY SCRATCH_DIR

- each flag does what its key does: forward's tensors (out, kl_loss, idx)
  with the flag equal those with the key in the config, byte for byte, and
  differ from those with neither (the flag took effect); compare's JSON with
  --index-fp8 equals the key's; train's log losses with --index-fp8 equal
  the key's and differ from neither's;
- refused, exit 2, one message naming the option: either flag on a dense
  model (forward, compare, train), --index-fp8 with index_head_dim 8,
  --kv-fp8-round-trip with kv_lora_rank 96, and --kv-fp8-round-trip beside
  a backward (forward --backward, compare, train).
Only the standard library. About 5 s on 2 cores.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

LAGA, SCRATCH = sys.argv[1], os.path.join(sys.argv[2], "fp8_cli")
shutil.rmtree(SCRATCH, ignore_errors=True)
os.makedirs(SCRATCH)
failures = []

# index_head_dim 128 and kv_lora_rank 128: one act_quant block each, what the
# two keys need; the rest tiny.
DSA = {"dim": 32, "n_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 128, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 8, "index_n_heads": 2, "index_head_dim": 128,
       "index_topk": 8, "n_layers": 1, "vocab_size": 64, "inter_dim": 64}


def config(name, **extra):
    path = os.path.join(SCRATCH, name + ".json")
    with open(path, "w") as f:
        json.dump({**DSA, **extra}, f)
    return path


def run(args):
    return subprocess.run([LAGA] + args, capture_output=True, text=True, timeout=120)


def check(ok, what):
    print(("ok:   " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)


def tensors(path):
    """name -> raw bytes of each tensor of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


plain = config("plain")
keyed = {"index_fp8": config("index_key", index_fp8=True),
         "kv_fp8_round_trip": config("kv_key", kv_fp8_round_trip=True)}
flags = {"index_fp8": "--index-fp8", "kv_fp8_round_trip": "--kv-fp8-round-trip"}


def forward(tag, cfg, extra):
    out = os.path.join(SCRATCH, tag + ".safetensors")
    r = run(["forward", "--config", cfg, "--seq", "48", "--output", out] + extra)
    check(r.returncode == 0, f"forward {tag} runs: {r.stderr.strip()[-300:]}")
    return tensors(out) if r.returncode == 0 else {}


# ---- each flag equals its key, and changes the result
neither = forward("neither", plain, [])
for key, flag in flags.items():
    by_flag = forward(key + "_flag", plain, [flag])
    by_key = forward(key + "_key", keyed[key], [])
    check(by_flag and by_flag == by_key,
          f"forward {flag}: out, kl_loss and idx equal those of the key {key}")
    # index_fp8 changes the selection, kv_fp8_round_trip the output.
    changed = "idx" if key == "index_fp8" else "out"
    check(by_flag.get(changed) != neither.get(changed),
          f"forward {flag}: {changed} differs from neither's (the flag took effect)")


def compare(tag, cfg, extra):
    path = os.path.join(SCRATCH, tag + ".json")
    r = run(["compare", "--config", cfg, "--seq", "48", "--sp", "2", "--quiet", "--json", path]
            + extra)
    check(r.returncode == 0, f"compare {tag} runs: {r.stderr.strip()[-300:]}")
    return json.load(open(path)) if r.returncode == 0 else None


by_flag = compare("compare_flag", plain, ["--index-fp8"])
check(by_flag is not None and by_flag == compare("compare_key", keyed["index_fp8"], []),
      "compare --index-fp8: the JSON equals the key's")


def losses(tag, cfg, extra):
    log = os.path.join(SCRATCH, tag + ".jsonl")
    r = run(["train", "--config", cfg, "--seq", "32", "--batch", "1", "--steps", "2", "--quiet",
             "--log", log] + extra)
    check(r.returncode == 0, f"train {tag} runs: {r.stderr.strip()[-300:]}")
    return [(j["loss"], j["index_kl"]) for j in map(json.loads, open(log))] if r.returncode == 0 \
        else []


by_flag = losses("train_flag", plain, ["--index-fp8"])
check(len(by_flag) == 2 and by_flag == losses("train_key", keyed["index_fp8"], []),
      "train --index-fp8: loss and index_kl equal the key's, step for step")
check(by_flag != losses("train_neither", plain, []),
      "train --index-fp8: the losses differ from neither's (the flag took effect)")

# ---- refusals
dense = ["--preset", "small", "--seq", "16"]
narrow = config("narrow", index_head_dim=8)
wide = config("wide", kv_lora_rank=96)
TRAIN_DENSE = ["train", "--d-model", "32", "--heads", "2", "--layers", "1", "--vocab", "64",
               "--seq", "16", "--steps", "1", "--quiet"]
cases = [(["forward"] + dense + ["--index-fp8"], "--index-fp8: preset small is dense MLA"),
         (["forward"] + dense + ["--kv-fp8-round-trip"],
          "--kv-fp8-round-trip: preset small is dense MLA"),
         (["compare"] + dense + ["--index-fp8"], "--index-fp8: preset small is dense MLA"),
         (TRAIN_DENSE + ["--index-fp8"], "--index-fp8: the model of the options is dense MLA"),
         (["forward", "--config", narrow, "--index-fp8"],
          "--index-fp8 on config " + narrow + ": index_fp8 needs index_head_dim 128"),
         (["forward", "--config", wide, "--kv-fp8-round-trip"],
          "kv_fp8_round_trip needs kv_lora_rank a multiple of 128"),
         (["forward", "--config", plain, "--kv-fp8-round-trip", "--backward"],
          "and --backward runs one; drop --kv-fp8-round-trip"),
         (["compare", "--config", plain, "--kv-fp8-round-trip"],
          "and laga compare (every form's backward) runs one"),
         (["train", "--config", plain, "--seq", "16", "--kv-fp8-round-trip"],
          "and laga train (every step's backward) runs one"),
         # The config's own key, refused as the flag is, before anything runs.
         (["forward", "--config", keyed["kv_fp8_round_trip"], "--backward"],
          "'s key kv_fp8_round_trip simulates DeepSeek's fp8 kv cache"),
         (["compare", "--config", keyed["kv_fp8_round_trip"]],
          "and laga compare (every form's backward) runs one; set kv_fp8_round_trip false"),
         (["train", "--config", keyed["kv_fp8_round_trip"], "--seq", "16"],
          "and laga train (every step's backward) runs one; set kv_fp8_round_trip false")]
for args, words in cases:
    r = run(args)
    errors = [line for line in r.stderr.splitlines() if line.startswith("laga: error: ")]
    check(r.returncode == 2 and len(errors) == 1 and words in errors[0],
          f"laga {' '.join(args[:1] + args[-2:])}: exit 2 naming {words!r} "
          f"(got {r.returncode}: {r.stderr.strip()[-300:]})")

if failures:
    sys.exit(f"{len(failures)} failure(s)")
print("ok")
