"""Benchmark of train.py's training step: not a test.

Measures, in ONE run so that the machine's load hits everything alike (medians of interleaved
rounds; ratios are the figures to quote):
  1. this machine's fp32 matmul peak (1 and 2 threads): the yardstick for achieved FLOP/s;
  2. one process with --threads 1 vs 2 (train.py's default is 1: see the README);
  3. training tokens/s of two small presets (tf-2m, tf-4m on the default language, batch 256)
     next to transformers' BertForMaskedLM at the same shape (hidden, layers, heads, FFN 4d,
     vocabulary, positions, no dropout), and the achieved FLOP/s as a fraction of (1).
transformers is imported lazily here only (pip install transformers); without it, (3) reports
train.py alone.

  python .bench/bench_train.py            # ~3 min on 2 cores
  python .bench/bench_train.py --rounds 3 --steps 5   # quicker, noisier
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import data  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402


def matmul_peak(threads, n=512, reps=20, dtype=torch.float32, m=None):
    """GFLOP/s of an [m, n] x [n, n] matmul (m = n by default; best of `reps`) in `dtype`: the
    machine's practical peak at that shape."""
    torch.set_num_threads(threads)
    m = n if m is None else m
    a, b = torch.randn(m, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * n * n / best / 1e9


def train_flops_per_step(cfg, batch, T):
    """Matmul FLOPs of one training step (forward + backward = 3 x forward) of a transformer:
    per token 2 x (12 d^2 per block + d x vocab for the logits) + 4 T d per block (attention)."""
    d, L, Vv = 64 * cfg.n_heads, cfg.n_layers, cfg.vocab_size
    per_token = 2 * (12 * d * d * L + d * Vv) + 4 * T * d * L
    return 3 * per_token * batch * T


def ours(preset, lang, batch):
    """A closure running one train.py AdamW step (same code path as train.train)."""
    V = lang.vocab_size
    cfg = model.config_from_preset(preset, V + data.N_SPECIAL, data.pad_id(V), lang.max_len)
    torch.manual_seed(0)
    net = model.build(cfg)
    args = train.parse_args(["--batch", str(batch)])
    train.check_args(args)
    opt = train.make_optimizer(net, args)
    inputs, targets = train.make_batch(lang, args, 0, batch)

    def step():
        loss = train.mlm_loss(net(inputs), targets, V)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step, cfg


def bert(cfg, lang, batch):
    """The same step with transformers' BertForMaskedLM at the same shape (None if absent)."""
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        return None
    d = 64 * cfg.n_heads
    bcfg = BertConfig(vocab_size=cfg.vocab_size, hidden_size=d, num_hidden_layers=cfg.n_layers,
                      num_attention_heads=cfg.n_heads, intermediate_size=4 * d,
                      max_position_embeddings=cfg.max_len, type_vocab_size=1,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      pad_token_id=cfg.pad_id)
    torch.manual_seed(0)
    net = BertForMaskedLM(bcfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    args = train.parse_args(["--batch", str(batch)])
    train.check_args(args)
    inputs, targets = train.make_batch(lang, args, 0, batch)

    def step():
        loss = net(input_ids=inputs, labels=targets).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def time_steps(step, threads, n):
    """Seconds per step over n steps (after one warm-up step) at `threads` torch threads."""
    torch.set_num_threads(threads)
    step()
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians over them)")
    p.add_argument("--steps", type=int, default=10, help="training steps timed per round")
    p.add_argument("--batch", type=int, default=256, help="batch in sentences")
    args = p.parse_args()
    lang = data.build_language("hmm-small", 0)
    T = lang.max_len
    print(f"language hmm-small (V={lang.vocab_size}, T={T}), batch {args.batch}; "
          f"machine shared with other jobs: medians of {args.rounds} interleaved rounds")

    peak = {k: statistics.median(matmul_peak(k) for _ in range(3)) for k in (1, 2)}
    print(f"fp32 matmul peak (512^3): {peak[1]:.1f} GFLOP/s on 1 thread, {peak[2]:.1f} on 2")

    # threads: the default preset of the default command and a transformer, alternating
    for preset in ("lstm-small", "tf-2m"):
        step, _ = ours(preset, lang, args.batch)
        t = {1: [], 2: []}
        for _ in range(args.rounds):
            for k in (1, 2):
                t[k].append(time_steps(step, k, args.steps))
        m1, m2 = statistics.median(t[1]), statistics.median(t[2])
        print(f"threads {preset}: 1 thread {m1 * 1e3:.1f} ms/step, 2 threads {m2 * 1e3:.1f} "
              f"ms/step (2-thread speed-up {m1 / m2:.2f}x; 2-thread spread "
              f"{min(t[2]) * 1e3:.0f}-{max(t[2]) * 1e3:.0f} ms)")

    tokens = args.batch * T
    for preset in ("tf-2m", "tf-4m"):
        step, cfg = ours(preset, lang, args.batch)
        ref = bert(cfg, lang, args.batch)
        flops = train_flops_per_step(cfg, args.batch, T)
        for threads in (1,):
            a, b = [], []
            for _ in range(args.rounds):
                a.append(time_steps(step, threads, args.steps))
                if ref is not None:
                    b.append(time_steps(ref, threads, args.steps))
            ta = statistics.median(a)
            line = (f"{preset} (d={64 * cfg.n_heads}, L={cfg.n_layers}), {threads} thread: "
                    f"train.py "
                    f"{tokens / ta / 1e3:.0f}k tok/s, {flops / ta / 1e9:.2f} GFLOP/s = "
                    f"{flops / ta / 1e9 / peak[threads]:.0%} of matmul peak")
            if ref is not None:
                tb = statistics.median(b)
                line += (f"; BertForMaskedLM {tokens / tb / 1e3:.0f}k tok/s; "
                         f"ratio train.py/BERT {tb / ta:.2f}x")
            else:
                line += "; (pip install transformers for the BertForMaskedLM comparison)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
