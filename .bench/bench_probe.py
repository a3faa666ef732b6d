"""Benchmark: linear probe (App. A.4) on 10,000 examples for one checkpoint, wall time.

Measures, in one run, the pieces of `probe.probe_checkpoint(..., method="linear")` —
downstream data, frozen feature extraction (once), and the 100-epoch head training per seed (5
seeds) — and, side by side, the baseline that the precomputation avoids: running the frozen
encoder inside every epoch (timed for 2 epochs and scaled to 100). The probe's cost does not
depend on the weights, so by default the checkpoint is an untrained one of train.py's default
setting (lstm-small on hmm-small) and of a small transformer (tf-2m, 1 layer), written to a
temporary folder.

    python .bench/bench_probe.py                       # 2 threads, both models
    python .bench/bench_probe.py --ckpt runs/NAME/ckpt_0003000.pt --threads 1
"""
import argparse
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import model  # noqa: E402
import probe  # noqa: E402
import train  # noqa: E402

print = functools.partial(print, flush=True)  # progress shows even when piped


def make_checkpoint(folder, preset, **overrides):
    """An untrained checkpoint of `preset` on train.py's default language (hmm-small)."""
    lang = data.build_language("hmm-small", 0)
    V = lang.vocab_size
    cfg = model.config_from_preset(preset, vocab_size=V + data.N_SPECIAL, pad_id=data.pad_id(V),
                                   max_len=lang.max_len, **overrides)
    torch.manual_seed(0)
    net = model.build(cfg)
    path = os.path.join(folder, f"{preset}.pt")
    torch.save({"kind": "mlm", "model_config": dataclasses.asdict(cfg), "model": net.state_dict(),
                "optimizer": {}, "step": 0, "rng": {}, "language": lang.spec(), "args": {}}, path)
    return path


def encoder_in_the_loop_epoch(net, tok, lens, y, R, x_fit, W, b, opt, g):
    """Baseline: one epoch of the head with the frozen encoder re-run on every batch."""
    perm = torch.randperm(len(tok), generator=g)
    for i in range(0, len(tok), probe.LINEAR_BATCH):
        idx = perm[i:i + probe.LINEAR_BATCH]
        with torch.no_grad():
            z = train.standardise(x_fit, probe.concat_features(net, tok[idx], lens[idx]) @ R)[1]
        loss = F.cross_entropy(z @ W.T + b, y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def bench(path, task, n_train, n_test, seeds):
    net, ckpt, lang = train.load_checkpoint(path)
    n_classes = lang.n_classes(task)
    t = time.perf_counter()
    (tok, lens, y), (tok_te, lens_te, y_te) = probe.downstream_data(lang, task, n_train, n_test)
    t_data = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        x = probe.concat_features(net, tok, lens)
        x_te = probe.concat_features(net, tok_te, lens_te)
    t_feat = time.perf_counter() - t
    head, accs = [], []
    for s in range(seeds):
        t = time.perf_counter()
        accs.append(probe.adamw_probe(x, y, x_te, y_te, n_classes, seed=s)[0].float().mean()
                    .item())
        head.append(time.perf_counter() - t)
    # baseline: encoder inside each epoch (2 epochs timed, x50 to 100 epochs)
    g = torch.Generator().manual_seed(0)
    R = train.gaussian_projection(x.shape[1], train.PROJ_DIM, g)
    z = x @ R
    W = torch.zeros(n_classes, train.PROJ_DIM, requires_grad=True)
    b = torch.zeros(n_classes, requires_grad=True)
    opt = torch.optim.AdamW([W, b], lr=probe.LINEAR_LR, weight_decay=probe.WEIGHT_DECAY)
    t = time.perf_counter()
    for _ in range(2):
        encoder_in_the_loop_epoch(net, tok, lens, y, R, z, W, b, opt, g)
    t_naive_epoch = (time.perf_counter() - t) / 2
    t_ours = t_feat + sum(head)
    t_naive = t_naive_epoch * probe.LINEAR_EPOCHS * seeds
    print(f"{os.path.basename(path)} ({ckpt['model_config']['arch']}, "
          f"{model.n_params(net):,} params), "
          f"task {task}: {n_train} train + {n_test} test, features {tuple(x.shape)}")
    print(f"  downstream data            {t_data:7.2f} s")
    print(f"  feature extraction (once)  {t_feat:7.2f} s")
    print(f"  head, 100 epochs, per seed {statistics.median(head):7.2f} s median of {seeds} "
          f"(min {min(head):.2f}, max {max(head):.2f}); acc {statistics.mean(accs):.4f}")
    print(f"  total ({seeds} seeds)            {t_ours:7.2f} s  (+ data {t_data:.2f} s)")
    print(f"  baseline: encoder in every epoch {t_naive_epoch:.2f} s/epoch -> {t_naive:7.1f} s for "
          f"{seeds} x {probe.LINEAR_EPOCHS} epochs (extrapolated from 2); "
          f"ratio {t_naive / t_ours:.1f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help="checkpoint to probe (default: untrained "
                   "lstm-small and tf-2m on hmm-small)")
    p.add_argument("--task", default="6", help="downstream task (default 6: HMM task-6)")
    p.add_argument("--n", type=int, default=10000, help="downstream training examples")
    p.add_argument("--n-test", type=int, default=2000, help="test examples (default 2000)")
    p.add_argument("--probe-seeds", type=int, default=probe.N_SEEDS,
                   help="probe seeds (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores "
          f"(shared with other jobs: timings are noisy)")
    with tempfile.TemporaryDirectory() as folder:
        paths = [args.ckpt] if args.ckpt else [make_checkpoint(folder, "lstm-small"),
                                               make_checkpoint(folder, "tf-2m", n_layers=1)]
        for path in paths:
            bench(path, args.task, args.n, args.n_test, args.probe_seeds)


if __name__ == "__main__":
    main()
