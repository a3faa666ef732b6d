"""The checkpoint files a same-loss comparison needs measured, before any is measured: A's, and
B's best and next-best KL matches among every evaluated checkpoint whose file exists (probed or
not), one path a line, for hessian.py and probe.py (probe.pair_checkpoints on metrics.jsonl).

    python .bench/to_measure.py RUN ... --compare A B [--compare A B ...]
    e.g. NEED=$(python .bench/to_measure.py runs/deep-s0 runs/deep-b?-s0 \\
                    --compare 'deep-b[1-4]@last' 'deep*@kl-later')
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import probe  # noqa: E402
import train  # noqa: E402


def evaluated_rows(runs):
    """A row (run, group, seed, step, kl, kl_se, path) per evaluated step with a checkpoint."""
    rows = []
    for run in runs:
        metrics = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(metrics):
            raise ValueError(f"{run} is not a run directory (runs/NAME with metrics.jsonl)")
        name = os.path.basename(os.path.normpath(run))
        group_seed = re.fullmatch(r"(.*)-s(\d+)", name)
        group, seed = (group_seed[1], int(group_seed[2])) if group_seed else (name, None)
        for r in data.read_rows(metrics):
            path = train.ckpt_path(run, r["step"])
            if "eval_loss" in r and os.path.exists(path):
                rows.append({"run": name, "group": group, "seed": seed, "step": r["step"],
                             "kl": r["kl"], "kl_se": r["kl_se"], "path": path})
    return rows


def to_measure(rows, spec_a, spec_b):
    """A's path and B's two nearest KL matches per seed (probe.pair_checkpoints)."""
    return [r["path"] for _, matches in probe.pair_checkpoints(rows, None, spec_a, spec_b)
            for _, a, ranked, _ in matches for r in [a] + ranked[:2]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders runs/NAME")
    p.add_argument("--compare", nargs=2, action="append", required=True, metavar=("A", "B"))
    args = p.parse_args(argv)
    try:
        rows = evaluated_rows(args.runs)
        paths = [path for a, b in args.compare for path in to_measure(rows, a, b)]
    except ValueError as e:
        sys.exit(f"to_measure.py: error: {data.first_line(e)}")
    print("\n".join(dict.fromkeys(paths)))


if __name__ == "__main__":
    main()
