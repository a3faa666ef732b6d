"""Which span tasks of a checkpoint's PCFG need the model? For each span (start, width): the
majority class, the linear probe on one-hot words (probe.py --method onehot) and on each
checkpoint's features, all with probe.py's settings on the same sentences. A task that the
words alone solve as well as the model cannot show a downstream effect of pre-training.

    python .bench/span_tasks.py runs/p-s*/ckpt_0016000.pt --spans 2,2 0,4 --epochs 50 100 200
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data    # noqa: E402
import probe   # noqa: E402
import train   # noqa: E402


def span_rows(checkpoints, spec, start, width, args):
    """For each of args.epochs: (majority, one-hot accuracy, [each checkpoint's accuracy]) on
    span task (start, width), the features computed once."""
    lang = data.language_from_spec({**spec, "span_tasks": {"S": [start, width]}})
    (tok, lengths, y), (tok_test, lengths_test, y_test) = probe.downstream_data(
        lang, "S", args.n_train, args.n_test)
    n_classes = lang.n_classes("S")
    n_ids = lang.vocab_size + data.N_SPECIAL
    features = [(probe.word_features(tok, lengths, n_ids),
                 probe.word_features(tok_test, lengths_test, n_ids))]
    for net in checkpoints:
        with torch.no_grad():
            features.append(tuple(probe.concat_features(net, t, n)
                                  for t, n in ((tok, lengths), (tok_test, lengths_test))))
    majority = y_test.bincount(minlength=n_classes).max().item() / len(y_test)
    for epochs in args.epochs:
        accs = [probe.adamw_probe(x, y, x_test, y_test, n_classes, seed=0, epochs=epochs)[0]
                .float().mean().item() for x, x_test in features]
        yield epochs, majority, accs[0], accs[1:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="checkpoints of one PCFG language")
    p.add_argument("--spans", nargs="+", required=True, help="START,WIDTH ...")
    p.add_argument("--n-train", type=int, default=probe.N_TRAIN)
    p.add_argument("--n-test", type=int, default=5000)
    p.add_argument("--epochs", type=int, nargs="+", default=[50], help="probe epochs: one "
                   "line per span and value (probe.py's README runs use 50)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    loaded = [train.load_checkpoint(c) for c in args.checkpoints]
    spec = loaded[0][1]["language"]
    if spec["kind"] != "pcfg" or any(c["language"] != spec for _, c, _ in loaded):
        p.error("the checkpoints must share one PCFG language")
    print("span (start, width) | probe epochs | majority | one-hot words | checkpoints: mean "
          "[min, max]")
    for span in args.spans:
        start, width = map(int, span.split(","))
        for epochs, majority, words, models in span_rows([m for m, _, _ in loaded], spec, start,
                                                         width, args):
            print(f"({start}, {width}) | {epochs} | {majority:.3f} | {words:.3f} | "
                  f"{sum(models) / len(models):.3f} [{min(models):.3f}, {max(models):.3f}]",
                  flush=True)


if __name__ == "__main__":
    main()
