"""The record's probe's protocol (probe.adamw_probe) at a same-loss pair (App. A.4; §4): for
each number of training sentences, each number of epochs and each width (the 512-d projection or
none), the root's test accuracy of both checkpoints on the same test sentences, their paired
difference with its test-set se (probe.paired_difference), the probe's accuracy on its own
training sentences (how far it fits them), and the seconds it took. A converged setting changes
by < 0.3 points when its epochs double. Sentences come from probe.downstream_data, the same for
every setting (the first n_train of the largest training set).
    python .bench/probe_sweep.py A.pt B.pt [--n-test 4000] [--probe-seeds 3]
    python .bench/probe_sweep.py A.pt B.pt --grid 500:400,500:1600,500:6400 --no-projection
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import probe  # noqa: E402
import train  # noqa: E402

# (n_train, epochs), epochs doubling per size (batch 512: 500 sentences take 1 step an epoch)
GRID = [(500, 400), (500, 800), (4000, 100), (4000, 200), (4000, 400), (4000, 800),
        (16000, 50), (16000, 100), (16000, 200), (16000, 400)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--task", default="A")
    p.add_argument("--n-test", type=int, default=4000)
    p.add_argument("--probe-seeds", type=int, default=3)
    p.add_argument("--grid", type=lambda v: [tuple(map(int, c.split(":"))) for c in v.split(",")],
                   default=GRID, help="N_TRAIN:EPOCHS,... (default: the grid above)")
    p.add_argument("--no-projection", action="store_true", help="only without the projection")
    args = p.parse_args()
    torch.set_num_threads(1)
    n_max = max(n for n, _ in args.grid)
    feats, labels = {}, None
    for name, path in (("A", args.a), ("B", args.b)):
        net, ckpt, lang = train.load_checkpoint(path)
        (tok, lengths, y), (tok_t, lengths_t, y_t) = probe.downstream_data(
            lang, args.task, n_max, args.n_test)
        with torch.no_grad():
            feats[name] = (probe.concat_features(net, tok, lengths),
                           probe.concat_features(net, tok_t, lengths_t))
        labels, n_classes = (y, y_t), lang.n_classes(args.task)
        print(f"{name}: {path} (step {ckpt['step']})", flush=True)
    print(f"{'n_train':>7} {'epochs':>6} {'proj':>5} | {'acc A':>6} {'acc B':>6} "
          f"{'B - A, points':>15} | {'train acc A, B':>14} | seconds")
    for proj in (None,) if args.no_projection else (train.PROJ_DIM, None):
        for n_train, epochs in args.grid:
            t0, correct, fit = time.time(), {}, {}
            for name in ("A", "B"):
                (x, x_t), (y, y_t) = feats[name], labels
                x, y = x[:n_train], y[:n_train]
                correct[name] = sum(probe.adamw_probe(x, y, x_t, y_t, n_classes, seed=s,
                                                      proj_dim=proj, epochs=epochs)[0].long()
                                    for s in range(args.probe_seeds))
                fit[name] = probe.adamw_probe(x, y, x, y, n_classes, seed=0, proj_dim=proj,
                                              epochs=epochs)[0].float().mean().item()
            (diff,), (se,), _, _ = probe.paired_difference(
                [correct["A"].tolist()], [correct["B"].tolist()], args.probe_seeds)
            acc = {k: c.float().mean().item() / args.probe_seeds for k, c in correct.items()}
            print(f"{n_train:7d} {epochs:6d} {str(proj):>5} | {acc['A']:6.4f} {acc['B']:6.4f} "
                  f"{100 * diff:+7.2f} ± {100 * se:4.2f} | {fit['A']:6.4f} {fit['B']:6.4f} | "
                  f"{time.time() - t0:5.0f}", flush=True)


if __name__ == "__main__":
    main()
