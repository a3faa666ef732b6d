"""Convert a grammar in the authors' rule-file format (Liuhong99/implicitbiasmlmcode's
`rule_deep_mlm.txt`) to the spec JSON that `train.py --lang FILE.json` and `data.py FILE.json`
read (data.language_from_spec).

    python .bench/rules_to_spec.py ../shared/data/paper_authors_pcfg_rules.txt authors.json
    python train.py --lang authors.json --preset tf-2m ...

A rule a line, `LHS RHS1 [RHS2] probability` (`#` starts a comment). A right-hand side that is
no left-hand side is a word. The first rule's left-hand side starts: its unary rules `START S1
p` give the root distribution (else it is the root). Ids follow first appearance; each
symbol's probabilities are renormalised unless off 1 by more than `tol`.
"""
import json
import math
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402

MAX_LEN = 32  # App. A.1: sentences of at most 32 words


def parse_rules(text, where="<text>", tol=1e-2):
    """PCFG arguments (root, binary, lexical, symbols, words, origin) of rules written one a line,
    `LHS RHS1 [RHS2] probability` (`#` comments), as the authors' `rule_deep_mlm.txt`
    (Liuhong99/implicitbiasmlmcode); `where` names the source in errors. A right-hand side that
    is no left-hand side is a word. The first rule's left-hand side starts: its unary rules
    `START S1 p` give the root distribution (else it is the root). Ids follow first appearance;
    each symbol's probabilities are renormalised unless off 1 by more than `tol`."""
    def fail(what, no=None):
        raise ValueError(f"{where}" + (f", line {no}" if no else "") + f": {what}")
    rules = []  # (line number, lhs, [rhs...], probability)
    for no, line in enumerate(text.splitlines(), 1):
        f = line.split("#", 1)[0].split()
        if f and len(f) not in (3, 4):
            fail(f"expected 'LHS RHS1 [RHS2] probability', got {len(f)} fields", no)
        try:
            p = float(f[-1]) if f else 0.0
        except ValueError:
            fail(f"probability {f[-1]!r} is not a number", no)
        if not (math.isfinite(p) and p >= 0):
            fail(f"probability {p} must be finite and >= 0", no)
        rules += [(no, f[0], f[1:-1], p)] if f else []
    if not rules:
        fail("no rules found")
    lhs = list(dict.fromkeys(r[1] for r in rules))
    start = rules[0][1]
    unary_start = any(r[1] == start and len(r[2]) == 1 and r[2][0] in lhs for r in rules)
    symbols = [s for s in lhs if not (s == start and unary_start)]
    words = list(dict.fromkeys(r[2][0] for r in rules if len(r[2]) == 1 and r[2][0] not in lhs))
    if not words:
        fail("no lexical rules (LHS word probability) found")
    sid, wid = {s: i for i, s in enumerate(symbols)}, {w: i for i, w in enumerate(words)}
    S, V = len(symbols), len(words)
    root, binary, lexical = np.zeros(S), np.zeros((S, S, S)), np.zeros((S, V))
    for no, a, rhs, p in rules:
        if unary_start and a == start:
            if len(rhs) != 1 or rhs[0] not in sid:
                fail(f"the start symbol {start} has unary rules, so each of its rules must "
                     f"name one other nonterminal", no)
            root[sid[rhs[0]]] += p
        elif len(rhs) == 2:
            if not all(s in sid for s in rhs):
                fail(f"{rhs} on the right of a binary rule are not all nonterminals", no)
            binary[sid[a], sid[rhs[0]], sid[rhs[1]]] += p
        elif rhs[0] in lhs:
            fail(f"unary rule {a} -> {rhs[0]} is only allowed from the start symbol {start}", no)
        else:
            lexical[sid[a], wid[rhs[0]]] += p
    if not unary_start:
        root[sid[start]] = 1.0
    for name, total in [(start, root.sum())] * unary_start + \
            [(s, binary[i].sum() + lexical[i].sum()) for i, s in enumerate(symbols)]:
        if abs(total - 1) > tol:
            fail(f"rules of {name} sum to {total:.6g}, off by {total - 1:+.3g} (tol {tol})")
    reached = root > 0
    for _ in range(S):  # symbols on the right of a reached symbol's rules are reached
        reached = reached | (binary[reached].sum((0, 2)) > 0) | (binary[reached].sum((0, 1)) > 0)
    if not reached.all():  # harmless (the authors' grammar has one), but often a typo
        warnings.warn(f"{where}: no derivation from the start symbol reaches "
                      f"{', '.join(s for s, r in zip(symbols, reached) if not r)}", stacklevel=2)
    z = binary.sum((1, 2)) + lexical.sum(1)
    return dict(root=root / root.sum(), binary=binary / z[:, None, None],
                lexical=lexical / z[:, None], symbols=symbols, words=words,
                origin={"rules": where})


def read_rules(path):
    """The PCFG of the rule file at `path`, or a one-line ValueError naming it."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read rule file {str(path)!r}: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    return data.PCFG(**parse_rules(text, str(path)), max_len=MAX_LEN)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1].rstrip() if argv[:1] in (["-h"], ["--help"])
                 else "usage: python .bench/rules_to_spec.py RULES.txt OUT.json")
    rules, out = argv
    try:
        grammar = read_rules(rules)
        if not out.endswith(".json"):
            raise ValueError(f"{out}: the output must be a .json file (--lang reads it by name)")
        bad = data.unwritable(out, "OUT.json")
        if bad:
            raise ValueError(bad)
        data.write_whole(out, lambda f: json.dump(grammar.spec(), f), mode="w")
    except (ValueError, OSError) as e:
        sys.exit(f"rules_to_spec.py: error: {data.first_line(e)}")
    print(f"{grammar!r}: wrote {out}")


if __name__ == "__main__":
    main()
