"""Tests of data.py, PCFG and generic part (issue 2): exact quantities against brute force."""
import math

import pytest
import torch

import data

torch.set_num_threads(1)


# ----------------------------------------------------------------------- helpers (oracles) ---

def _data_tiny_pcfg(max_len=6):
    """3 symbols, 3 words, recursive rules (symbol 0 -> 0 1), some zero entries."""
    S, V = 3, 3
    b = torch.zeros(S, S, S, dtype=torch.float64)
    lx = torch.zeros(S, V, dtype=torch.float64)
    b[0, 1, 2], b[0, 0, 1], lx[0, 0] = 0.5, 0.2, 0.3
    b[1, 2, 2], lx[1, 0], lx[1, 1] = 0.3, 0.2, 0.5
    b[2, 1, 0], lx[2, 1], lx[2, 2] = 0.1, 0.4, 0.5
    return data.PCFG([0.6, 0.3, 0.1], b, lx, max_len=max_len)


def _data_brute_inside(g, x):
    """Pure-Python inside recursion (independent of data.py's batched code): returns Pr(x) and
    the memoised inside function."""
    S, B, L, memo = g.n_symbols, g.binary.tolist(), g.lexical.tolist(), {}

    def ins(i, j, a):
        if (i, j, a) not in memo:
            if j - i == 1:
                memo[i, j, a] = L[a][x[i]]
            else:
                memo[i, j, a] = sum(B[a][b][c] * ins(i, k, b) * ins(k, j, c)
                                    for k in range(i + 1, j) for b in range(S)
                                    for c in range(S) if B[a][b][c])
        return memo[i, j, a]

    return sum(g.root[a].item() * ins(0, len(x), a) for a in range(S)), ins


def _data_batch(xs, T, V):
    tokens = torch.full((len(xs), T), data.pad_id(V), dtype=torch.long)
    for i, x in enumerate(xs):
        tokens[i, :len(x)] = torch.tensor(x)
    return tokens, torch.tensor([len(x) for x in xs])


_DATA_XS = [[0, 1, 2, 1], [1, 1, 0, 2, 2, 1], [0], [2, 1], [1, 0, 1, 1, 2]]

_DATA_RULES = """# a small grammar in the authors' format
S S_a 0.75
S S_b 0.25
S_a X Y 1.0
S_b Y X 1.0
X X Y 0.25
X cat 0.5
X dog 0.25
Y dog 0.6
Y runs 0.4
"""


# ------------------------------------------------------------------------------- special ids ---

def test_data_special_ids():
    assert data.mask_id(200) == 200 and data.pad_id(200) == 201 and data.N_SPECIAL == 2


# ------------------------------------------------------------------------------------ PCFG ---

def test_data_pcfg_log_prob_and_conditional_equal_brute_force():
    g = _data_tiny_pcfg()
    tokens, lengths = _data_batch(_DATA_XS, 6, 3)
    tokens[0, 5] = 0  # garbage beyond the length must be ignored
    lp, cond = g.log_prob(tokens, lengths), g.mlm_conditional(tokens, lengths)
    assert cond.dtype == torch.float64 and cond.shape == (5, 6, 3)
    for i, x in enumerate(_DATA_XS):
        p, _ = _data_brute_inside(g, x)
        assert abs(lp[i].item() - math.log(p)) < 1e-10
        for t in range(len(x)):  # one full inside probability per candidate word
            ps = [_data_brute_inside(g, x[:t] + [w] + x[t + 1:])[0] for w in range(3)]
            brute = torch.tensor(ps, dtype=torch.float64) / sum(ps)
            assert torch.allclose(cond[i, t], brute, atol=1e-10, rtol=0)
        assert (cond[i, len(x):] == 0).all()


def test_data_pcfg_mask_is_summed_out():
    g = _data_tiny_pcfg()
    tokens, lengths = _data_batch(_DATA_XS, 6, 3)
    cond = g.mlm_conditional(tokens, lengths)
    for i, x in enumerate(_DATA_XS):
        for t in range(len(x)):
            masked = tokens[i:i + 1].clone()
            masked[0, t] = data.mask_id(3)
            # the masked position's conditional never depends on x_t
            assert torch.allclose(g.mlm_conditional(masked, lengths[i:i + 1])[0, t], cond[i, t],
                                  atol=1e-12, rtol=0)
            # log_prob of a masked sentence is the marginal over the hidden word
            brute = sum(_data_brute_inside(g, x[:t] + [w] + x[t + 1:])[0] for w in range(3))
            lp = g.log_prob(masked, lengths[i:i + 1])[0].item()
            assert (brute == 0 and lp == -math.inf) or abs(lp - math.log(brute)) < 1e-10


def test_data_pcfg_span_posterior_equals_brute_force():
    g = _data_tiny_pcfg()
    tokens, lengths = _data_batch(_DATA_XS, 6, 3)
    S, B, R = g.n_symbols, g.binary.tolist(), g.root.tolist()
    for span in (1, 2, 3, 8):
        post = g.span_posterior(tokens, lengths, span)
        for i, x in enumerate(_DATA_XS):
            px, ins = _data_brute_inside(g, x)
            m = min(span, len(x))

            def forced(j, a, s):  # Pr(x[0:j] from a, with [0, m) a constituent labelled s)
                if j == m:
                    return ins(0, m, a) * (a == s)
                return sum(B[a][b][c] * forced(k, b, s) * ins(k, j, c) for k in range(m, j)
                           for b in range(S) for c in range(S) if B[a][b][c])

            brute = [sum(R[a] * forced(len(x), a, s) for a in range(S)) / px for s in range(S)]
            assert torch.allclose(post[i], torch.tensor(brute, dtype=torch.float64),
                                  atol=1e-12, rtol=0)


def test_data_pcfg_sampling_matches_log_prob():
    g = _data_tiny_pcfg(max_len=3)
    n = 20000
    tokens, lengths, trees = g.sample(n, seed=1, max_len=3)
    assert tokens.shape == (n, 3) and (lengths <= 3).all() and (lengths >= 1).all()
    assert (tokens[torch.arange(3) >= lengths[:, None]] == data.pad_id(3)).all()
    counts = {}
    for x, l in zip(tokens.tolist(), lengths.tolist()):
        counts[tuple(x[:l])] = counts.get(tuple(x[:l]), 0) + 1
    xs = [list(c) for L in (1, 2, 3) for c in __import__("itertools").product(range(3), repeat=L)]
    tk, ln = _data_batch(xs, 3, 3)
    p = g.log_prob(tk, ln).exp()
    p = p / p.sum()  # sampling conditions on length <= max_len
    chi2, df = 0.0, 0
    for x, q in zip(xs, p.tolist()):
        o = counts.get(tuple(x), 0)
        if q == 0:
            assert o == 0
        elif n * q >= 5:
            chi2 += (o - n * q) ** 2 / (n * q)
            df += 1
    assert sum(counts.values()) == n
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)  # ~6 sigma of a chi-square(df)


def _data_check_trees(g, tokens, lengths, trees):
    for x, l, tree in zip(tokens.tolist(), lengths.tolist(), trees.tolist()):
        nodes = [tuple(r) for r in tree if r[0] >= 0]
        assert len(nodes) == 2 * l - 1 and nodes[0][:2] == (0, l)
        assert g.root[nodes[0][2]] > 0
        spans = {(i, j): s for i, j, s in nodes}
        assert len(spans) == len(nodes)
        for i, j, s in nodes:
            if j - i == 1:
                assert g.lexical[s, x[i]] > 0
            else:
                kids = [k for k in range(i + 1, j) if (i, k) in spans and (k, j) in spans]
                assert len(kids) == 1
                k = kids[0]
                assert g.binary[s, spans[i, k], spans[k, j]] > 0


def test_data_pcfg_trees_are_valid_parses():
    g = _data_tiny_pcfg()
    _data_check_trees(g, *g.sample(300, seed=2))
    g = data.PCFG.random()
    _data_check_trees(g, *g.sample(100, seed=3))


def test_data_pcfg_default_grammar_conditionals_length_32():
    g = data.PCFG.random()
    tokens, lengths = g.sentences(40, seed=4)
    full = data.PCFG.random(p_lexical=0.0)  # every sentence has exactly 32 words
    t32, l32 = full.sentences(8, seed=5)
    assert (l32 == 32).all()
    for lang, t, l in ((g, tokens, lengths), (full, t32, l32)):
        c = lang.mlm_conditional(t, l)
        assert torch.isfinite(c).all()
        valid = torch.arange(32) < l[:, None]
        assert torch.allclose(c.sum(-1)[valid], torch.ones(int(valid.sum()),
                              dtype=torch.float64), atol=1e-12)
        assert (c[~valid] == 0).all()
        assert torch.isfinite(lang.log_prob(t, l)).all()
        # The observed word has positive probability.
        assert (c.gather(2, t.clamp(max=199)[..., None])[..., 0][valid] > 0).all()


def test_data_pcfg_invalid_inputs_raise():
    g = _data_tiny_pcfg()
    b, lx, r = g.binary, g.lexical, g.root
    with pytest.raises(ValueError, match="shape"):
        data.PCFG(r, b[:2], lx)
    with pytest.raises(ValueError, match="shape"):
        data.PCFG(r, b, lx[:2])
    bad = b.clone()
    bad[1, 2, 2] = -0.3
    with pytest.raises(ValueError, match="negative"):
        data.PCFG(r, bad, lx)
    bad = lx.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        data.PCFG(r, b, bad)
    bad = lx.clone()
    bad[2, 2] = 0.4
    with pytest.raises(ValueError, match=r"symbol 2.*off by -0\.1"):
        data.PCFG(r, b, bad)
    with pytest.raises(ValueError, match="root"):
        data.PCFG([0.5, 0.3, 0.1], b, lx)
    with pytest.raises(ValueError, match="word id"):
        g.mlm_conditional(torch.tensor([[0, 5]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="lengths"):
        g.log_prob(torch.tensor([[0, 1]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="valid tasks are"):
        g.task_data("D", 5)
    with pytest.raises(ValueError, match="unknown language kind"):
        data.language_from_spec({"kind": "zipf"})
    with pytest.raises(ValueError, match="line 3"):
        data.PCFG.from_rules("S A 1.0\nA x 1.0\nA y\n")
    with pytest.raises(ValueError, match="line 2: probability 'p'"):
        data.PCFG.from_rules("S A 1.0\nA x p\n")
    with pytest.raises(ValueError, match="line 1.*not a nonterminal"):
        data.PCFG.from_rules("S A B 1.0\nA x 1.0\n")
    with pytest.raises(ValueError, match="rules of A sum to 0.5"):
        data.PCFG.from_rules("S A 1.0\nA x 0.5\n")
    with pytest.raises(ValueError, match="no such rule file"):
        data.PCFG.from_rules("missing_rules.txt")
    with pytest.raises(ValueError, match="numeric"):
        data.PCFG([[0.5], [0.5, 0.0]], b, lx)


def test_data_pcfg_from_rules_inline():
    g = data.PCFG.from_rules(_DATA_RULES)
    assert g.symbols == ["S_a", "S_b", "X", "Y"] and g.words == ["cat", "dog", "runs"]
    assert g.root.tolist() == [0.75, 0.25, 0.0, 0.0]
    assert g.binary[0, 2, 3] == 1.0 and g.binary[1, 3, 2] == 1.0 and g.binary[2, 2, 3] == 0.25
    assert g.lexical.tolist() == [[0, 0, 0], [0, 0, 0], [0.5, 0.25, 0], [0, 0.6, 0.4]]
    # "cat runs" = S_a -> X Y: 0.75 * 0.5 * 0.4; no parse through S_b (Y never emits cat).
    lp = g.log_prob(torch.tensor([[0, 2]]), torch.tensor([2]))
    assert abs(lp.item() - math.log(0.75 * 0.5 * 0.4)) < 1e-12
    t, l = g.sentences(50, seed=0)
    assert torch.isfinite(g.mlm_conditional(t, l)).all()


def test_data_pcfg_authors_rules_load_if_present():
    path = "../shared/data/paper_authors_pcfg_rules.txt"
    if not __import__("os").path.exists(path):
        pytest.skip("authors' grammar not present")
    g = data.PCFG.from_rules(path)
    assert (g.n_symbols, g.vocab_size) == (49, 200) and g.symbols[0] == "S1"
    t, l = g.sentences(200, seed=0)
    assert l.max() <= 16
    assert torch.isfinite(g.mlm_conditional(t[:20], l[:20])).all()


def test_data_pcfg_tasks():
    g = _data_tiny_pcfg()
    assert g.tasks == ["A", "B", "C"] and g.n_classes("B") == 3
    t, l, y = g.task_data("C", 30, seed=0)
    post = g.span_posterior(t, l, 8)
    assert t.shape == (30, 6) and (post.sum(1) > 0).all()
    assert torch.equal(y, post.argmax(1))


def test_data_spec_round_trip(tmp_path):
    for g in (data.PCFG.random(), data.PCFG.from_rules(_DATA_RULES)):
        path = tmp_path / "spec.pt"
        torch.save({"language": g.spec()}, path)
        h = data.language_from_spec(torch.load(path, weights_only=True)["language"])
        assert torch.equal(g.root, h.root) and torch.equal(g.binary, h.binary)
        assert torch.equal(g.lexical, h.lexical) and h.max_len == g.max_len
        assert h.words == g.words
        assert all(torch.equal(a, b) for a, b in zip(g.sample(20, seed=7), h.sample(20, seed=7)))


# ---------------------------------------------------------------------- generic: any language ---

def test_data_mlm_entropy_is_mean_conditional_entropy():
    g = _data_tiny_pcfg()
    mean, se = data.mlm_entropy(g, n=300, seed=3)
    t, l = g.sentences(300, seed=3)
    c = g.mlm_conditional(t, l)
    h = -(c * c.clamp_min(1e-300).log()).sum(-1).sum(1) / l
    assert abs(mean - h.mean().item()) < 1e-12 and abs(se - h.std().item() / math.sqrt(300)) < 1e-12
    assert 0 < mean < math.log(3)


def test_data_masking():
    g = _data_tiny_pcfg()
    t, l = g.sentences(2000, seed=0)
    gen = torch.Generator().manual_seed(0)
    inp, tgt, pos = data.mask_one(t, l, 3, gen)
    rows = torch.arange(2000)
    assert ((inp == data.mask_id(3)).sum(1) == 1).all() and (pos < l).all()
    assert torch.equal(tgt, t[rows, pos]) and (inp[rows, pos] == data.mask_id(3)).all()
    inp2 = inp.clone()
    inp2[rows, pos] = tgt
    assert torch.equal(inp2, t)
    assert pos.bincount(minlength=6)[0] > 0 and (pos == l - 1).any()  # both ends reachable
    inp, tgt = data.mask_rate(t, l, 3, rate=0.15, generator=gen)
    masked = inp == data.mask_id(3)
    valid = torch.arange(6) < l[:, None]
    assert (masked.sum(1) >= 1).all() and not (masked & ~valid).any()
    assert torch.equal(masked, tgt != -100) and torch.equal(tgt[masked], t[masked])
    assert torch.equal(inp[~masked], t[~masked])
    big = torch.zeros(4000, 30, dtype=torch.long)
    _, tg = data.mask_rate(big, torch.full((4000,), 30), 3, 0.15, gen)
    assert abs((tg != -100).double().mean().item() - 0.15) < 0.01


def test_data_cli_writes_reloadable_dataset(tmp_path, capsys):
    rules = tmp_path / "rules.txt"
    rules.write_text(_DATA_RULES)
    out = tmp_path / "pcfg.pt"
    data.main(["pcfg", "--rules", str(rules), "--n", "40", "--seed", "3", "--out", str(out),
               "--conditionals"])
    d = torch.load(out, weights_only=True)
    lang = data.language_from_spec(d["spec"])
    t, l = lang.sentences(40, seed=3)
    assert torch.equal(d["tokens"], t) and torch.equal(d["lengths"], l)
    assert torch.equal(d["conditionals"], lang.mlm_conditional(t, l))
    assert set(d["labels"]) == {"A", "B", "C"} and d["labels"]["B"]["labels"].shape == (40,)
    assert "optimal MLM loss" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        data.main(["pcfg", "--n", "0", "--out", str(out)])
