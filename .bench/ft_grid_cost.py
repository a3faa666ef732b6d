"""Fine-tuning's grid cost in updates, from the grids probe.py recorded (ft_grid in its finetune
rows): each lr's run replayed from the start when the grid widens (probe.py before it went on
with its runs) against going on from where each run stood (probe.tuned_finetune now). The two
judge the same points with the same outcomes; only the updates trained differ.

    python .bench/ft_grid_cost.py RUN_OR_PROBE_JSONL ...     # e.g. runs/*/probe.jsonl

Prints per grid: the checkpoint, the points judged (first round + widened), updates replayed,
updates gone on, the saving; then the totals. Seed 0's grid only (the other seeds run once at
the choice either way).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import probe  # noqa: E402


def grid_updates(grid, lrs, ups):
    """(updates replayed, updates gone on) for one recorded grid of probe.tuned_finetune."""
    first = [r for r in grid if r["lr"] in lrs and r["updates"] in ups]   # the first round's
    reached = {}
    for r in first:
        reached[r["lr"]] = max(reached.get(r["lr"], 0), r["updates"])
    widened = {}
    for r in grid:
        if r not in first:
            widened.setdefault(r["lr"], []).append(r["updates"])
    replayed = gone_on = sum(reached.values())
    for lr, ns in widened.items():
        replayed += max(ns)
        goes_on = lr in reached and min(ns) > reached[lr]       # no run goes back
        gone_on += max(ns) - reached[lr] if goes_on else max(ns)
    return len(first), len(grid) - len(first), replayed, gone_on


def main(argv=None):
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        sys.exit("usage: python .bench/ft_grid_cost.py RUN_OR_PROBE_JSONL ...")
    total = [0, 0]
    for path in paths:
        path = os.path.join(path, "probe.jsonl") if os.path.isdir(path) else path
        for line in open(path):
            row = json.loads(line)
            if row.get("method") != "finetune" or "ft_grid" not in row:
                continue
            lrs, ups = row["ft_grid_of"][:2]
            n_first, n_wide, replayed, gone_on = grid_updates(row["ft_grid"], lrs, ups)
            total[0], total[1] = total[0] + replayed, total[1] + gone_on
            print(f"{row['ckpt']}: {n_first} + {n_wide} points, {replayed:,} updates replayed, "
                  f"{gone_on:,} gone on ({1 - gone_on / replayed:.0%} fewer)")
    if total[0]:
        print(f"all: {total[0]:,} updates replayed, {total[1]:,} gone on "
              f"({1 - total[1] / total[0]:.1%} fewer)")


if __name__ == "__main__":
    main()
