#!/usr/bin/env python3
"""Bad option values, unknown commands, non-finite data and allocation
failures end in the one error format: exit 2 and one line
"laga: error: <what was wrong and what to do>" (issue 10, items 3, 7, 11, 12).

    test_cli_options.py LAGA_BINARY SCRATCH_DIR CASE

Cases:
  options    a table over every subcommand's options: out-of-range values,
             non-numbers, NaN and inf, 0 where only positive makes sense
  messages   unknown command, no command, a directory or FIFO as data or
             config, a huge config integer: each message names what was given
  nonfinite  a NaN in a weight or in x is refused at load naming the tensor
             and the count; with --allow-nonfinite flash and eager agree on
             which outputs are non-finite
  memory     a job far beyond the machine is refused by the upfront memory
             check; with --no-memory-check its allocation is a laga error
             naming the size, not std::bad_alloc
  bf16       one --dtype vocabulary on every command (fp32 = float32, fp64 =
             float64; refusals name where a dtype runs); --dtype bf16 on
             forward, verify and compare: each runs and records
             its dtype (forward's file metadata, verify's and compare's JSON);
             verify passes its derived bound, compare's forms agree within it
             and differ from explicit by more than fp32 can
  q_latent   --q-latent where it does not apply (explicit or absorbed, q_lora_rank
             0, --forms without laga) on forward, verify, compare and train; and
             train with it: bit-identical losses at --sp 1, within fp32 rounding
             at --sp 2
Only the standard library, so any python3 runs it.
"""
import json
import os
import struct
import subprocess
import sys
import time

PREFIX = "laga: error: "
failures = []


def run(laga, args, timeout=60):
    return subprocess.run([laga] + args, capture_output=True, text=True, timeout=timeout)


def expect_error(laga, args, needle):
    """Exit 2, the message holds `needle`, one prefix, nothing on stdout."""
    try:
        p = run(laga, args)
    except subprocess.TimeoutExpired:
        failures.append(f"laga {' '.join(args)}: still running after 60 s")
        return
    err = p.stderr.strip()
    # One error, not two: exactly one line carries the prefix.
    lines = [l for l in err.splitlines() if l.startswith(PREFIX)]
    line = lines[0] if lines else ""
    ok = (p.returncode == 2 and needle in err and len(lines) == 1 and PREFIX + PREFIX not in err
          and "Value 0 not in range" not in err)
    print(("ok:   " if ok else "FAIL: ") + f"laga {' '.join(args)} -> {p.returncode}: {line[:150]}")
    if not ok:
        failures.append(f"laga {' '.join(args)}: exit {p.returncode}, wanted 2 and {needle!r} in:\n"
                        f"{err[:600]}")


TRAIN = ["train", "--d-model", "32", "--heads", "2", "--layers", "1", "--vocab", "64",
         "--seq", "16", "--steps", "1", "--quiet"]

PLAN = ["plan", "--preset", "tiny", "--profile", "h100", "--quiet"]

# (subcommand and fixed arguments, option, bad value, words the message must hold)
OPTION_CASES = [
    # train: the optimizer and schedule
    (TRAIN, "--beta1", "-0.1", "-0.1 is outside [0, 1)"),
    (TRAIN, "--beta1", "1", "1 is outside [0, 1)"),
    (TRAIN, "--beta2", "1.5", "1.5 is outside [0, 1)"),
    (TRAIN, "--eps", "0", "0 is outside (0, inf)"),
    (TRAIN, "--eps", "-1", "-1 is outside (0, inf)"),
    (TRAIN, "--weight-decay", "-1", "-1 is outside [0, inf)"),
    (TRAIN, "--clip", "-1", "-1 is outside [0, inf)"),
    (TRAIN, "--clip", "nan", "'nan' is not a finite number"),
    (TRAIN, "--warmup", "-1", "'-1' is not a whole number >= 0"),
    (TRAIN, "--min-lr", "-1", "-1 is outside [0, inf)"),
    (TRAIN + ["--min-lr", "0.5"], "--lr", "0.1", "--min-lr 0.5 is above --lr 0.1"),
    (TRAIN, "--lr", "inf", "'inf' is not a finite number"),
    (TRAIN, "--lr", "0", "0 is outside (0, inf)"),
    (TRAIN, "--lr", "abc", "'abc' is not a finite number"),
    (TRAIN, "--seed", "-1", "'-1' is not a whole number >= 0"),
    (TRAIN, "--save-every", "-2", "'-2' is not a whole number >= 0"),
    # train: sizes; 0 is an error, absence the default
    (TRAIN, "--nope-dim", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--rope-dim", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--v-dim", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--kv-lora-rank", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--q-lora-rank", "-1", "'-1' is not a whole number >= 0"),
    (TRAIN, "--ffn-hidden", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--seq", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--seq", "1e3", "(decimal digits only, no leading zeros)"),
    (TRAIN, "--batch", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--steps", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--layers", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--d-model", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--heads", "-3", "'-3' is not a whole number >= 1"),
    (TRAIN, "--vocab", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--sp", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--comm-timeout", "0", "'0' is not a whole number >= 1"),
    (TRAIN, "--schedule", "linear", "--schedule"),
    (TRAIN, "--data-dtype", "u8", "--data-dtype"),
    # forward
    (["forward", "--preset", "tiny"], "--layer", "-1", "'-1' is not a whole number >= 0"),
    (["forward", "--preset", "tiny"], "--seed", "-1", "'-1' is not a whole number >= 0"),
    (["forward", "--preset", "tiny"], "--seq", "0", "'0' is not a whole number >= 1"),
    (["forward", "--preset", "tiny"], "--batch", "0", "'0' is not a whole number >= 1"),
    (["forward", "--preset", "tiny"], "--sp", "0", "'0' is not a whole number >= 1"),
    (["forward", "--preset", "tiny"], "--comm-timeout", "-5", "'-5' is not a whole number >= 1"),
    # verify
    (["verify", "--preset", "tiny"], "--tol", "-1", "-1 is outside [0, inf)"),
    (["verify", "--preset", "tiny"], "--tol", "nan", "'nan' is not a finite number"),
    (["verify", "--preset", "tiny"], "--batch", "0", "'0' is not a whole number >= 1"),
    (["verify", "--preset", "tiny"], "--seq", "0", "'0' is not a whole number >= 1"),
    (["verify", "--preset", "tiny"], "--sp", "0", "'0' is not a whole number >= 1"),
    (["verify", "--preset", "tiny"], "--seed", "-1", "'-1' is not a whole number >= 0"),
    # compare
    (["compare", "--preset", "tiny"], "--rank-only", "-1", "'-1' is not a whole number >= 0"),
    (["compare", "--preset", "tiny"], "--seed", "-1", "'-1' is not a whole number >= 0"),
    (["compare", "--preset", "tiny"], "--batch", "0", "'0' is not a whole number >= 1"),
    (["compare", "--preset", "tiny"], "--sp", "0", "'0' is not a whole number >= 1"),
    (["compare", "--preset", "tiny"], "--seq", "-5", "'-5' is not a whole number >= 1"),
    (["compare", "--preset", "tiny"], "--steps", "0", "'0' is not a whole number >= 1"),
    (["compare", "--preset", "tiny"], "--warmup", "-1", "'-1' is not a whole number >= 0"),
    (["compare", "--preset", "tiny"], "--doc-lens", "", "an empty --doc-lens means nothing"),
    (["forward", "--preset", "tiny"], "--doc-lens", "", "an empty --doc-lens means nothing"),
    (["verify", "--preset", "tiny"], "--doc-lens", "", "an empty --doc-lens means nothing"),
    (["compare", "--preset", "tiny"], "--attention", "fast", "--attention"),
    # --dtype: a value outside the tool's set, and bf16 with eager attention
    (["compare", "--preset", "tiny"], "--dtype", "fp16", "--dtype"),
    (["verify", "--preset", "tiny"], "--dtype", "fp16", "--dtype"),
    (["forward", "--preset", "tiny"], "--dtype", "fp16", "--dtype"),
    (["compare", "--preset", "tiny", "--attention", "eager"], "--dtype", "bf16",
     "--dtype bf16 runs flash attention only"),
    (["verify", "--preset", "tiny", "--attention", "eager"], "--dtype", "bf16",
     "--dtype bf16 runs flash attention only"),
    (["forward", "--preset", "tiny", "--attention", "eager"], "--dtype", "bf16",
     "--dtype bf16 runs flash attention only"),
    (TRAIN, "--dtype", "fp16", "--dtype"),
    (TRAIN + ["--attention", "eager"], "--dtype", "bf16", "--dtype bf16 runs flash attention only"),
    # --link beyond what the model can hold a rank for (it was accepted and
    # silently not applied, issue 26 item 15)
    (["compare", "--preset", "tiny"], "--link", "1e-300", "is beyond what the link model holds"),
    (["compare", "--preset", "tiny"], "--link", "5,1e300", "is beyond what the link model holds"),
    (PLAN, "--link", "1e9", "is beyond what the link model holds"),
]


# Every whole-number option of every command, lists and --doc-lens too:
# one rule (src/core/whole_number.hpp), decimal digits only. '010' was octal
# 8 in some options and 10 in others, '0x10' 16 in some (issue 26 item 3).
WHOLE_OPTIONS = [
    (TRAIN, o) for o in ("--steps", "--seed", "--warmup", "--save-every", "--nope-dim",
                         "--rope-dim", "--v-dim", "--kv-lora-rank", "--q-lora-rank",
                         "--ffn-hidden", "--seq", "--batch", "--layers", "--d-model", "--heads",
                         "--vocab", "--sp", "--comm-timeout", "--head-groups", "--pack-eos",
                         "--val-every", "--val-batches")
] + [
    (["forward", "--preset", "tiny"], o) for o in ("--layer", "--seed", "--seq", "--batch", "--sp",
                                                   "--comm-timeout", "--head-groups", "--doc-lens")
] + [
    (["verify", "--preset", "tiny"], o) for o in ("--batch", "--seq", "--sp", "--seed",
                                                  "--head-groups", "--doc-lens")
] + [
    (["compare", "--preset", "tiny"], o) for o in ("--rank-only", "--seed", "--batch", "--seq",
                                                   "--sp", "--steps", "--warmup", "--head-groups",
                                                   "--doc-lens", "--comm-timeout")
] + [
    (PLAN, o) for o in ("--batch", "--seq", "--sp", "--nodes", "--head-groups")
]


def case_options(laga, scratch):
    for fixed, option, value, needle in OPTION_CASES:
        expect_error(laga, fixed + [option, value], needle)
    for fixed, option in WHOLE_OPTIONS:
        for value in ("010", "0x10", "1e3", "+5", "08"):
            expect_error(laga, fixed + [option, value], f"'{value}' is not a whole number")
    # Absence of a size means its default: the run succeeds.
    p = run(laga, TRAIN, timeout=120)
    if p.returncode != 0:
        failures.append(f"laga {' '.join(TRAIN)}: exit {p.returncode}\n{p.stderr[-600:]}")


def write(path, data, mode="w"):
    with open(path, mode) as f:
        f.write(data)


def case_messages(laga, scratch):
    expect_error(laga, ["frobnicate"], "unknown command 'frobnicate'; the commands are: ")
    p = run(laga, ["frobnicate"])
    for name in ("compare", "forward", "train", "verify"):
        if name not in p.stderr:
            failures.append(f"laga frobnicate does not list '{name}': {p.stderr}")
    expect_error(laga, [], "give a command: ")
    expect_error(laga, ["train", "--no-such-option"], "--no-such-option")
    fifo = os.path.join(scratch, "fifo")
    if os.path.exists(fifo):
        os.remove(fifo)
    os.mkfifo(fifo)
    # A FIFO with no writer: refused before any open, so this returns at once.
    expect_error(laga, TRAIN + ["--data", fifo], "is not a regular file")
    expect_error(laga, TRAIN + ["--data", scratch], "is a directory")
    expect_error(laga, ["forward", "--config", fifo], "is not a regular file")
    expect_error(laga, ["forward", "--config", scratch], "is a directory")
    cfg = os.path.join(scratch, "huge_dim.json")
    write(cfg, '{"dim": 1e300, "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,'
               ' "qk_rope_head_dim": 4, "v_head_dim": 8}')
    expect_error(laga, ["forward", "--config", cfg], "'dim' is 1e+300, beyond")
    # DeepSeek Sparse Attention's keys: read, and refused by the dense forms
    # rather than run densely; a partial set refused naming the key.
    dsa = os.path.join(scratch, "dsa.json")
    dsa_keys = ('{"dim": 48, "n_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,'
                ' "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,'
                ' "index_n_heads": 4, "index_head_dim": 8')
    write(dsa, dsa_keys + ', "index_topk": 4}')
    # verify runs the dense forms only: refused by name; forward and compare
    # run the DSA forms (tools/dsa_job.hpp), refusing what they do not take.
    expect_error(laga, ["verify", "--config", dsa], "sets DeepSeek Sparse Attention (index_topk 4)")
    expect_error(laga, ["forward", "--config", dsa, "--invariant"],
                 "--invariant: config " + dsa + " sets DeepSeek Sparse Attention")
    expect_error(laga, ["compare", "--rank-only", "0", "--config", dsa],
                 "--rank-only: config " + dsa + " sets DeepSeek Sparse Attention")
    expect_error(laga, ["compare", "--count-only", "--config", dsa, "--forms", "ring_latent"],
                 "--form ring_latent: a DSA form costed from its closed form only")
    write(dsa, dsa_keys + '}')
    expect_error(laga, ["forward", "--config", dsa],
                 "'index_topk' is missing; a DSA config gives")
    # Outputs are vetted before the work (issue 26 items 10, 11): two that are
    # one file, and a directory that does not exist, refused at once, not
    # after the run (plan --measure measured for seconds first).
    same = os.path.join(scratch, "same.out")
    expect_error(laga, ["compare", "--preset", "tiny", "--json", same, "--csv", same],
                 "--csv and --json are one file")
    expect_error(laga, ["compare", "--preset", "tiny", "--json", "-", "--csv", "-"],
                 "are one stream (stdout)")
    gone = os.path.join(scratch, "no_such_dir", "x.json")
    for args, option in [(["verify", "--preset", "tiny", "--json", gone], "--json"),
                         (["plan", "--preset", "tiny", "--measure", gone], "--measure"),
                         (["plan", "--preset", "tiny", "--profile", "h100", "--json", gone],
                          "--json"),
                         (["compare", "--preset", "tiny", "--csv", gone], "--csv"),
                         (["forward", "--preset", "tiny", "--output", gone], "--output"),
                         (["forms", "--json", gone], "--json")]:
        t0 = time.time()
        expect_error(laga, args, f"cannot write {option} '{gone}': its directory")
        if time.time() - t0 > 5:
            failures.append(f"laga {' '.join(args)}: refused only after {time.time() - t0:.1f} s")
    # Issue 26 item 18: each message names what was wrong. An input's x with
    # S = 0 or B = 0 names the file (today: "--seq 0", which was not given;
    # and no file); a dout of the wrong shape names dout (today: the
    # checkpoint); --measure onto a directory names --measure; --measure
    # with an option only a plan reads is refused (today: ignored).
    for shape, needle in [([1, 0, 48], "no tokens"), ([0, 4, 48], "no rows (B = 0)"),
                          ([1, 3, 48], "3 tokens per row, fewer than --sp 4")]:
        f = os.path.join(scratch, "x_%d_%d.safetensors" % (shape[0], shape[1]))
        safetensors(f, {"x": (shape, [0.5] * (shape[0] * shape[1] * shape[2]))})
        needle = needle if shape[1] != 0 else "fewer than --sp 4"
        expect_error(laga, ["forward", "--preset", "tiny", "--input", f, "--sp", "4"],
                     f"input '{f}': 'x' has shape [{shape[0]}, {shape[1]}, 48]: ")
        expect_error(laga, ["forward", "--preset", "tiny", "--input", f, "--sp", "4"], needle)
    f = os.path.join(scratch, "x_dout.safetensors")
    safetensors(f, {"x": ([1, 4, 48], [0.5] * 192), "dout": ([1, 4, 47], [1.0] * 188)})
    expect_error(laga, ["forward", "--preset", "tiny", "--input", f, "--backward"],
                 "'dout' has shape [1, 4, 47] but --backward needs x's [1, 4, 48]")
    expect_error(laga, ["plan", "--preset", "tiny", "--measure", scratch], "--measure")
    out = os.path.join(scratch, "measured.json")
    for extra, name in [(["--profile", "h100"], "--profile"), (["--json", "-"], "--json"),
                        (["--link", "10"], "--link")]:
        expect_error(laga, ["plan", "--preset", "tiny", "--measure", out] + extra,
                     f"plans nothing, so {name} would be ignored")
    # The upfront memory check predicts the job's element type: --dtype
    # float64 needs twice float32's bytes (it predicted float32's for both).
    need = {}
    for dtype in ("float32", "float64"):
        p = run(laga, ["forward", "--preset", "deepseek-v3", "--seq", "200000", "--dtype", dtype])
        words = p.stderr.split("would need about ")
        need[dtype] = float(words[1].split(" GB")[0]) if len(words) > 1 else None
    if not need["float32"] or not need["float64"] or \
            abs(need["float64"] / need["float32"] - 2) > 0.01:
        failures.append(f"forward's memory check by --dtype: {need}")
    # Validation's options need each other (issue 28 item 5).
    expect_error(laga, TRAIN + ["--val-every", "2"], "--val-every needs --val-data FILE")
    expect_error(laga, TRAIN + ["--val-data", os.path.join(scratch, "none.bin"), "--val-every",
                                "2"], "--val-data '")
    expect_error(laga, ["plan", "--preset", "tiny", "--profile", "this", "--dtype", "bf16"],
                 "no bf16 figures; use --dtype fp32")
    expect_error(laga, ["plan", "--preset", "tiny", "--measure", out, "--dtype", "bf16"],
                 "--measure times laga's fp32 kernels on this machine")
    # `--profile this` by default plans in fp32 and says so (today: "peak_flops.bf16
    # is null"); tiny's 4 heads at the default --sp 8 leave laga ranks with
    # no heads, whose empty attention calls are not timed (today: the
    # kernel's "query heads (0)" refusal).
    # Timing this machine's kernels takes 45-60 s on two loaded cores (58 s
    # seen at load 9-12 while the suite ran): the bound is a hang guard, so
    # it leaves room below the test's 300 s.
    p = run(laga, ["plan", "--preset", "tiny", "--profile", "this"], timeout=240)
    if p.returncode != 0 or "planning in fp32" not in p.stderr or "winner" not in p.stdout:
        failures.append(f"plan --profile this: exit {p.returncode}:\n{p.stderr[-600:]}")


def safetensors(path, tensors):
    """tensors: name -> (shape, list of floats), written as F32."""
    header, blob = {}, b""
    for name, (shape, values) in tensors.items():
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape,
                        "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    write(path, struct.pack("<Q", len(text)) + text + blob, "wb")


def tiny_weights(nan_in_wq):
    # preset tiny: D 48, H 4, C 24, dn 8, dr 4, dv 6, no q compression.
    D, H, C, dn, dr, dv = 48, 4, 24, 8, 4, 6
    shapes = {"wq.weight": [H * (dn + dr), D], "wkv_a.weight": [C + dr, D],
              "kv_norm.weight": [C], "wkv_b.weight": [H * (dn + dv), C], "wo.weight": [D, H * dv]}
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        n = 1
        for e in shape:
            n *= e
        values = [1.0 if name.endswith("norm.weight") else ((i * 37 + k * 11) % 17 - 8) / 64.0
                  for i in range(n)]
        out[name] = (shape, values)
    if nan_in_wq:
        out["wq.weight"][1][5] = float("nan")
    return out


def nonfinite_counts(stderr):
    """'output 'out' holds N non-finite' lines -> {tensor: N}."""
    counts = {}
    for line in stderr.splitlines():
        if "warning: output '" in line:
            name = line.split("output '")[1].split("'")[0]
            counts[name] = int(line.split(" holds ")[1].split()[0])
    return counts


def case_nonfinite(laga, scratch):
    good = os.path.join(scratch, "good.safetensors")
    bad = os.path.join(scratch, "nan_wq.safetensors")
    safetensors(good, tiny_weights(False))
    safetensors(bad, tiny_weights(True))
    base = ["forward", "--preset", "tiny", "--seq", "24", "--backward"]
    expect_error(laga, base + ["--weights", bad],
                 "tensor 'wq.weight' holds 1 non-finite value")
    x = os.path.join(scratch, "x_inf.safetensors")
    xs = [0.01 * (i % 13) for i in range(2 * 8 * 48)]
    xs[100] = float("inf")
    xs[7] = float("nan")
    safetensors(x, {"x": ([2, 8, 48], xs)})
    # (No --seq beside --input: x's shape gives it, and it is refused.)
    expect_error(laga, ["forward", "--preset", "tiny", "--backward", "--weights", good,
                        "--input", x], "tensor 'x' holds 2 non-finite values")
    # Studying them: both kernels run, warn, and agree on what is non-finite.
    seen = {}
    for attention in ("flash", "eager"):
        p = run(laga, base + ["--weights", bad, "--allow-nonfinite", "--attention", attention])
        if p.returncode != 0:
            failures.append(f"--allow-nonfinite --attention {attention}: exit {p.returncode}\n"
                            f"{p.stderr[-600:]}")
            continue
        seen[attention] = nonfinite_counts(p.stderr)
    if len(seen) == 2:
        print(f"non-finite outputs, flash: {seen['flash']}\n                   eager: {seen['eager']}")
        if seen["flash"].get("out", 0) != 24 * 48 or seen["flash"] != seen["eager"]:
            failures.append(f"a NaN in wq.weight: flash reports {seen['flash']}, eager "
                            f"{seen['eager']}; wanted the same, with all {24 * 48} of out")


def case_memory(laga, scratch):
    # 10^12 tokens with a wide RoPE: the upfront memory check refuses it
    # before any allocation; without the check, the first buffer (the RoPE
    # table, a std::vector) wants 4 * 10^15 bytes, beyond the 2^47-byte
    # address space, so it fails even where the kernel overcommits without
    # limit, naming the request.
    huge_train = ["train", "--seq", "1000000000000", "--rope-dim", "1024", "--d-model", "32",
                  "--heads", "2", "--layers", "1", "--vocab", "64", "--steps", "1", "--quiet"]
    expect_error(laga, huge_train, "laga train would need about")
    expect_error(laga, huge_train + ["--no-memory-check"],
                 "out of memory: a request for 4096000000000000 bytes")
    # The upfront memory check refuses the same job before any allocation...
    expect_error(laga, ["forward", "--preset", "tiny", "--seq", "100000000000000"],
                 "would need about")
    # ...and without it, a tensor: 1.9 * 10^16 bytes, named by shape and category.
    expect_error(laga, ["forward", "--preset", "tiny", "--seq", "100000000000000",
                        "--no-memory-check"],
                 "bytes (1.92e+07 GB) for a tensor of shape [1, 100000000000000, 48] (activations)")


def train_losses(laga, args, log):
    p = run(laga, args + ["--log", log], timeout=120)
    if p.returncode != 0:
        failures.append(f"laga {' '.join(args)}: exit {p.returncode}\n{p.stderr[-600:]}")
        return []
    with open(log) as f:
        return [json.loads(line)["loss"] for line in f]


def case_q_latent(laga, scratch):
    # A small config with q_lora_rank > 0 (the presets but deepseek-v3 have 0).
    cfg = os.path.join(scratch, "rq.json")
    write(cfg, '{"dim": 48, "n_heads": 5, "q_lora_rank": 20, "kv_lora_rank": 24,'
               ' "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}')
    applies = "--q-latent applies to the laga, laga_fused and laga2d forms with q_lora_rank > 0; "
    rq0 = applies + "the config has q_lora_rank 0"
    no_laga = applies + "--forms includes none of them"
    for form in ("explicit", "absorbed"):
        expect_error(laga, ["forward", "--config", cfg, "--form", form, "--q-latent"],
                     applies + f"not to the {form} form")
        expect_error(laga, TRAIN + ["--q-lora-rank", "8", "--form", form, "--q-latent"],
                     applies + f"not to the {form} form")
    expect_error(laga, ["forward", "--preset", "tiny", "--form", "laga", "--q-latent"], rq0)
    expect_error(laga, ["verify", "--preset", "tiny", "--q-latent"], rq0)
    expect_error(laga, ["compare", "--preset", "tiny", "--q-latent"], rq0)
    expect_error(laga, TRAIN + ["--q-latent"], rq0)
    expect_error(laga, ["verify", "--config", cfg, "--forms", "explicit,absorbed", "--q-latent"],
                 no_laga)
    expect_error(laga, ["compare", "--config", cfg, "--forms", "explicit", "--q-latent"], no_laga)
    # Training with it: the same GEMMs at P = 1, other summation orders at P = 2.
    # Three steps, so that the later losses depend on the gradients.
    base = ["train", "--d-model", "32", "--heads", "2", "--layers", "1", "--vocab", "64",
            "--seq", "16", "--steps", "3", "--quiet", "--q-lora-rank", "8"]
    # laga2d with one head group: the query latent sent to the two context
    # groups' chunks.
    for sp, form, rel in (("1", [], 0.0), ("2", [], 1e-5),
                          ("2", ["--form", "laga2d", "--head-groups", "1"], 1e-5)):
        run = base + ["--sp", sp] + form
        plain = train_losses(laga, run, os.path.join(scratch, "plain.jsonl"))
        latent = train_losses(laga, run + ["--q-latent"], os.path.join(scratch, "latent.jsonl"))
        ok = len(plain) == 3 and len(latent) == 3 and all(
            abs(a - b) <= rel * abs(a) for a, b in zip(plain, latent))
        what = f"train --sp {sp} {' '.join(form)} --q-latent"
        print(("ok:   " if ok else "FAIL: ") + f"{what} {latent} vs {plain}")
        if not ok:
            failures.append(f"{what}: losses {latent}, without --q-latent {plain}, "
                            f"allowed relative difference {rel}")


def case_bf16(laga, scratch):
    def ok_run(args):
        p = run(laga, args, timeout=120)
        if p.returncode != 0:
            failures.append(f"laga {' '.join(args)}: exit {p.returncode}\n{p.stderr[-600:]}")
        return p.returncode == 0

    def read_json(path):
        with open(path) as f:
            return json.load(f)

    small = ["--preset", "tiny", "--batch", "2", "--seq", "23"]
    # One --dtype vocabulary on every command (add_dtype_option): fp32 =
    # float32, fp64 = float64; a word a command does not run is refused
    # naming where it runs, a word outside the vocabulary naming the choices.
    for cmd in ("compare", "verify", "forward", "train", "plan"):
        expect_error(laga, [cmd, "--dtype", "half"], "'half' is not a dtype; laga " + cmd + " runs")
    for cmd in ("compare", "train", "plan"):
        for word in ("fp64", "float64"):
            expect_error(laga, [cmd, "--dtype", word],
                         f"laga {cmd} runs bf16 or fp32 (float32), not fp64, which runs in "
                         "laga verify and laga forward" if cmd == "plan" else
                         f"laga {cmd} runs fp32 (float32) or bf16, not fp64, which runs in "
                         "laga verify and laga forward")
    spelled = os.path.join(scratch, "spelled.json")
    for args, key, want in (
            (["verify"] + small + ["--sp", "1,2", "--dtype", "fp64"], "dtype", "float64"),
            (["compare", "--quiet", "--count-only"] + small + ["--dtype", "float32"], "dtype",
             "f32"),
            (["plan", "--profile", "h100", "--preset", "tiny", "--seq", "64", "--sp", "2",
              "--quiet", "--dtype", "float32"], "dtype", "fp32")):
        if ok_run(args + ["--json", spelled]):
            got = read_json(spelled)[key]
            print(("ok:   " if got == want else "FAIL: ") + f"laga {' '.join(args)}: {key} {got!r}")
            if got != want:
                failures.append(f"laga {' '.join(args)}: {key} {got!r}, wanted {want!r}")
    verify = os.path.join(scratch, "verify.json")
    if not ok_run(["verify"] + small + ["--sp", "1,3", "--dtype", "bf16", "--json", verify]):
        return
    v = read_json(verify)
    checks = [(v["dtype"] == "bf16", f"verify JSON dtype {v['dtype']!r}"),
              (v["ok"], "verify --dtype bf16 within its bound"),
              # fp32's default; bf16's derived bound is of bf16's roundoff
              (v["tolerance"] > 1e-5, f"verify --dtype bf16 tolerance {v['tolerance']}")]
    compare = os.path.join(scratch, "compare.json")
    if not ok_run(["compare", "--quiet"] + small +
                  ["--sp", "3", "--steps", "1", "--warmup", "0", "--dtype", "bf16", "--json",
                   compare]):
        return
    c = read_json(compare)
    checks.append((c["dtype"] == "bf16" and c["element_bytes"] == 4 and
                   c["wire_element_bytes"] == {"activations": 2, "gradients": 4},
                   f"compare JSON dtype {c['dtype']!r}, element_bytes {c['element_bytes']}, "
                   f"wire_element_bytes {c['wire_element_bytes']}"))
    # bf16 on the wire (mla/wire.hpp): every activation label moves half
    # fp32's bytes, the gradient all-reduce the same.
    compare32 = os.path.join(scratch, "compare-fp32.json")
    if not ok_run(["compare", "--quiet", "--count-only"] + small + ["--sp", "3", "--json",
                                                                     compare32]):
        return
    c32 = read_json(compare32)
    fp32_bytes = {(f["form"], b["phase"], b["label"]): b["bytes_sent"]
                  for f in c32["forms"] for b in f["by_label"]}
    checks.append((c32["bf16_flash_isa"] is None and
                   not any(t["name"].startswith("bf16 ") for f in c32["forms"]
                           for t in f["predicted_live_at_peak"]),
                   "compare fp32: no bf16 flash isa, no bf16 tensor at any peak"))
    for f in c["forms"]:
        for b in f["by_label"]:
            want = fp32_bytes[(f["form"], b["phase"], b["label"])]
            if b["label"] != "grad_allreduce":
                want //= 2
            checks.append((b["bytes_sent"] == want,
                           f"compare bf16 {f['form']} {b['phase']}/{b['label']}: "
                           f"{b['bytes_sent']} bytes sent, fp32's {'' if b['label'] == 'grad_allreduce' else 'half '}is {want}"))
    # A bf16 attention call's scratch (its operands' copies and the bf16
    # flash workspace, mla/block.cpp) is a pool tensor: the pool equals the
    # model with it, and at these sizes explicit's peak is made at it.
    checks.append((c["bf16_flash_isa"] in ("fp32", "avx512_bf16"),
                   f"compare bf16: bf16_flash_isa {c['bf16_flash_isa']}"))
    for f in c["forms"]:
        checks.append((f["memory_match"], f"compare bf16 {f['form']}: memory_match"))
        if f["form"] == "explicit":
            checks.append((any(t["name"].startswith("bf16 attention scratch")
                               for t in f["predicted_live_at_peak"]),
                           f"compare bf16 explicit: the bf16 attention scratch live at the "
                           f"peak ({f['predicted_peak_at']})"))
    beyond_fp32 = False
    for f in c["forms"][1:]:
        d = f["max_abs_diff"]
        for q in ("out", "dx", "grad"):
            checks.append((d[q] <= v["tolerance"] * d[q + "_scale"],
                           f"compare bf16 {f['form']} {q}: {d[q]} against scale {d[q + '_scale']}"))
            beyond_fp32 = beyond_fp32 or d[q] > 1e-5 * d[q + "_scale"]
        checks.append((f["bytes_match"] and f["memory_match"],
                       f"compare bf16 {f['form']}: the ledger is the bf16 wire's closed form and "
                       "the pool the memory model"))
    checks.append((beyond_fp32, "compare --dtype bf16: every form within fp32's 1e-5 of explicit; "
                   "did bf16 run?"))
    # --grad-reduce bf16: the gradient all-reduce on the wire as bf16 too.
    compare_rb = os.path.join(scratch, "compare-grad-reduce.json")
    if not ok_run(["compare", "--quiet", "--count-only"] + small +
                  ["--sp", "3", "--dtype", "bf16", "--grad-reduce", "bf16", "--json", compare_rb]):
        return
    rb = read_json(compare_rb)
    checks.append((rb["wire_element_bytes"] == {"activations": 2, "gradients": 2},
                   f"compare --grad-reduce bf16 wire_element_bytes {rb['wire_element_bytes']}"))
    for f in rb["forms"]:
        checks.append((f["bytes_match"], f"compare --grad-reduce bf16 {f['form']}: closed form"))
        for b in f["by_label"]:
            want = fp32_bytes[(f["form"], b["phase"], b["label"])] // 2
            checks.append((b["bytes_sent"] == want,
                           f"compare --grad-reduce bf16 {f['form']} {b['label']}: "
                           f"{b['bytes_sent']} bytes, half fp32's is {want}"))
    for cmd in ("compare", "train"):
        expect_error(laga, [cmd, "--grad-reduce", "bf16", "--attention", "flash"],
                     "--grad-reduce bf16 needs --dtype bf16")
    expect_error(laga, ["plan", "--grad-reduce", "bf16", "--dtype", "fp32", "--profile", "h100"],
                 "--grad-reduce bf16 needs --dtype bf16")
    out = os.path.join(scratch, "forward.safetensors")
    if not ok_run(["forward"] + small + ["--sp", "2", "--form", "laga", "--dtype", "bf16",
                                         "--output", out]):
        return
    with open(out, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    checks.append((header["__metadata__"]["dtype"] == "bf16",
                   f"forward's file metadata dtype {header['__metadata__'].get('dtype')!r}"))
    # train: the same seed's first step in fp32 and in bf16, from the same
    # fp32 master weights. The losses differ (bf16 ran) by less than the
    # block's own bound on its output, 10 u (mla/ops_bf16.hpp): the loss is
    # a log-sum-exp of logits no worse rounded than a block's output.
    losses = {}
    for dtype in ("fp32", "bf16"):
        log = os.path.join(scratch, f"train-{dtype}.jsonl")
        if not ok_run(TRAIN + ["--attention", "flash", "--sp", "2", "--dtype", dtype,
                               "--log", log]):
            return
        with open(log) as f:
            losses[dtype] = json.loads(f.readline())["loss"]
    rel = abs(losses["bf16"] - losses["fp32"]) / abs(losses["fp32"])
    checks.append((0 < rel < 10 / 256, f"train --dtype bf16 step 1 loss {losses['bf16']} against "
                   f"fp32's {losses['fp32']} (relative {rel:.2e}; 0 < it < 10 u)"))
    for good, what in checks:
        print(("ok:   " if good else "FAIL: ") + what)
        if not good:
            failures.append(what)


def main():
    laga, scratch, case = sys.argv[1], sys.argv[2], sys.argv[3]
    scratch = os.path.join(scratch, "cli_options_" + case)
    os.makedirs(scratch, exist_ok=True)
    {"options": case_options, "messages": case_messages, "nonfinite": case_nonfinite,
     "memory": case_memory, "q_latent": case_q_latent, "bf16": case_bf16}[case](laga, scratch)
    if failures:
        sys.exit(f"{len(failures)} failed:\n" + "\n".join(failures))
    print("all ok")


if __name__ == "__main__":
    main()
