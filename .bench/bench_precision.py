"""Benchmark of train.py's --precision and --compile: not a test.

Steps/s of one training step (train.py's own objective, AdamW and autocast, one thread) in five
settings: fp32 with logits at every position (the ratios' baseline: the step before model.py's
`at`), fp32, bf16 (--precision bf16), fp32 --compile, bf16 --compile; for lstm-small on
hmm-small (batch 256) and the two-head pcfg-deep transformer (tf-small, 4 layers, 2 heads, batch
512). The settings are interleaved round by round so that the machine's load hits them alike;
medians, and ratios to the baseline. The achieved matmul FLOP/s is set against this machine's
fp32 and bf16 matmul peaks at the models' widths (bench_train.matmul_peak).

  python .bench/bench_precision.py                       # ~4 min on 2 cores
  python .bench/bench_precision.py --rounds 3 --no-compile
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import train  # noqa: E402
from bench_train import matmul_peak  # noqa: E402

MODELS = {
    "lstm-small": ["--batch", "256"],
    "tf 4L 2heads": ["--lang", "pcfg-deep", "--preset", "tf-small", "--n-layers", "4",
                     "--n-heads", "2", "--lr", "5e-3", "--batch", "512", "--schedule", "const"],
}


def step_flops(net, batch, T):
    """Matmul FLOPs of one step (backward = 2 x forward) with one masked word per sentence."""
    c = net.config
    if c.arch == "lstm":
        H, ins = c.lstm_hidden, [c.lstm_hidden] + [2 * c.lstm_hidden] * (c.n_layers - 1)
        per_token = sum(2 * 2 * 4 * H * (i + H) for i in ins)           # two directions
        return 3 * (per_token * batch * T + 2 * 2 * H * c.vocab_size * batch)
    d, L = c.d, c.n_layers
    per_token = L * (24 * d * d + 4 * T * d) - 16 * d * d              # last MLP: one row
    return 3 * (per_token * batch * T + 16 * d * d * batch + 2 * d * c.vocab_size * batch)


def make_step(argv, precision, compiled, every_position=False):
    """(one AdamW step of train.py at `precision`, maybe compiled; flops; seconds to warm up).
    every_position: the step as it was before model.py's `at` (logits at every position)."""
    args = train.parse_args(argv + ["--precision", precision])
    train.check_args(args)
    lang = data.build_language(args.lang, args.lang_seed)
    net = train.build_model(args, lang)
    opt = train.make_optimizer(net, args)
    objective = torch.compile(train.Objective(net)) if compiled else train.Objective(net)
    batches = [train.make_batch(lang, args, s, args.batch) for s in range(4)]
    device, k = torch.device("cpu"), [0]

    def step():
        inputs, targets = batches[k[0] % 4]
        k[0] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=train.bf16(args, device)):
            if every_position:
                total = train.mlm_loss(net(inputs), targets, lang.vocab_size)
            else:
                _, total, _ = train.training_objective(objective, inputs, targets,
                                                       lang.vocab_size, args)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
    t = time.perf_counter()
    for _ in range(3):
        step()
    return step, step_flops(net, args.batch, lang.max_len), time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    p.add_argument("--steps", type=int, default=20, help="steps timed per round and setting")
    p.add_argument("--no-compile", action="store_true", help="skip the --compile settings")
    args = p.parse_args()
    torch.set_num_threads(1)
    peaks = {(dt, n): statistics.median(matmul_peak(1, n, dtype=dt, m=4096) for _ in range(3))
             for dt in (torch.float32, torch.bfloat16) for n in (64, 128, 256)}
    print("matmul peak, one thread, [4096, n] x [n, n], GFLOP/s: " + "; ".join(
        f"n={n} fp32 {peaks[torch.float32, n]:.0f} bf16 {peaks[torch.bfloat16, n]:.0f}"
        for n in (64, 128, 256)) + f"; CPU bf16 units: {train.cpu_has_bf16()}")
    settings = [("fp32", False, True), ("fp32", False), ("bf16", False)] + (
        [] if args.no_compile else [("fp32", True), ("bf16", True)])
    for name, argv in MODELS.items():
        steps, warm = {}, {}
        for s in settings:
            steps[s], flops, warm[s] = make_step(argv, *s)
        times = {s: [] for s in settings}
        for _ in range(args.rounds):
            for s in settings:
                t = time.perf_counter()
                for _ in range(args.steps):
                    steps[s]()
                times[s].append((time.perf_counter() - t) / args.steps)
        base = statistics.median(times["fp32", False, True])
        for s in settings:
            med = statistics.median(times[s])
            what = s[0] + (" compile" if s[1] else "") + (" every position" if s[2:] else "")
            print(f"{name:12s} {what:19s}: {1 / med:6.2f} steps/s "
                  f"({base / med:.2f}x; rounds {min(times[s]) * 1e3:.0f}-"
                  f"{max(times[s]) * 1e3:.0f} ms), {flops / med / 1e9:5.1f} GFLOP/s = "
                  f"{flops / med / 1e9 / peaks[torch.float32, 64]:.0%} of fp32, "
                  f"{flops / med / 1e9 / peaks[torch.bfloat16, 64]:.0%} of bf16 peak (n=64); "
                  f"warm-up {warm[s]:.1f} s", flush=True)


if __name__ == "__main__":
    main()
