#!/usr/bin/env python3
"""End-to-end checks of laga train's file safety, interrupts and non-finite values
(issue 10).

    test_train_cli.py LAGA_BINARY SCRATCH_DIR CASE [POISON_HELPER]

Cases:
  signals    `laga train` as a subprocess: SIGINT after a step exits 130 after
             finishing the step, with a checkpoint of that step and a log with
             every step once; a resume then SIGTERM exits 143 the same way; a
             second SIGINT during the step exits 130 at once, saying so, with
             no checkpoint
  log        kill -9 mid-run leaves log lines after the last checkpoint; the
             resume cuts the log back to the checkpoint's step (every step
             once) and its save removes a stale temporary of laga's naming,
             keeping a look-alike that is not laga's
  outputs    --output/--log/--json that are an input (by path and through a
             symlink), a FIFO, a link to /dev/null or a directory are refused
             with exit 2 and left as they were; a symlink output writes its
             target and keeps the link
  diverged   --lr 1e30 overflows the backward at step 2 (a finite loss, a NaN
             gradient): the run stops before that step's update, exit 2,
             naming the step and the tensor; no checkpoint of step 2 exists,
             and step 1's (latest.json) is all finite; --allow-nonfinite
             trains on with a warning
  nonfinite  a checkpoint holding NaN/inf (written by the helper POISON_HELPER
             as a diverged run would have saved it: sizes and hashes right)
             is refused at resume, naming the tensor, the count and the
             previous checkpoint; parameters and AdamW moments alike;
             --allow-nonfinite loads it with a warning
  save_signal  a SIGTERM while a periodic save is written stops the run with
             that save (exit 143, latest.json and the log end at its step)
  checkpoint_names  --log (and inputs) in a name the checkpoint directory
             owns (its lock, latest.json, step-N.*, temporaries, superseded
             folders), under any spelling, are refused up front (issue 54 G)
  weights_outputs  forward --output that is any file of the --weights set
             (index, shards, a listed shard that is missing, a directory's one
             file), or an output that is the laga executable, is refused
             (issue 54 A)
  lock       a second run (fresh or resumed) into a directory a live run
             writes is refused naming its pid; the lock goes with the run
  moe_config `--config docs/assets/moe_tiny.json` (an MoE model, issue 28):
             the loss falls at --sp 2, the checkpoint holds the MoE layers'
             tensors (gate, bias, experts, shared) and the dense layer's, the
             biases moved by multiples of bias_update_speed; resume continues
             (also with --expert-parallel) and refuses a changed MoE; bad
             configs, --config beside a model option and --expert-parallel on
             a dense model are refused naming the field
Only the standard library.
"""
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time

TINY = ["--d-model", "32", "--heads", "4", "--layers", "1", "--vocab", "64", "--seq", "16",
        "--quiet"]
# A step long enough (about 4 s on a shared 2-core machine) that the second
# signal lands within the step the first one interrupted.
SLOW = ["--d-model", "256", "--heads", "8", "--layers", "4", "--vocab", "512", "--seq", "512",
        "--quiet"]


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)


def run(laga, args, expect_rc, timeout=300):
    p = subprocess.run([laga] + args, capture_output=True, text=True, timeout=timeout)
    check(p.returncode == expect_rc,
          f"laga {' '.join(args)}: exit {p.returncode}, wanted {expect_rc}\nstderr:\n{p.stderr}")
    return p


def log_steps(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def latest_step(ck):
    with open(os.path.join(ck, "latest.json")) as f:
        return json.load(f)["step"]


def start(laga, args):
    return subprocess.Popen([laga] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def freeze(proc, timeout=10):
    """SIGSTOP, then wait until every thread has stopped: the signal is
    delivered asynchronously, and a thread still running could write a log
    line or a checkpoint after the caller has read them."""
    proc.send_signal(signal.SIGSTOP)
    task = f"/proc/{proc.pid}/task"
    end = time.time() + timeout
    while time.time() < end:
        states = []
        for tid in os.listdir(task):
            try:
                with open(os.path.join(task, tid, "stat")) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.001)
    sys.exit(f"FAILED: laga (pid {proc.pid}) did not stop within {timeout} s of SIGSTOP")


def wait_for_lines(proc, log, n, timeout=240):
    end = time.time() + timeout
    while len(log_steps(log)) < n:
        if proc.poll() is not None:
            sys.exit(f"FAILED: laga ended (exit {proc.returncode}) before logging {n} steps:\n"
                     + (proc.stderr.read() if proc.stderr else ""))
        if time.time() > end:
            proc.kill()
            sys.exit(f"FAILED: no {n} log lines within {timeout} s")
        time.sleep(0.02)


def finish(proc, timeout=120):
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        sys.exit("FAILED: laga did not exit after the signal")
    return proc.returncode, err


def case_signals(laga, scratch):
    ck, log = os.path.join(scratch, "ck"), os.path.join(scratch, "log.jsonl")
    p = start(laga, ["train"] + TINY + ["--steps", "1000000", "--checkpoint", ck, "--log", log])
    wait_for_lines(p, log, 2)
    p.send_signal(signal.SIGINT)
    rc, err = finish(p)
    check(rc == 130, f"SIGINT: exit {rc}, wanted 130\n{err}")
    n = latest_step(ck)
    check(f"stopped by SIGINT after step {n} of 1000000" in err, "SIGINT message:\n" + err)
    check(os.path.exists(os.path.join(ck, f"step-{n:08d}.safetensors")), "checkpoint file")
    check(log_steps(log) == list(range(1, n + 1)), f"log after SIGINT: {log_steps(log)}, ckpt {n}")

    p = start(laga, ["train"] + TINY + ["--steps", "1000000", "--resume", ck, "--checkpoint", ck,
                                        "--log", log])
    wait_for_lines(p, log, n + 2)
    p.send_signal(signal.SIGTERM)
    rc, err = finish(p)
    check(rc == 143, f"SIGTERM: exit {rc}, wanted 143\n{err}")
    m = latest_step(ck)
    check(m >= n + 2 and f"stopped by SIGTERM after step {m}" in err, "SIGTERM message:\n" + err)
    check(log_steps(log) == list(range(1, m + 1)), f"log after SIGTERM: {log_steps(log)}, ckpt {m}")

    # Two signals within one step: out at once, nothing saved.
    ck2, log2 = os.path.join(scratch, "ck2"), os.path.join(scratch, "log2.jsonl")
    # stderr to a file, read while it runs: the second signal goes only once
    # the first was handled (two pending SIGINTs would merge into one).
    err_path = os.path.join(scratch, "double.err")
    with open(err_path, "w") as err_file:
        p = subprocess.Popen([laga, "train"] + SLOW + ["--steps", "1000000", "--checkpoint", ck2,
                                                       "--log", log2],
                             stdout=subprocess.DEVNULL, stderr=err_file)
    wait_for_lines(p, log2, 1)
    p.send_signal(signal.SIGINT)
    end = time.time() + 60
    while "signal received" not in read(err_path).decode():
        check(time.time() < end and p.poll() is None, "the first SIGINT was not acknowledged")
        time.sleep(0.001)
    p.send_signal(signal.SIGINT)
    try:
        rc = p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        sys.exit("FAILED: laga did not exit after the second signal")
    err = read(err_path).decode()
    check(rc == 130, f"double SIGINT: exit {rc}, wanted 130\n{err}")
    check("second signal: stopping at once" in err, "double SIGINT message:\n" + err)
    check(not os.path.exists(os.path.join(ck2, "latest.json")), "nothing saved after two signals")


# A checkpoint of some 40 MB: its save takes long enough to be caught.
MID = ["--d-model", "256", "--heads", "8", "--layers", "4", "--vocab", "512", "--seq", "32",
       "--quiet"]


def saves_in_progress(ck):
    """Steps whose save has a temporary in ck (write_file_atomic's .tmp.)."""
    try:
        names = os.listdir(ck)
    except FileNotFoundError:
        return []
    return [int(n[5:13]) for n in names
            if n.startswith("step-") and ".tmp." in n and n[5:13].isdigit()]


def case_save_signal(laga, scratch):
    # Issue 26 item 12: a SIGTERM that arrives while a periodic save is being
    # written stops the run with that save. Today's main trains one more step
    # and saves again (the extra save is what a preemption's grace period
    # kills). The process is frozen (SIGSTOP) while a temporary of the save
    # exists, so the signal surely lands inside the save.
    ck, log = os.path.join(scratch, "ck"), os.path.join(scratch, "log.jsonl")
    p = start(laga, ["train"] + MID + ["--steps", "1000000", "--save-every", "2",
                                       "--checkpoint", ck, "--log", log])
    end, saving = time.time() + 240, None
    while saving is None:
        check(time.time() < end and p.poll() is None, "no save was caught in progress")
        if not saves_in_progress(ck):
            continue
        p.send_signal(signal.SIGSTOP)
        steps = saves_in_progress(ck)
        if steps:
            saving = steps[0]
            p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
    rc, err = finish(p)
    check(rc == 143, f"SIGTERM during a save: exit {rc}, wanted 143\n{err}")
    check(latest_step(ck) == saving and f"stopped by SIGTERM after step {saving} " in err,
          f"signalled during the save of step {saving}; latest.json names step "
          f"{latest_step(ck)}:\n{err}")
    check(log_steps(log) == list(range(1, saving + 1)), f"log: {log_steps(log)}, saved {saving}")


def case_lock(laga, scratch):
    # Issue 26 item 7: a second run in a directory another run writes is
    # refused naming the holder, fresh or resuming, and the first run's
    # checkpoints are untouched; the lock goes with the run.
    ck, log = os.path.join(scratch, "ck"), os.path.join(scratch, "log.jsonl")
    p = start(laga, ["train"] + TINY + ["--steps", "1000000", "--save-every", "2",
                                        "--checkpoint", ck, "--log", log])
    wait_for_lines(p, log, 3)
    for extra in ([], ["--resume", ck]):
        q = run(laga, ["train"] + TINY + ["--steps", "2000000", "--checkpoint", ck] + extra, 2)
        check(f"is in use: its lock '{ck}/laga.lock' names pid {p.pid}" in q.stderr
              and "which is running" in q.stderr, f"second writer {extra}:\n{q.stderr}")
    p.send_signal(signal.SIGINT)
    rc, err = finish(p)
    check(rc == 130, f"the first run: exit {rc}\n{err}")
    n = latest_step(ck)
    check(log_steps(log) == list(range(1, n + 1)), f"log {log_steps(log)}, checkpoint {n}")
    check(not os.path.exists(os.path.join(ck, "laga.lock")), "the lock outlived its run")
    run(laga, ["train"] + TINY + ["--steps", str(n + 1), "--checkpoint", ck, "--resume", ck], 0)


def case_log(laga, scratch):
    ck, log = os.path.join(scratch, "ck"), os.path.join(scratch, "log.jsonl")
    p = start(laga, ["train"] + TINY + ["--steps", "1000000", "--save-every", "3",
                                        "--checkpoint", ck, "--log", log])
    wait_for_lines(p, log, 8)
    # Freeze it (SIGSTOP, every thread stopped) until the log has run past
    # the last checkpoint, so the kill always leaves steps to be logged
    # again; then SIGKILL: no handler runs. Wherever it stops, the log is
    # never behind the checkpoint: a step is logged before it is saved, so
    # a kill can never leave a checkpointed step without its line.
    for _ in range(1000):
        freeze(p)
        logged, k = len(log_steps(log)), latest_step(ck)
        if logged < k:
            p.kill()
            check(False, f"stopped with the log behind the checkpoint: {logged} lines, step {k}")
        if logged > k:
            break
        p.send_signal(signal.SIGCONT)
        time.sleep(0.003)
    p.kill()
    p.wait()
    k = latest_step(ck)
    logged = log_steps(log)
    check(k % 3 == 0 and len(logged) > k, f"after kill -9: checkpoint {k}, log {logged}")
    # Stale temporaries as a killed save leaves them, by a pid that is gone;
    # and a file of another naming that must stay.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(ck, f"step-{k + 3:08d}.safetensors.tmp.{dead.pid}.0")
    other = os.path.join(ck, f"notes.txt.tmp.{dead.pid}.0")
    for path in (stale, other):
        with open(path, "w") as f:
            f.write("x" * 100)
    run(laga, ["train"] + TINY + ["--steps", str(k + 5), "--resume", ck, "--checkpoint", ck,
                                  "--log", log], 0)
    check(log_steps(log) == list(range(1, k + 6)), f"log after resume: {log_steps(log)}")
    check(not os.path.exists(stale), "a stale laga temporary survived the next save")
    check(os.path.exists(other), "a file not of laga's naming was removed")
    check(latest_step(ck) == k + 5, "final checkpoint")
    # A log the filesystem stops taking (a full disk; here a 2 KiB file-size
    # limit, SIGXFSZ ignored so the write fails with EFBIG): named once, the
    # run finishes and exits 1, never 0 with the log cut mid-line (issue 26).
    full = os.path.join(scratch, "full.jsonl")

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    loud = [a for a in TINY if a != "--quiet"]  # its step lines show how far it went
    p = subprocess.run([laga, "train"] + loud + ["--steps", "40", "--log", full],
                       capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    warned = [l for l in p.stderr.splitlines() if "--log '" + full + "': writing step" in l]
    check(p.returncode == 1 and len(warned) == 1,
          f"a log that cannot be written: exit {p.returncode}, warnings {warned}:\n"
          f"{p.stderr[-800:]}")
    check("step 40/40" in p.stderr, "the run went on to its last step after the log failed")


def write_safetensors(path, name, shape):
    n = 1
    for d in shape:
        n *= d
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * n]}})
    header += " " * ((8 - len(header) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.write(struct.pack(f"<{n}f", *[(i % 7) * 0.1 for i in range(n)]))


def read(path):
    with open(path, "rb") as f:
        return f.read()


def refused(laga, args, words):
    p = run(laga, args, 2, timeout=60)
    for w in words:
        check(w in p.stderr, f"laga {' '.join(args)}: message lacks '{w}':\n{p.stderr}")


def case_outputs(laga, scratch):
    x = os.path.join(scratch, "x.safetensors")
    write_safetensors(x, "x", [1, 8, 48])  # preset tiny: D = 48
    original = read(x)
    fwd = ["forward", "--preset", "tiny", "--input", x]
    refused(laga, fwd + ["--output", x], ["same file as the --input file", x])
    link_x = os.path.join(scratch, "link_to_x")
    os.symlink(x, link_x)
    refused(laga, fwd + ["--output", link_x], ["same file as the --input file"])
    check(read(x) == original and os.path.islink(link_x), "the input survives")

    fifo = os.path.join(scratch, "fifo")
    os.mkfifo(fifo)
    refused(laga, fwd + ["--output", fifo], ["--output", "FIFO"])
    check(os.path.exists(fifo) and not os.path.isfile(fifo), "the FIFO stays a FIFO")
    null_link = os.path.join(scratch, "null_link")
    os.symlink("/dev/null", null_link)
    refused(laga, fwd + ["--output", null_link], ["character device"])
    check(os.path.islink(null_link), "the link to /dev/null stays")
    refused(laga, fwd + ["--output", scratch], ["directory"])

    out, out_link = os.path.join(scratch, "out.safetensors"), os.path.join(scratch, "out_link")
    os.symlink("out.safetensors", out_link)
    run(laga, fwd + ["--output", out_link], 0)
    check(os.path.islink(out_link) and os.path.isfile(out) and os.path.getsize(out) > 100,
          "a symlink output writes its target and keeps the link")

    data = os.path.join(scratch, "tokens.bin")
    with open(data, "wb") as f:
        f.write(struct.pack("<1000H", *[(i * 7) % 64 for i in range(1000)]))
    tokens = read(data)
    tr = ["train"] + TINY + ["--steps", "2", "--data", data]
    refused(laga, tr + ["--log", data], ["--log", "same file as the --data file", data])
    check(read(data) == tokens, "the token file survives")
    refused(laga, tr + ["--log", fifo], ["--log", "FIFO"])
    ck = os.path.join(scratch, "ck")
    run(laga, tr + ["--checkpoint", ck], 0)
    manifest = os.path.join(ck, "step-00000002.json")
    before = read(manifest)
    refused(laga, tr[:-4] + ["--steps", "3", "--data", data, "--resume", manifest, "--log",
                             manifest], ["same file as the --resume manifest"])
    check(read(manifest) == before, "the resumed manifest survives")
    log, log_link = os.path.join(scratch, "real.jsonl"), os.path.join(scratch, "log_link")
    os.symlink(log, log_link)
    run(laga, tr + ["--log", log_link], 0)
    check(os.path.islink(log_link) and len(read(log).splitlines()) == 2, "--log through a link")

    cfg = os.path.join(scratch, "tiny.json")
    with open(cfg, "w") as f:
        json.dump({"dim": 48, "n_heads": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
                   "qk_rope_head_dim": 4, "v_head_dim": 6}, f)
    cfg_text = read(cfg)
    refused(laga, ["compare", "--quiet", "--config", cfg, "--seq", "8", "--steps", "1",
                   "--json", cfg], ["same file as the --config file"])
    check(read(cfg) == cfg_text, "the config survives")


def case_checkpoint_names(laga, scratch):
    """Issue 54 G: no file of a run may take a name its checkpoint directory
    owns (laga.lock, latest.json, step-N.*, their temporaries, the
    superseded-after-* folders), under any spelling; refused before anything
    is written, naming both. Today's main wrote the log over the lock (a
    resume is then refused) or lost it under latest.json, exit 0."""
    os.chdir(scratch)  # relative spellings, as a user types them
    tr = ["train"] + TINY + ["--steps", "2"]
    words = ["--log '", "a name the --checkpoint directory 'ck' owns"]
    os.makedirs("sub")
    os.symlink("ck", "cklink")  # dangling until ck exists
    for name in ["laga.lock", "latest.json", "step-00000002.json", "step-00000002.safetensors",
                 "step-2.json", "step-00000004.json.tmp.123.0", "laga.lock.tmp.1.2",
                 "superseded-after-step-00000002/log.jsonl"]:
        refused(laga, tr + ["--checkpoint", "ck", "--log", "ck/" + name], words)
        check(not os.path.exists("ck"), f"--log ck/{name}: refused before the lock was made")
    for log in ["sub/../ck/latest.json", "./ck//./laga.lock", "cklink/laga.lock"]:
        refused(laga, tr + ["--checkpoint", "ck", "--log", log], ["--log '" + log + "'", "owns"])
    refused(laga, tr + ["--checkpoint", "cklink/", "--log", "ck/laga.lock"], ["owns"])
    os.symlink("sub/../cklink/step-00000002.json", "loglink")
    refused(laga, tr + ["--checkpoint", "ck", "--log", "loglink"], ["--log 'loglink'", "owns"])
    # A log beside the checkpoints under a name of its own is fine.
    run(laga, tr + ["--checkpoint", "ck", "--log", "ck/train.jsonl"], 0)
    check(log_steps("ck/train.jsonl") == [1, 2], "a log beside the checkpoints")
    kept = {n: read(os.path.join("ck", n)) for n in os.listdir("ck")}
    res = ["train"] + TINY + ["--steps", "3", "--resume", "ck"]
    os.link("ck/latest.json", "hard.json")
    for log in ["ck/step-00000002.safetensors", "ck/laga.lock", "ck/step-00000002.json.tmp.9.9"]:
        refused(laga, res + ["--checkpoint", "ck", "--log", log], ["--log '" + log + "'", "owns"])
    for log in ["ck/latest.json", "hard.json"]:  # the manifest resumed from, named as that
        refused(laga, res + ["--checkpoint", "ck", "--log", log],
                ["--log '" + log + "'", "same file as the --resume manifest"])
    # The directory resumed from, when another is written: its checkpoints
    # are the user's too.
    refused(laga, res + ["--checkpoint", "ck2", "--log", "ck/step-00000002.json"],
            ["a name the --resume directory 'ck' owns"])
    # An input there: the run writes, moves and prunes those names.
    with open("tokens.bin", "wb") as f:
        f.write(struct.pack("<1000H", *[(i * 7) % 64 for i in range(1000)]))
    shutil.copy("tokens.bin", "ck/step-00000001.safetensors")
    refused(laga, res + ["--checkpoint", "ck", "--data", "ck/step-00000001.safetensors"],
            ["--data 'ck/step-00000001.safetensors'", "--checkpoint directory 'ck' owns"])
    os.remove("ck/step-00000001.safetensors")
    check({n: read(os.path.join("ck", n)) for n in os.listdir("ck")} == kept,
          "every refused run left the checkpoint directory as it was")
    run(laga, res + ["--checkpoint", "ck", "--log", "ck/train.jsonl"], 0)
    check(latest_step("ck") == 3 and log_steps("ck/train.jsonl") == [1, 2, 3], "the resume")


def write_tensors(path, tensors):
    """tensors: name -> (dtype, shape, bytes)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header)
    text += " " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode())
        for _, _, data in tensors.values():
            f.write(data)


def read_tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        body = f.read()
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def case_weights_outputs(laga, scratch):
    """Issue 54 A: forward's --output may be no file of the --weights set (the
    index and every shard it lists, read or not; a directory's one file), by
    path, `..`, symlink or hard link. Today's main protected only the path
    given to --weights: it wrote the output over a shard, exit 0."""
    os.chdir(scratch)
    fwd = ["forward", "--preset", "tiny", "--seq", "8"]
    # Weights of preset tiny's shapes: the gradients of a forward, renamed.
    run(laga, fwd + ["--backward", "--output", "g.safetensors"], 0)
    grads = {k[5:]: v for k, v in read_tensors("g.safetensors").items() if k.startswith("grad.")}
    names = sorted(grads)
    check(len(names) >= 4, f"weights of preset tiny: {names}")
    os.makedirs("ck")
    half = len(names) // 2
    shards = {"model-1.safetensors": names[:half], "model-2.safetensors": names[half:]}
    for shard, held in shards.items():
        write_tensors(os.path.join("ck", shard), {n: grads[n] for n in held})
    # A shard this forward never opens: another layer's tensor.
    write_tensors("ck/model-3.safetensors", {"layers.9.other": ("F32", [2], b"\0" * 8)})
    weight_map = {n: s for s, held in shards.items() for n in held}
    weight_map["layers.9.other"] = "model-3.safetensors"
    weight_map["layers.8.other"] = "model-4.safetensors"  # listed, not downloaded
    with open("ck/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    files = {n: read(os.path.join("ck", n)) for n in os.listdir("ck")}
    run(laga, fwd + ["--weights", "ck", "--output", "out.safetensors"], 0)  # it loads
    os.makedirs("sub")
    os.symlink("ck/model-2.safetensors", "shard_link")
    os.link("ck/model-1.safetensors", "shard_hard")
    os.symlink("ck", "cklink")
    for weights in ["ck", "ck/model.safetensors.index.json", "cklink/"]:
        for out in ["ck/model-1.safetensors", "ck/model-2.safetensors", "ck/model-3.safetensors",
                    "ck/model.safetensors.index.json", "sub/../ck/./model-2.safetensors",
                    "cklink/model-1.safetensors", "shard_link", "shard_hard"]:
            refused(laga, fwd + ["--weights", weights, "--output", out],
                    ["refusing to write --output '" + out + "'", "--weights"])
    check({n: read(os.path.join("ck", n)) for n in os.listdir("ck")} == files,
          "every shard and the index survive")
    # A shard the index lists but that is missing is not created either.
    refused(laga, fwd + ["--weights", "ck", "--output", "cklink/model-4.safetensors"],
            ["--weights shard", "model-4.safetensors", "missing now"])
    check(not os.path.exists("ck/model-4.safetensors"), "no file poses as the missing shard")
    # A directory of one file: that file.
    os.makedirs("one")
    shutil.copy("out.safetensors", "one/w.safetensors")
    write_tensors("one/w.safetensors", grads)
    one = read("one/w.safetensors")
    refused(laga, fwd + ["--weights", "one", "--output", "one/w.safetensors"],
            ["same file as the --weights file"])
    check(read("one/w.safetensors") == one, "a directory's one file survives")
    # The running executable is read too.
    shutil.copy(laga, "laga_copy")
    exe = read("laga_copy")
    refused(os.path.abspath("laga_copy"), ["forms", "--json", "laga_copy"],
            ["same file as the laga executable"])
    check(read("laga_copy") == exe, "the executable survives")


def nonfinite_tensors(path):
    """The names of the F32 tensors of a safetensors file holding NaN or inf."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    bad = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", info
        begin, end = info["data_offsets"]
        values = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
        if not all(math.isfinite(v) for v in values):
            bad.append(name)
    return bad


def case_diverged(laga, scratch):
    ck = os.path.join(scratch, "ck")
    args = ["train"] + TINY + ["--steps", "4", "--lr", "1e30", "--save-every", "1"]
    p = run(laga, args + ["--checkpoint", ck], 2)
    for needle in ["at step 2", "the step was not applied (the weights are those after step 1)",
                   "no checkpoint of it was written", "--allow-nonfinite"]:
        check(needle in p.stderr, f"no '{needle}' in:\n{p.stderr}")
    if "the gradient at step 2 is not finite" in p.stderr:
        check("the gradient of '" in p.stderr and "non-finite value" in p.stderr,
              f"the gradient's tensor and count are not named:\n{p.stderr}")
    check(sorted(os.listdir(ck)) == ["latest.json", "step-00000001.json",
                                     "step-00000001.safetensors"],
          f"the checkpoint directory holds {sorted(os.listdir(ck))}")
    check(latest_step(ck) == 1, "latest.json is not step 1's")
    # Step 1's checkpoint holds the weights step 2 started from: all finite
    # (huge: lr 1e30 moved them by about 1e30, which is what overflows).
    bad = nonfinite_tensors(os.path.join(ck, "step-00000001.safetensors"))
    check(not bad, f"step 1's checkpoint holds non-finite values in {bad}")
    # Allowed, the run goes on through the non-finite steps, warning.
    p = run(laga, args + ["--checkpoint", os.path.join(scratch, "allowed"),
                          "--allow-nonfinite"], 0)
    check("laga train: warning:" in p.stderr and "at step 2" in p.stderr,
          f"no warning for step 2 in:\n{p.stderr}")


def case_nonfinite(laga, scratch, poison):
    ck = os.path.join(scratch, "ck")
    run(laga, ["train"] + TINY + ["--steps", "2", "--save-every", "1", "--checkpoint", ck], 0)
    pristine = os.path.join(scratch, "pristine")
    shutil.copytree(ck, pristine)
    resume = ["train"] + TINY + ["--steps", "4", "--resume", ck, "--checkpoint", ck]
    for tensor, index, value, count in [("param.layers.0.ffn.w1.weight", 3, "nan", 1),
                                        ("adam_m.head.weight", 0, "inf", 1),
                                        ("adam_v.embed.weight", 5, "-inf", 1)]:
        shutil.rmtree(ck)
        shutil.copytree(pristine, ck)
        subprocess.run([poison, ck, tensor, str(index), value], check=True)
        t0 = time.monotonic()
        p = run(laga, resume, 2)
        secs = time.monotonic() - t0
        for needle in [f"tensor '{tensor}' holds {count} non-finite value",
                       f"the first at flat index {index} of",
                       "--resume " + os.path.join(ck, "step-00000001.json"),
                       "--allow-nonfinite"]:
            check(needle in p.stderr, f"{tensor} = {value}: no '{needle}' in:\n{p.stderr}")
        check(not os.path.exists(os.path.join(ck, "step-00000003.json")),
              f"{tensor} = {value}: a step after the refused checkpoint was saved")
        check(secs < 10, f"the refusal took {secs:.1f} s")
    # Allowed: it loads, says so, and trains on (the NaN then fills the loss,
    # which --allow-nonfinite lets through with a warning per step).
    p = run(laga, resume + ["--allow-nonfinite"], 0)
    check("laga train: warning: checkpoint" in p.stderr and "adam_v.embed.weight" in p.stderr
          and "loaded anyway" in p.stderr, f"no load warning in:\n{p.stderr}")
    # The untouched checkpoint resumes without a word about it.
    shutil.rmtree(ck)
    shutil.copytree(pristine, ck)
    p = run(laga, resume, 0)
    check("non-finite" not in p.stderr, f"a finite checkpoint was reported:\n{p.stderr}")


def safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        return header, f.read()


def case_moe_config(laga, scratch):
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                          "assets", "moe_tiny.json")
    ck, log = os.path.join(scratch, "ck"), os.path.join(scratch, "log.jsonl")
    args = ["train", "--config", config, "--seq", "32", "--batch", "2", "--lr", "3e-3", "--sp",
            "2", "--quiet", "--checkpoint", ck, "--log", log]
    p = run(laga, args + ["--steps", "12"], 0)
    check("moe[E=8 k=2 I=32 shared=1 groups=1/2" in p.stderr, "summary names the MoE:\n" + p.stderr)
    with open(log) as f:
        losses = [json.loads(line)["loss"] for line in f]
    check(len(losses) == 12 and losses[-1] < losses[0] - 1.0, f"loss falls: {losses}")
    header, data = safetensors_header(os.path.join(ck, "step-00000012.safetensors"))
    for l in ("1", "2"):
        for n in ("gate.weight", "gate.bias", "experts.0.w1.weight", "experts.7.w2.weight",
                  "shared_experts.w3.weight"):
            check(f"param.layers.{l}.ffn.{n}" in header, f"checkpoint holds layers.{l}.ffn.{n}")
        check(f"param.layers.{l}.ffn.w1.weight" not in header, f"layer {l} has no dense FFN")
    check("param.layers.0.ffn.w1.weight" in header, "layer 0 keeps the dense FFN")
    info = header["param.layers.2.ffn.gate.bias"]
    begin, end = info["data_offsets"]
    bias = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
    steps = [abs(b) / 0.001 for b in bias]
    check(any(b != 0 for b in bias) and all(abs(q - round(q)) < 1e-3 and round(q) <= 12 for q in steps),
          f"the bias moves by multiples of bias_update_speed 0.001: {bias}")
    p = run(laga, args + ["--steps", "14", "--resume", ck], 0)
    check(log_steps(log) == list(range(1, 15)), f"resumed log: {log_steps(log)}")
    with open(config) as f:
        base = json.load(f)

    def variant(name, **changes):
        path = os.path.join(scratch, name + ".json")
        j = dict(base)
        for k, v in changes.items():
            if v is None:
                del j[k]
            else:
                j[k] = v
        with open(path, "w") as f:
            json.dump(j, f)
        return path

    other = variant("other_k", num_experts_per_tok=3)
    refused(laga, ["train", "--config", other, "--seq", "32", "--batch", "2", "--lr", "3e-3",
                   "--sp", "2", "--quiet", "--steps", "16", "--resume", ck],
            ["model num_experts_per_tok: 2 -> 3"])
    # The experts folded onto the ranks: free to change on resume (the same
    # math, rounded differently); a dense model has none to fold.
    run(laga, args + ["--steps", "15", "--resume", ck, "--expert-parallel"], 0)
    check(log_steps(log) == list(range(1, 16)), f"resumed log with EP: {log_steps(log)}")
    refused(laga, ["train", "--layers", "1", "--d-model", "16", "--heads", "2", "--steps", "1",
                   "--expert-parallel"], ["--expert-parallel needs an MoE model"])
    # EP groups (--ep N): a divisor of --sp, with --expert-parallel.
    refused(laga, ["train", "--config", config, "--sp", "2", "--steps", "1", "--expert-parallel",
                   "--ep", "3"], ["--ep 3 must divide --sp 2", "give --ep a divisor of 2"])
    refused(laga, ["train", "--config", config, "--sp", "2", "--steps", "1", "--ep", "2"],
            ["--ep 2 sets the expert-parallel degree; add --expert-parallel"])
    refused(laga, ["train", "--config", config, "--layers", "2", "--steps", "1"],
            ["laga: error: --config", "drop --layers"])
    refused(laga, ["train", "--config", variant("groups", n_group=3), "--steps", "1"],
            ["laga: error: config", "n_routed_experts 8 is not a multiple of n_group"])
    refused(laga, ["train", "--config", variant("speed", bias_update_speed=-1), "--steps", "1"],
            ["laga: error: config", "bias_update_speed must be finite and >= 0"])
    refused(laga, ["train", "--config", variant("layers", num_hidden_layers=None), "--steps", "1"],
            ["laga: error: config", "missing 'num_hidden_layers'"])
    refused(laga, ["train", "--config", variant("ffn", intermediate_size=None), "--steps", "1"],
            ["laga: error: config", "missing 'intermediate_size'"])
    # With no dense layer the dense width is not needed.
    run(laga, ["train", "--config", variant("all_moe", intermediate_size=None,
                                            first_k_dense_replace=0),
               "--seq", "16", "--steps", "2", "--quiet"], 0)


def case_seq_layout(laga, scratch):
    """--seq-layout zigzag moves which rank computes a token, not what is
    computed: every form's loss curve on zigzag shards equals the contiguous
    one within fp32 summation-order noise (1e-5 relative), the MoE's experts
    folded onto the ranks too, and the header names the layout."""
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                          "assets", "moe_tiny.json")
    for form in ("laga", "ring_kv", "ring_latent", "allgather_kv"):
        curves = {}
        for layout in ("contiguous", "zigzag"):
            log = os.path.join(scratch, f"{form}_{layout}.jsonl")
            p = run(laga, ["train", "--config", config, "--seq", "30", "--batch", "2", "--sp", "3",
                           "--steps", "5", "--form", form, "--attention", "flash",
                           "--expert-parallel", "--seq-layout", layout, "--log", log], 0)
            if layout == "zigzag":
                check("seq layout zigzag" in p.stderr, "the header names the layout:\n" + p.stderr)
            with open(log) as f:
                curves[layout] = [json.loads(line)["loss"] for line in f]
        a, b = curves["contiguous"], curves["zigzag"]
        check(len(a) == 5 and len(b) == 5, f"{form}: five steps each: {a} {b}")
        for x, y in zip(a, b):
            check(abs(x - y) <= 1e-5 * abs(x), f"{form}: contiguous {a} against zigzag {b}")


def main():
    laga, scratch, case = sys.argv[1], sys.argv[2], sys.argv[3]
    if os.sep in laga:
        laga = os.path.abspath(laga)  # some cases work in their scratch directory
    scratch = os.path.join(os.path.abspath(scratch), "train_cli_" + case)
    subprocess.run(["rm", "-rf", scratch], check=True)
    os.makedirs(scratch)
    if case == "nonfinite":
        case_nonfinite(laga, scratch, sys.argv[4])
    else:
        {"signals": case_signals, "log": case_log, "outputs": case_outputs,
         "diverged": case_diverged, "save_signal": case_save_signal,
         "lock": case_lock, "moe_config": case_moe_config,
         "checkpoint_names": case_checkpoint_names, "weights_outputs": case_weights_outputs,
         "seq_layout": case_seq_layout}[case](laga, scratch)
    print(f"train_cli {case}: OK")


if __name__ == "__main__":
    main()
