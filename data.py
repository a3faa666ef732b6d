"""Synthetic languages with exact masked-token conditionals (paper §2.1-2.2, App. A.1).

The true conditional Pr(x_t = w | x_-t) gives the optimal MLM loss (its entropy, §2.1), the exact KL
of a model to the truth (App. A.4) and the Bayes labels of the downstream tasks. `HMM` (the paper's
HMM set) has it by forward-backward, `PCFG` (a grammar in Chomsky normal form: the PCFG set) by
inside-outside (App. A.2 computes them from the joint). Both have sentences(n, seed),
mlm_conditional, tasks / n_classes / task_data (tokens, lengths, Bayes labels) and spec (what
checkpoints store; language_from_spec). Words are 0..V-1, then mask_id(V) and pad_id(V).

Reading order: mask_one (and mask_rate, App. E's 15 % rate); the inputs' checks the languages
make; the samplers and the random grammar; hmm_forward_backward, hmm_state_posterior, HMM; inside,
outside, pcfg_conditional, PCFG; mlm_entropy; LANGUAGES. After the plumbing banner: a language
from its name or spec, and the command line with what later scripts share of it (flag types,
whole writes and appends, the JSON rows reader, one-line exits).

Run (prints the language, its tasks and optimal MLM loss; writes sentences, task labels and
the spec, read back by torch.load(FILE, weights_only=True)):
    python data.py hmm --n 10000 --out hmm.pt
    python data.py my_grammar.json --n 1000 --out a.pt   # a spec file (.bench/rules_to_spec.py)
    python data.py pcfg-small --n 200 --conditionals --out s.pt         # + exact conditionals
"""
import argparse
import contextlib
import io
import json
import math
import os
import signal
import sys

import numpy as np
import torch

N_SPECIAL = 2  # [MASK] and [PAD] follow the V words

# ------------------------------------------------------------ special ids, masking (§2.1) ---

def mask_id(V):
    """Id of the [MASK] token for a language with V words."""
    return V


def pad_id(V):
    """Id of the [PAD] token (positions >= a sentence's length)."""
    return V + 1


def mask_one(tokens, lengths, V, generator=None):
    """Mask one position per sentence, uniform among its words (the paper's default, §2.1).
    tokens [n, T] long, lengths [n]; returns (inputs [n, T]: tokens with mask_id(V) at the
    masked position, targets [n]: the masked words, positions [n]: where, 0 <= pos < length),
    all long; `tokens` is left unchanged. One float64 uniform u per sentence from
    `generator` (torch.rand; the global RNG if None); position = floor(u * length)."""
    # BEGIN EXERCISE mask
    n = tokens.shape[0]
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    positions = (u * lengths).long().clamp(max=lengths - 1)
    inputs = tokens.clone()
    targets = tokens[torch.arange(n), positions].clone()
    inputs[torch.arange(n), positions] = mask_id(V)
    return inputs, targets, positions
    # END EXERCISE mask


def mask_rate(tokens, lengths, V, rate=0.15, generator=None):
    """Mask each word independently with probability `rate` (App. E; all chosen positions become
    [MASK], no BERT 80/10/10 replacement), at least one per sentence: returns (inputs,
    targets [n, T]) with targets -100 where nothing is predicted."""
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1]; got {rate}")
    n, T = tokens.shape
    valid = torch.arange(T) < lengths[:, None]
    chosen = (torch.rand(n, T, generator=generator) < rate) & valid
    _, _, one = mask_one(tokens, lengths, V, generator)
    chosen[torch.arange(n), one] |= ~chosen.any(1)
    inputs = torch.where(chosen, torch.full_like(tokens, mask_id(V)), tokens)
    targets = torch.where(chosen, tokens, torch.full_like(tokens, -100))
    return inputs, targets


# ------------------------------------------- what the languages refuse: their inputs' checks ---

def _as_float64(x, name):
    """`x` (tensor, numpy array or nested list) as a float64 CPU tensor, or a ValueError."""
    try:
        x = x.detach().cpu().double().numpy() if torch.is_tensor(x) else x
        return torch.tensor(np.asarray(x, dtype=np.float64))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected a numeric array, got {type(x).__name__} ({e})")


def _refuse(impossible, idx, who, what=""):
    """Raise a ValueError naming the first sentence idx[i] with impossible[i] (Pr(x) = 0)."""
    if impossible.any():
        raise ValueError(f"{who}sentence {idx[impossible.nonzero()[0, 0]].item()} has "
                         f"probability 0{what}")


def _check_sentences(who, tokens, lengths, V):
    """(tokens, lengths (None: all T), valid [n, T]) of a batch of words or masks, or ValueError."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 2:
        raise ValueError(f"{who}: tokens must be [n, T]; got shape {list(tokens.shape)}")
    n, T = tokens.shape
    lengths = torch.full((n,), T) if lengths is None else torch.as_tensor(lengths).long()
    if lengths.shape != (n,) or (lengths < 1).any() or (lengths > T).any():
        raise ValueError(f"{who}: lengths must be [n] = [{n}] with 1 <= length <= T = {T} "
                         f"(the width of tokens); got {lengths.tolist()}"[:300])
    valid = torch.arange(T) < lengths[:, None]
    bad = valid & (tokens != mask_id(V)) & ((tokens < 0) | (tokens >= V))
    if bad.any():
        i, t = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{who}: sentence {i} position {t} holds id {int(tokens[i, t])}, not a "
                         f"word id in 0..{V - 1} or mask_id (pad only beyond the length)")
    return tokens, lengths, valid


def _check_rows(m, row_name, tol):
    """Raise ValueError unless each row of m [R, K] is a distribution; row_name(i) names row i."""
    bad = ~torch.isfinite(m).all(1)
    if bad.any():
        raise ValueError(f"{row_name(int(bad.nonzero()[0]))} has a NaN or infinite entry")
    if (m < 0).any():
        i = int((m < 0).any(1).nonzero()[0])
        raise ValueError(f"{row_name(i)} has a negative entry (min {float(m[i].min()):.3g})")
    off = m.sum(1) - 1
    if (off.abs() > tol).any():
        i = int(off.abs().argmax())
        raise ValueError(f"{row_name(i)} sums to {float(m[i].sum()):.12g}, off 1 by "
                         f"{float(off[i]):+.3g} (tolerance {tol:g})")


def _check_grammar(root, binary, lexical, symbols, words, tol):
    """Raise ValueError unless root [S], binary [S,S,S], lexical [S,V] are a CNF grammar."""
    S = root.shape[0] if root.dim() == 1 else 0
    if S == 0 or binary.shape != (S, S, S) or lexical.dim() != 2 or lexical.shape[0] != S \
            or lexical.shape[1] == 0:
        raise ValueError(f"root, binary, lexical must have shapes [S], [S,S,S], [S,V] (S, V >= 1)"
                         f"; got {list(root.shape)}, {list(binary.shape)}, {list(lexical.shape)}")
    if symbols is not None and len(symbols) != S or words is not None and \
            len(words) != lexical.shape[1]:
        raise ValueError(f"symbols / words must name all {S} symbols / {lexical.shape[1]} words")
    names = list(symbols) if symbols is not None else [str(a) for a in range(S)]
    _check_rows(root[None], lambda i: "root", tol)
    _check_rows(torch.cat([binary.reshape(S, -1), lexical], 1),
                lambda a: f"the rules of symbol {a} ({names[a]})", tol)


def _check_span_tasks(span_tasks, max_len, reserved):
    """{name: (start, width)} of valid span tasks (a list pair, as JSON stores it, accepted)."""
    for name, where in (span_tasks or {}).items():
        if not (isinstance(name, str) and name not in reserved and isinstance(where, (list, tuple))
                and [type(v) for v in where] == [int, int] and where[0] >= 0 and where[1] >= 1
                and sum(where) <= max_len):
            raise ValueError(f"span task {name!r}: {where!r} must be (start, width), start >= 0, "
                             f"width >= 1, start + width <= max_len = {max_len}, not A, B or C")
    return {name: tuple(where) for name, where in (span_tasks or {}).items()}


# -------------------------------- what sample() and PCFG.random use (§2.2): samplers, grammar ---

def _cdf_table(p):
    """Inverse-CDF table of the rows of p [R, K]: (row r's CDF + r, flattened: one sorted array
    for all rows; the last non-zero column of each row; K)."""
    R, K = p.shape
    cdf = p.cumsum(1)
    cdf = cdf / cdf[:, -1:]  # ends at exactly 1
    last = K - 1 - (p > 0).flip(1).int().argmax(1)
    return (cdf + torch.arange(R, dtype=torch.float64)[:, None]).reshape(-1), last, K


def _draw_from_rows(table, rows, u):
    """One column drawn from row rows[i] per uniform u[i] in [0, 1); zero-probability columns
    never (the clamp only catches rounding in rows + u near 1)."""
    flat, last, K = table
    idx = torch.searchsorted(flat, rows + u, right=True) - rows * K
    return torch.minimum(idx, last[rows])


def _rewrite(symbol, is_word, length, rows, cols, outcome, S):
    """One round of _grow_sentences: the items at (rows, cols) rewritten by `outcome`, every
    other item moved right past the new ones. Returns the new (symbol, is_word, length)."""
    binary = outcome < S * S
    width = (torch.arange(symbol.shape[1]) < length[:, None]).long()  # items each becomes
    width[rows[binary], cols[binary]] = 2
    dest = width.cumsum(1) - width  # the new position of each item's first replacement
    new_symbol, new_is_word = torch.full_like(symbol, -1), torch.zeros_like(is_word)
    r, c = (width > 0).nonzero(as_tuple=True)  # every item moves; rewritten ones change below
    new_symbol[r, dest[r, c]], new_is_word[r, dest[r, c]] = symbol[r, c], is_word[r, c]
    r, d = rows[~binary], dest[rows[~binary], cols[~binary]]
    new_symbol[r, d], new_is_word[r, d] = outcome[~binary] - S * S, True  # A -> w: the word
    r, d, pair = rows[binary], dest[rows[binary], cols[binary]], outcome[binary]
    new_symbol[r, d], new_symbol[r, d + 1] = pair // S, pair % S  # A -> B C: B, then C
    return new_symbol, new_is_word, width.sum(1)


def _grow_sentences(root_cdf, rule_cdf, S, V, m, T, g):
    """Grow m trees top-down at once (§2.2): (tokens [k, T], pad_id(V) beyond the length;
    lengths [k]) of the k <= m with at most T words. A row holds a tree's frontier (symbols to
    rewrite, words emitted); a round rewrites every pending symbol by one rule (outcome B*S+C:
    symbols B C; S*S+w: word w); a row longer than T words is dropped at once."""
    symbol = torch.full((m, 2 * T), -1, dtype=torch.long)  # <= T items become <= 2T in a round
    is_word = torch.zeros(m, 2 * T, dtype=torch.bool)
    length = torch.ones(m, dtype=torch.long)
    u = torch.rand(m, generator=g, dtype=torch.float64)
    symbol[:, 0] = _draw_from_rows(root_cdf, torch.zeros(m, dtype=torch.long), u)
    pos = torch.arange(2 * T)
    while True:
        rows, cols = ((pos < length[:, None]) & ~is_word).nonzero(as_tuple=True)
        if len(rows) == 0:
            break
        u = torch.rand(len(rows), generator=g, dtype=torch.float64)
        outcome = _draw_from_rows(rule_cdf, symbol[rows, cols], u)
        symbol, is_word, length = _rewrite(symbol, is_word, length, rows, cols, outcome, S)
        short = length <= T
        symbol, is_word, length = symbol[short], is_word[short], length[short]
    tokens = torch.full((len(length), T), pad_id(V), dtype=torch.long)
    valid = pos[:T] < length[:, None]
    tokens[valid] = symbol[:, :T][valid]
    return tokens, length


def _layered_grammar(n_symbols, vocab_size, seed, n_levels, rules_per_symbol, p_lexical,
                     words_per_symbol, upper_words, max_len):
    """root [S], binary [S,S,S], lexical [S,V] (numpy) of PCFG.random's layered grammar."""
    S, V, depth = n_symbols, vocab_size, n_levels
    if not (2 <= depth <= S and 2 ** (depth - 1) <= max_len and 0 <= p_lexical < 1):
        raise ValueError(f"PCFG.random: need 2 <= n_levels <= n_symbols, 2^(n_levels-1) <= "
                         f"max_len, 0 <= p_lexical < 1; got {depth}, {S}, {max_len}, {p_lexical}")
    rng = np.random.default_rng(seed)
    level = np.array_split(np.arange(S), depth)  # the first S % depth levels one symbol more
    root, binary, lexical = np.zeros(S), np.zeros((S, S, S)), np.zeros((S, V))
    root[level[0]] = rng.dirichlet(np.ones(len(level[0])))
    for i in range(depth - 1):
        nxt = level[i + 1]
        n_pairs = len(nxt) ** 2
        k = min(rules_per_symbol, n_pairs)
        p_lex = 0.0 if i == 0 else p_lexical
        for a in level[i]:
            pick = rng.choice(n_pairs, size=k, replace=False)
            binary[a, nxt[pick // len(nxt)], nxt[pick % len(nxt)]] = \
                (1 - p_lex) * rng.dirichlet(np.ones(k))
            if p_lex > 0:
                w = rng.choice(V, size=min(upper_words, V), replace=False)
                lexical[a, w] = p_lex * rng.dirichlet(np.ones(len(w)))
    last = level[-1]
    for a in last:
        w = rng.choice(V, size=min(words_per_symbol, V), replace=False)
        lexical[a, w] = rng.dirichlet(np.full(len(w), 0.5))
    # every word reachable: a word no last-level symbol emits gets a small share of one
    for w in np.nonzero(lexical[last].sum(0) == 0)[0]:
        a = rng.choice(last)
        lexical[a, w] = lexical[a].mean()
        lexical[a] /= lexical[a].sum()
    return root, binary, lexical


# ========================================================================== the HMM (§2.2) ===

def hmm_forward_backward(init, trans, emit, tokens, observed):
    """Pr(h_t = h | x_-t) [n, T, S] float64: the hidden state at each position t given all the
    other words, by one forward-backward pass (§2 and App. A.2 name the Viterbi algorithm: a
    max over paths, where the conditional needs the sum over them that forward-backward takes).
    The masked-token conditional: Pr(x_t = w | x_-t) = Σ_h Pr(h_t = h | x_-t) emit[h, w].

    init [S], trans [S, S] (rows: from-state), emit [S, V]; tokens [n, T] word ids; observed
    [n, T] bool, False where a word is unobserved (masked, or past the sentence's end): its
    emission factor is e_t(h) = 1 (the word is summed out), else e_t(h) = emit[h, x_t]. With
    each message normalised to sum 1 over h (the scale cancels):
        alpha_1 = init,  alpha_{t+1}(h') ∝ Σ_h alpha_t(h) e_t(h) trans[h, h']  ∝ Pr(h_t, x_<t)
        beta_T = 1,  beta_t(h) ∝ Σ_h' trans[h, h'] e_{t+1}(h') beta_{t+1}(h')  ∝ Pr(x_>t | h_t)
        Pr(h_t = h | x_-t) ∝ alpha_t(h) beta_t(h)                  (x_t's own factor left out)
    Where the other words are impossible, Pr(x_-t) = 0, the row is NaN (0/0), not zero (at
    every t, for a sentence that no change of one word makes possible)."""
    # BEGIN EXERCISE hmm_conditional
    n, T = tokens.shape
    e = torch.where(observed[..., None], emit.T[tokens], 1.0)  # [n, T, S]
    alpha, beta = torch.empty_like(e), torch.empty_like(e)
    alpha[:, 0] = init
    for t in range(T - 1):
        a = alpha[:, t] * e[:, t]
        alpha[:, t + 1] = (a / a.sum(1, keepdim=True)) @ trans
    beta[:, T - 1] = 1.0
    for t in range(T - 1, 0, -1):
        b = (e[:, t] * beta[:, t]) @ trans.T
        beta[:, t - 1] = b / b.sum(1, keepdim=True)
    rest = alpha * beta
    return rest / rest.sum(-1, keepdim=True)
    # END EXERCISE hmm_conditional


def hmm_state_posterior(init, trans, emit, tokens, observed):
    """Pr(h_t = h | x) [n, T, S] float64, the posterior of every hidden state given the whole
    sentence (arguments as hmm_forward_backward). The Bayes label of the paper's task-k
    (task-6, task-10; App. A.1) is its argmax at t = k. By Bayes' rule on x_t:
        Pr(h_t = h | x) ∝ Pr(h_t = h | x_-t) e_t(h),   e_t(h) = emit[h, x_t] (1 if unobserved)."""
    # BEGIN EXERCISE task_label requires hmm_conditional
    rest = hmm_forward_backward(init, trans, emit, tokens, observed)
    post = rest * torch.where(observed[..., None], emit.T[tokens], 1.0)
    return post / post.sum(-1, keepdim=True)
    # END EXERCISE task_label


class HMM:
    """A hidden Markov model language (paper §2.2, App. A.1): h_1 ~ init, h_{t+1} ~ trans[h_t],
    word x_t ~ emit[h_t], `length` words. init [S], trans [S, S], emit [S, V]: arrays whose
    rows are probability distributions. Task "k" classifies the k-th hidden state (1-based)."""

    def __init__(self, init, trans, emit, length=16):
        init, trans, emit = (_as_float64(init, "HMM init"), _as_float64(trans, "HMM trans"),
                             _as_float64(emit, "HMM emit"))
        S = init.numel()
        if init.dim() != 1 or S == 0 or trans.shape != (S, S) or emit.dim() != 2 \
                or emit.shape[0] != S or emit.shape[1] == 0:
            raise ValueError(f"HMM: init, trans, emit must have shapes [S], [S,S], [S,V] (S, V >= "
                             f"1); got {list(init.shape)}, {list(trans.shape)}, {list(emit.shape)}")
        if int(length) != length or length < 1:
            raise ValueError(f"HMM: length must be a positive integer; got {length!r}")
        _check_rows(init[None], lambda i: "HMM init", 1e-8)
        _check_rows(trans, lambda i: f"HMM trans row {i} (transitions out of state {i})", 1e-8)
        _check_rows(emit, lambda i: f"HMM emit row {i} (emissions of state {i})", 1e-8)
        self.init, self.trans, self.emit = [     # rows renormalised: spec() round-trips
            torch.where((m.sum(-1, keepdim=True) - 1).abs() > 1e-12, m / m.sum(-1, keepdim=True), m)
            for m in (init, trans, emit)]
        self.n_states, self.vocab_size = self.emit.shape
        self.max_len = int(length)
        self._cdf_init, self._cdf_trans, self._cdf_emit = (
            _cdf_table(self.init[None]), _cdf_table(self.trans), _cdf_table(self.emit))

    @classmethod
    def random(cls, n_states=100, vocab_size=200, seed=0, n_blocks=4, length=16,
               trans_concentration=0.5, emit_concentration=0.2):
        """Random block-diagonal HMM (§2.2: "random block-diagonal stochastic matrices"): states
        and words cut into `n_blocks` contiguous blocks; block b's states move among themselves
        and emit block b's words; each row's non-zero part a Dirichlet(concentration) draw
        (numpy, `seed`; below 1: sparse, peaked rows); init uniform."""

        if not (1 <= n_blocks <= min(n_states, vocab_size) and min(trans_concentration,
                                                                     emit_concentration) > 0):
            raise ValueError("HMM.random: need 1 <= n_blocks <= min(S, V), concentrations > 0")

        rng = np.random.default_rng(seed)
        states = np.array_split(np.arange(n_states), n_blocks)
        words = np.array_split(np.arange(vocab_size), n_blocks)
        trans, emit = np.zeros((n_states, n_states)), np.zeros((n_states, vocab_size))
        for hs, ws in zip(states, words):
            trans[hs[:, None], hs] = rng.dirichlet(np.full(len(hs), trans_concentration), len(hs))
            emit[hs[:, None], ws] = rng.dirichlet(np.full(len(ws), emit_concentration), len(hs))
        trans /= trans.sum(1, keepdims=True)   # tiny concentrations underflow: renormalised
        emit /= emit.sum(1, keepdims=True)
        return cls(np.full(n_states, 1.0 / n_states), trans, emit, length=length)

    def sample(self, n, length=None, seed=0):
        """n sentences: (tokens [n, T], lengths [n] (all T), hidden states [n, T]), T = length
        (default max_len), by inverse-CDF sampling vectorised over sentences."""
        T = self.max_len if length is None else int(length)
        g = torch.Generator().manual_seed(int(seed))
        u = torch.rand(2 * T, n, generator=g, dtype=torch.float64)
        states = torch.empty(T, n, dtype=torch.long)
        states[0] = _draw_from_rows(self._cdf_init, torch.zeros(n, dtype=torch.long), u[0])
        for t in range(1, T):
            states[t] = _draw_from_rows(self._cdf_trans, states[t - 1], u[t])
        tokens = _draw_from_rows(self._cdf_emit, states.reshape(-1), u[T:].reshape(-1))
        return (tokens.reshape(T, n).T.contiguous(), torch.full((n,), T, dtype=torch.long),
                states.T.contiguous())

    def sentences(self, n, seed=0):
        """(tokens [n, T], lengths [n]) of n sentences (all of length T)."""
        return self.sample(n, seed=seed)[:2]

    def mlm_conditional(self, tokens, lengths=None):
        """Exact Pr(x_t = w | x_-t) [n, T, V] float64 = Σ_h Pr(h_t = h | x_-t) emit[h, w]
        (§2.1, App. A.1; hmm_forward_backward; rows sum to 1 as emit's do). Zero at t >= length;
        mask_id(V) words are summed out, so masked model inputs can be passed as they are."""
        p, valid = self._posterior(hmm_forward_backward, tokens, lengths)
        return torch.where(valid[..., None], p @ self.emit, 0.0)

    def state_posterior(self, tokens, lengths=None):
        """Pr(h_t = h | x) [n, T, S] float64 (hmm_state_posterior; also past the length)."""
        return self._posterior(hmm_state_posterior, tokens, lengths)[0]

    def _posterior(self, posterior, tokens, lengths):
        """(posterior(...) of the observed words, valid [n, T]); a ValueError if Pr(x_-t) = 0."""
        tokens, lengths, valid = _check_sentences("HMM", tokens, lengths, self.vocab_size)
        observed = valid & (tokens != mask_id(self.vocab_size))
        p = posterior(self.init, self.trans, self.emit, torch.where(observed, tokens, 0), observed)
        _refuse(p.isnan().any(2).any(1), torch.arange(len(p)), "HMM: ")
        return p, valid

    @property
    def tasks(self):
        """The paper's task-6 and task-10 (any "k" in 1..T is accepted)."""
        return [k for k in ("6", "10") if int(k) <= self.max_len]

    def n_classes(self, task):
        """Task-k is an n_states-way classification."""
        self._task_position(task)
        return self.n_states

    def task_data(self, task, n, seed=0):
        """(tokens, lengths, labels [n]) for task-k on the sentences of sentences(n, seed): the
        Bayes label argmax_h Pr(h_k = h | x)."""
        t = self._task_position(task)
        tokens, lengths = self.sentences(n, seed=seed)
        return tokens, lengths, self.state_posterior(tokens)[:, t].argmax(-1)

    def _task_position(self, task):
        k = str(task)
        if not (k.isdigit() and 1 <= int(k) <= self.max_len):
            raise ValueError(f"HMM: unknown task {task!r}; valid tasks are '1'..'{self.max_len}' "
                             f"(the k-th hidden state; paper: {self.tasks})")
        return int(k) - 1

    def spec(self):
        """Plain-Python description; language_from_spec(spec) rebuilds this HMM exactly."""
        return {"kind": "hmm", "length": self.max_len, "init": self.init.tolist(),
                "trans": self.trans.tolist(), "emit": self.emit.tolist()}

    def __repr__(self):
        return f"HMM(states={self.n_states}, V={self.vocab_size}, T={self.max_len})"


# ========================================================================= the PCFG (§2.2) ===

def pcfg_leaves(lexical, tokens):
    """leaf [n, T, S]: leaf[:, t, A] = Pr(A -> x_t) = lexical[A, x_t]; where x_t is mask_id(V),
    Σ_w lexical[A, w] (the masked word summed out)."""
    V = lexical.shape[1]
    leaf = lexical.T[tokens.clamp(0, V - 1)]
    return torch.where((tokens == mask_id(V))[..., None], lexical.sum(1), leaf)


def inside(binary, leaf):
    """Inside pass over sentences of one length T (App. A.1), in probability space.

    binary [S, S, S]: binary[A, B, C] = Pr(A -> B C); leaf [n, T, S] (pcfg_leaves). Returns
    chart [n, T+1, T+1, S], chart[:, i, j, A] = Pr(A generates x_i .. x_{j-1}) for the span
    [i, j), 0 <= i < j <= T (zero elsewhere), filled by increasing width j - i:
        chart[i, i+1, A] = leaf[i, A]
        chart[i, j, A] = Σ_{k=i+1}^{j-1} Σ_{B,C} binary[A, B, C] chart[i, k, B] chart[k, j, C]
    Pr(x) = Σ_A root[A] chart[0, T, A]. The chart has leaf's dtype and device (float64 from
    pcfg_leaves); binary and leaf are not modified."""
    # BEGIN EXERCISE inside
    n, T, S = leaf.shape
    chart = leaf.new_zeros(n, T + 1, T + 1, S)
    for i in range(T):
        chart[:, i, i + 1] = leaf[:, i]
    for width in range(2, T + 1):
        for i in range(T - width + 1):
            j = i + width       # k, the split, is einsum's index over the spans [i, k), [k, j)
            chart[:, i, j] = torch.einsum("abc,nkb,nkc->na", binary, chart[:, i, i + 1:j],
                                          chart[:, i + 1:j, j])
    return chart
    # END EXERCISE inside


def outside(root, binary, chart):
    """Outside pass (App. A.1): outer [n, T+1, T+1, S], outer[:, i, j, A] = Pr(the root derives
    x_<i A x_>=j), everything outside the span [i, j) with A over it; `chart` is inside()'s.
        outer[0, T, A] = root[A]
        for each parent span [i, j), widest first, and each split i < k < j:
            outer[i, k, B] += Σ_{A,C} outer[i, j, A] binary[A, B, C] chart[k, j, C]   (left child)
            outer[k, j, C] += Σ_{A,B} outer[i, j, A] binary[A, B, C] chart[i, k, B]   (right child)
    chart[i, j, A] outer[i, j, A] / Pr(x) = Pr(A spans exactly [i, j) | x). outer has chart's
    shape, dtype and device; the inputs are not modified."""
    # BEGIN EXERCISE outside
    n, T = chart.shape[0], chart.shape[1] - 1
    outer = torch.zeros_like(chart)
    outer[:, 0, T] = root
    for width in range(T, 1, -1):
        for i in range(T - width + 1):
            j = i + width       # every split k at once: the children [i, k), [k, j) differ in k
            outer[:, i, i + 1:j] += torch.einsum("na,abc,nkc->nkb", outer[:, i, j], binary,
                                                 chart[:, i + 1:j, j])
            outer[:, i + 1:j, j] += torch.einsum("na,abc,nkb->nkc", outer[:, i, j], binary,
                                                 chart[:, i, i + 1:j])
    return outer
    # END EXERCISE outside


def pcfg_conditional(root, binary, lexical, tokens):
    """Exact Pr(x_t = w | x_-t) [n, T, V] for sentences of one length T (App. A.1); tokens
    [n, T] word ids, mask_id(V) where a word is masked (summed out). The outside score of the
    one-word span [t, t+1) does not involve x_t, so, from inside() and outside() on pcfg_leaves:
        Pr(x_t = w | x_-t) ∝ Σ_A outer[t, t+1, A] lexical[A, w]      (normalised over w)
    in the rules' dtype (float64). Where the other words are impossible, Pr(x_-t) = 0, the row
    is NaN (0/0), not zero (at every t, for a sentence that no change of one word makes possible).
    """
    # BEGIN EXERCISE pcfg_conditional requires inside outside
    t = torch.arange(tokens.shape[1])
    outer = outside(root, binary, inside(binary, pcfg_leaves(lexical, tokens)))
    p = outer[:, t, t + 1] @ lexical  # [n, T, V]
    return p / p.sum(-1, keepdim=True)
    # END EXERCISE pcfg_conditional


class PCFG:
    """A PCFG in Chomsky normal form (paper §2.2, App. A.1): A -> B C with probability
    binary[A,B,C], A -> w with lexical[A,w], the top symbol from `root`; sentences longer than
    `max_len` are rejected when sampling (which leaves Pr(x_t | x_-t) unchanged). Tasks A, B, C
    classify the symbol spanning the first 32, 16, 8 words; `span_tasks` {name: (start, width)} adds
    the symbol spanning exactly words [start, start + width) (0-based start). Probabilities come
    from inside(), outside() and pcfg_conditional(), one sentence length at a time."""

    TASK_SPAN = {"A": 32, "B": 16, "C": 8}  # App. A.1: the span lengths of tasks A, B, C
    MIN_KEPT = 1e-3  # below this share of draws kept, sample and task_data give up: no endless loop

    def __init__(self, root, binary, lexical, max_len=32, symbols=None, words=None, origin=None,
                 tol=1e-6, span_tasks=None):
        root, binary, lexical = (_as_float64(m, "PCFG rules") for m in (root, binary, lexical))
        _check_grammar(root, binary, lexical, symbols, words, tol)
        self.span_tasks = _check_span_tasks(span_tasks, int(max_len), self.TASK_SPAN)
        S, V = root.shape[0], lexical.shape[1]
        self.root, self.binary, self.lexical = root, binary, lexical
        self.n_symbols, self.vocab_size, self.max_len = S, V, int(max_len)
        self.symbols, self.words = symbols and list(symbols), words and list(words)
        self.origin = origin or {}
        # sampling tables: a symbol's rule is one outcome, B*S+C (A -> B C) or S*S+w (A -> w)
        self._rule_cdf = _cdf_table(torch.cat([binary.reshape(S, S * S), lexical], 1))
        self._root_cdf = _cdf_table(root[None])

    @classmethod
    def random(cls, n_symbols=50, vocab_size=200, seed=0, n_levels=6, rules_per_symbol=20,
               p_lexical=0.2, words_per_symbol=None, upper_words=3, max_len=32,
               span_tasks=None):
        """A random layered grammar in the paper's regime (App. A.1: 50 symbols, V = 200,
        length <= 32, depth <= 6), shaped like the authors': a level-l symbol has
        `rules_per_symbol` binary rules into level l+1 (Dirichlet(1) weights, total
        1 - p_lexical) and emits one of `upper_words` words (not the root level); last-level
        symbols emit `words_per_symbol` (default V/4) words, Dirichlet(0.5) (numpy, `seed`)."""
        wps = int(vocab_size) // 4 if words_per_symbol is None else int(words_per_symbol)
        origin = {"random": dict(
            n_symbols=int(n_symbols), vocab_size=int(vocab_size), seed=int(seed),
            n_levels=int(n_levels), rules_per_symbol=int(rules_per_symbol),
            p_lexical=float(p_lexical), words_per_symbol=wps, upper_words=int(upper_words))}

        root, binary, lexical = _layered_grammar(max_len=max_len, **origin["random"])
        return cls(root, binary, lexical, max_len=max_len, origin=origin, span_tasks=span_tasks)

    @classmethod
    def hierarchy(cls, n_per_level=8, rules_per_symbol=4, n_levels=3, words_per_symbol=1,
                  vocab_size=None, seed=0):
        """The Random Hierarchy Model (Cagnetta, Petrini, Tomasini, Favero and Wyart, 2024) as a
        CNF PCFG: levels 0..n_levels of `n_per_level` symbols; the root uniform over level 0; a
        level-l symbol (l < n_levels) has `rules_per_symbol` rules A -> B C of probability 1/m
        onto level l+1, no pair with two parents; a last-level symbol emits `words_per_symbol`
        of `vocab_size` (default n_per_level) words uniformly (symbol i word i when both are
        defaults). Every tree is full binary: sentences have 2^n_levels words (numpy, `seed`)."""
        v, m, k, depth = map(int, (n_per_level, rules_per_symbol, words_per_symbol, n_levels))
        V = v if vocab_size is None else int(vocab_size)
        if not (1 <= m <= v and 1 <= depth <= 5 and 1 <= k <= V):        # distinct pairs: m <= v
            raise ValueError(f"PCFG.hierarchy: need 1 <= rules_per_symbol <= n_per_level, 1 <= "
                             f"n_levels <= 5, 1 <= words_per_symbol <= vocab_size; got {m}, {v}, "
                             f"{depth}, {k}, {V} in that order")
        origin = {"hierarchy": dict(n_per_level=v, rules_per_symbol=m, n_levels=depth,
                                    words_per_symbol=k, vocab_size=V, seed=int(seed))}
        rng = np.random.default_rng(seed)
        S = v * (depth + 1)  # symbol l * v + i is symbol i of level l
        root, binary, lexical = np.zeros(S), np.zeros((S, S, S)), np.zeros((S, V))
        root[:v] = 1 / v
        for level in range(depth):
            pairs = rng.choice(v * v, size=v * m, replace=False).reshape(v, m)
            below = (level + 1) * v
            for i in range(v):
                binary[level * v + i, below + pairs[i] // v, below + pairs[i] % v] = 1 / m
        for i in range(v):
            words = [i] if k == 1 and V == v else rng.choice(V, size=k, replace=False)
            lexical[depth * v + i, words] = 1 / k
        return cls(root, binary, lexical, max_len=2 ** depth, origin=origin)

    def sample(self, n, seed=0, max_len=None):
        """n sentences of at most max_len words: (tokens [n, max_len], pad_id beyond the
        length; lengths [n]); longer trees are dropped (batches drawn until n are kept)."""
        T = self.max_len if max_len is None else int(max_len)
        g = torch.Generator().manual_seed(int(seed))
        toks, lens, got, tries, drawn = [], [], 0, 0, 0
        while got < n:  # next batch: the rest at the kept fraction so far, 20% spare
            m = int(1.2 * (n - got) * drawn / got) if got else n + 64
            m = min(max(64, m), 4 * n + 1000)
            t, l = _grow_sentences(self._root_cdf, self._rule_cdf, self.n_symbols,
                                   self.vocab_size, m, T, g)
            toks.append(t), lens.append(l)
            got, tries, drawn = got + len(l), tries + 1, drawn + m
            if tries > 50 and got < self.MIN_KEPT * drawn:
                raise ValueError(f"fewer than {self.MIN_KEPT:.1%} of sampled sentences have <= "
                                 f"{T} words; raise max_len or use a grammar with shorter "
                                 "sentences")
        return torch.cat(toks)[:n], torch.cat(lens)[:n]

    def sentences(self, n, seed=0):
        """(tokens [n, max_len], lengths [n]) of n sentences (sample)."""
        return self.sample(n, seed=seed)

    def mlm_conditional(self, tokens, lengths):
        """Exact Pr(x_t = w | x_-t) [n, T, V] float64 (pcfg_conditional) for any lengths; zero
        at t >= length; mask_id words are summed out."""
        tokens, lengths = _check_sentences("PCFG", tokens, lengths, self.vocab_size)[:2]
        out = torch.zeros(*tokens.shape, self.vocab_size, dtype=torch.float64)
        for rows, length in self._by_length(lengths):
            p = pcfg_conditional(self.root, self.binary, self.lexical, tokens[rows, :length])
            _refuse(p.isnan().any(2).any(1), rows, "",
                    " under the grammar even with one word masked: no conditional exists")
            out[rows, :length] = p
        return out

    def span_posteriors(self, tokens, lengths):
        """Pr(A spans exactly words [i, j) | x) [n, T+1, T+1, S] float64: the whole chart of
        inside() x outside() / Pr(x) (App. A.1), zero where j > length; what a perfect model of
        the sentence could know of its parse."""
        tokens, lengths = _check_sentences("PCFG", tokens, lengths, self.vocab_size)[:2]
        T = tokens.shape[1]
        out = torch.zeros(len(lengths), T + 1, T + 1, self.n_symbols, dtype=torch.float64)
        for rows, length in self._by_length(lengths):
            chart = inside(self.binary, pcfg_leaves(self.lexical, tokens[rows, :length]))
            z = chart[:, 0, length] @ self.root
            _refuse(z <= 0, rows, "", " under the grammar: no span posterior exists")
            outer = outside(self.root, self.binary, chart)
            out[rows, :length + 1, :length + 1] = chart * outer / z[:, None, None, None]
        return out

    @staticmethod
    def _by_length(lengths):
        """(rows, n_x) for each sentence length n_x: the plain forms take one length at a time."""
        return [((lengths == n_x).nonzero()[:, 0], n_x) for n_x in lengths.unique().tolist()]

    @property
    def tasks(self):
        """A, B, C, then the grammar's span tasks."""
        return list(self.TASK_SPAN) + list(self.span_tasks)

    def n_classes(self, task):
        """Each task is an n_symbols-way classification (paper: 50-way)."""
        self._span_length(task)
        return self.n_symbols

    def task_posterior(self, task, tokens, lengths):
        """Pr(s spans exactly the task's words | x) [n, S] = chart x outer / Pr(x) (outside()):
        words [0, min(32 / 16 / 8, length)) for A / B / C, [start, start + width) for a span
        task (zero if the sentence is shorter); rows sum to Pr(the span is a constituent | x)."""
        span = self._span_length(task)
        tokens, lengths = _check_sentences("PCFG", tokens, lengths, self.vocab_size)[:2]
        start, width = self.span_tasks[task] if span is None else (0, lengths.clamp(max=span))
        end = start + torch.as_tensor(width).expand(len(lengths))
        spans = self.span_posteriors(tokens, lengths)[torch.arange(len(lengths)), start]
        return torch.where((end <= lengths)[:, None], spans[torch.arange(len(lengths)),
                                                            end.clamp(max=tokens.shape[1])], 0.0)

    def task_data(self, task, n, seed=0):
        """(tokens, lengths, labels [n]): the Bayes label argmax_s of task_posterior, on the
        sentences, drawn from `seed` but not those of sentences(n, seed), in which the task's
        span can be a constituent (others are skipped)."""
        self._span_length(task)
        toks, lens, labs, got, tried, rnd = [], [], [], 0, 0, 0
        while got < n:  # rate: the fraction kept so far
            rate = 1.0 if not tried else max(got / tried, 0.05) if got else self.MIN_KEPT
            cap = 22 * n + 10_000 if got else 2_000       # none kept yet: refused in seconds
            m = min(int(1.1 * (n - got) / rate) + 16, cap)
            t, l = self.sentences(m, seed=((seed + 1) * 1000003 + rnd) % 2 ** 63)  # 63 bits
            post = self.task_posterior(task, t, l)
            ok = post.sum(1) > 1e-12
            toks.append(t[ok]), lens.append(l[ok]), labs.append(post[ok].argmax(1))
            got, tried, rnd = got + int(ok.sum()), tried + len(l), rnd + 1
            if got < n and tried >= 2_000 and got < self.MIN_KEPT * tried:  # (almost) never
                raise ValueError(f"task {task!r}: only {got} of {tried:,} sentences have its "
                                 f"span as one constituent; it cannot give {n} examples")
        return torch.cat(toks)[:n], torch.cat(lens)[:n], torch.cat(labs)[:n]

    def _span_length(self, task):
        if task not in self.tasks:
            raise ValueError(f"unknown task {task!r} for {self!r}; valid tasks are {self.tasks}")
        return self.TASK_SPAN.get(task)

    def spec(self):
        """Plain-Python description (rules [A, B, C, p], [A, w, p]): language_from_spec's input."""
        return {"kind": "pcfg", "n_symbols": self.n_symbols, "vocab_size": self.vocab_size,
                "max_len": self.max_len, "root": self.root.tolist(),
                "binary_rules": [[a, b, c, self.binary[a, b, c].item()]
                                 for a, b, c in self.binary.nonzero().tolist()],
                "lexical_rules": [[a, w, self.lexical[a, w].item()]
                                  for a, w in self.lexical.nonzero().tolist()],
                "symbols": self.symbols, "words": self.words, "origin": self.origin,
                **({"span_tasks": {k: list(v) for k, v in self.span_tasks.items()}}
                   if self.span_tasks else {})}

    def __repr__(self):
        return f"PCFG(symbols={self.n_symbols}, V={self.vocab_size}, max_len={self.max_len})"


def mlm_entropy(lang, n=1000, seed=0, batch=500):
    """Optimal MLM loss (§2.1, App. A.4): E_x[(1/n_x) Σ_t H(Pr(. | x_-t))], one uniform mask
    among the n_x words averaged exactly, over lang.sentences(n, seed): (mean, standard error)."""
    tokens, lengths = lang.sentences(n, seed=seed)
    per_sentence = torch.empty(n, dtype=torch.float64)
    for i in range(0, n, batch):
        p = lang.mlm_conditional(tokens[i:i + batch], lengths[i:i + batch])
        h = -(p * p.clamp_min(1e-300).log()).sum(-1)  # [b, T], zero beyond the length
        per_sentence[i:i + batch] = h.sum(1) / lengths[i:i + batch]
    return per_sentence.mean().item(), (per_sentence.std() / math.sqrt(n)).item()


# =========================================== the named languages (train.py --lang, this CLI) ===

HMM_SMALL = dict(n_states=20, vocab_size=50, n_blocks=2, length=16)  # "hmm-small": CPU scale

# The CPU-scale PCFG ("pcfg-small"), which a small transformer saturates on one CPU thread: its
# sentences have <= 8 words, so tasks A, B, C all name the root; task D, the symbol over words
# [2, 4) (0-based), is almost a function of its two words: the negative control beside pcfg-deep.
PCFG_SMALL = dict(n_symbols=10, vocab_size=24, n_levels=4, rules_per_symbol=4,
                  words_per_symbol=12, max_len=8, span_tasks={"D": (2, 2)})

# The hierarchical PCFG ("pcfg-deep"): PCFG.hierarchy, the Random Hierarchy Model, not the paper's
# App. A.1 grammar. Every sentence has 2^3 = 8 words and one parse, so the root (task A) is a
# function of all 8 words, far from any one of them.
PCFG_DEEP = dict(n_per_level=8, rules_per_symbol=4, n_levels=3)

LANGUAGES = {                                   # each a function of the language's seed
    "hmm-small": lambda seed: HMM.random(seed=seed, **HMM_SMALL),   # the CPU experiments'
    "hmm": lambda seed: HMM.random(seed=seed),                    # the paper's: 100 states, V=200
    "pcfg": lambda seed: PCFG.random(seed=seed),                  # the paper's: 50 symbols, V=200
    "pcfg-small": lambda seed: PCFG.random(seed=seed, **PCFG_SMALL),
    "pcfg-deep": lambda seed: PCFG.hierarchy(seed=seed, **PCFG_DEEP),
}


# ================================================================================ plumbing ===

def build_language(name, seed=0):
    """The language `name` of `seed` (LANGUAGES), or the one whose spec() a .json file at `name`
    holds (train.py --lang, this CLI); a one-line ValueError otherwise."""
    if name in LANGUAGES:
        return LANGUAGES[name](seed)
    if not str(name).endswith(".json"):
        raise ValueError(f"unknown language {name!r}; choose one of {', '.join(LANGUAGES)} or "
                         f"give a .json file holding a spec()")
    try:
        with open(name, encoding="utf-8") as f:
            return language_from_spec(json.load(f))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{name}: not a readable language spec "
                         f"({type(e).__name__}: {first_line(e)})") from None


def language_from_spec(spec):
    """Rebuild a language from its .spec() (what checkpoints store); ValueError if malformed."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in ("hmm", "pcfg"):
        raise ValueError(f"unknown language kind {kind!r}; expected one of ['hmm', 'pcfg']")
    try:
        if kind == "hmm":
            _check_count(spec["length"], "length")
            return HMM(spec["init"], spec["trans"], spec["emit"], length=spec["length"])
        S, V, _ = (_check_count(spec[k], k) for k in ("n_symbols", "vocab_size", "max_len"))
        binary, lexical = (torch.zeros(shape, dtype=torch.float64) for shape in ((S, S, S), (S, V)))
        for table, rules in ((binary, spec["binary_rules"]), (lexical, spec["lexical_rules"])):
            for rule in rules:
                *ids, p = rule
                if len(ids) != table.dim() or not all(type(i) is int and 0 <= i < d
                                                      for i, d in zip(ids, table.shape)):
                    raise ValueError(f"rule {rule!r} must be {table.dim()} ids (symbols < {S}, "
                                     f"words < {V}) and a probability")
                if table[tuple(ids)] != 0:
                    raise ValueError(f"rule {ids} is listed twice")
                table[tuple(ids)] = float(p)
        return PCFG(spec["root"], binary, lexical, max_len=spec["max_len"],
                    symbols=spec.get("symbols"), words=spec.get("words"),
                    origin=spec.get("origin"), span_tasks=spec.get("span_tasks"))
    except KeyError as e:
        raise ValueError(f"{kind} spec lacks the entry {e}") from None
    except (TypeError, IndexError, ValueError) as e:
        raise ValueError(f"{kind} spec is malformed: {e}") from None


def _check_count(v, name):
    if type(v) is not int or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return v


# ========================= the CLI: flag types and whole writes, shared with later scripts ===

SEED_MAX = 2**32 - 1  # numpy's largest seed


def int_flag(lo, hi=None):
    """An argparse type: an integer in lo..hi (None: no upper bound), else a usage error."""
    def integer(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi} (got {value})" if hi is not
                                             None else f"must be >= {lo} (got {value})")
        return value
    integer.metavar = "N"                                 # what --help shows
    return integer


def float_flag(lo=None, hi=None, open_lo=False):
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with open_lo; None: unbounded)."""
    def number(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        below = lo is not None and (value <= lo if open_lo else value < lo)
        if not math.isfinite(value) or below or hi is not None and value > hi:
            where = ("a finite number" if lo is None else f"{'(' if open_lo else '['}{lo}, "
                     + (f"{hi}]" if hi is not None else "inf), finite"))
            raise argparse.ArgumentTypeError(f"must be in {where} (got {text})")
        return value
    number.metavar = "X"
    return number


def write_whole(path, write, mode="wb"):
    """Write a file whole or not at all: write(f) into path + ".tmp", renamed over `path`; on any
    failure (a full disk, Ctrl-C) the temporary file is removed: an older `path` stays."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None   # the file, named
        raise


def append_line(path, line):
    """Append one line (a JSON row) whole or not at all (on failure the file is cut back); a
    last line cut short before (by a killed process: it does not parse) is removed first, a
    whole last row without its newline (an edit by hand) keeps its row and gains the newline."""
    with open(path, "ab+", buffering=0) as f:                  # reads anywhere, writes at the end
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - 1, 0))
        prefix = b""
        if size and f.read(1) != b"\n":
            f.seek(0)
            start = f.read().rfind(b"\n") + 1                  # where the last line starts
            f.seek(start)
            try:
                json.loads(f.read())
                prefix = b"\n"                                 # a whole row: keep it
            except ValueError:
                size = start
                os.ftruncate(f.fileno(), size)
                print(f"{path}: removed its half-written last line", file=sys.stderr)
        try:
            rest = memoryview(prefix + (line.rstrip("\n") + "\n").encode())
            while rest:                               # a write may land in part, then fail
                rest = rest[f.write(rest):]
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), size)
            if isinstance(e, OSError) and e.errno is not None:
                raise OSError(e.errno, e.strerror, str(path)) from None
            raise


def save_whole(path, obj):
    """torch.save(obj) to `path` by write_whole (torch.save would hide a failed write)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_whole(path, lambda f: f.write(buffer.getbuffer()))


def threads_flag(parser):
    """Every script's --threads: torch threads per process (one: two jobs share two cores)."""
    parser.add_argument("--threads", type=int_flag(1), default=1,
                        help="torch threads per process (default 1)")


def first_line(e):
    """The first line of an exception's message, whole: one-line errors."""
    return str(e).splitlines()[0] if str(e) else ""


def is_command_line(script):
    """Whether `script` is this process's own command line, not code that others call."""
    return os.path.basename(getattr(sys.modules["__main__"], "__file__", None) or "") == script


def command(script, body, sizes, saved):
    """Run body() as `script`'s command line, every failure (bad input, failed write or
    allocation: lower `sizes`, Ctrl-C, SIGTERM) one line; saved() says what is saved. Called
    from other code (a notebook, a test), SIGINT and SIGTERM are left as they were found."""
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    own = is_command_line(script)
    signal.signal(signal.SIGTERM, signal.default_int_handler)        # SIGTERM as Ctrl-C
    try:
        return body()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)                 # a second Ctrl-C: quiet
        sys.exit(f"{script}: interrupted; {saved()}")
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"{script}: error: {first_line(e)}")
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "alloc" not in str(e):    # not a memory error: a bug
            raise
        said = first_line(e) or "MemoryError"
        said = said if len(said) <= 80 else said[:80].rsplit(" ", 1)[0] + " ..."   # whole words
        sys.exit(f"{script}: cannot allocate memory ({said}): lower {sizes}; {saved()}")
    except OSError as e:              # a full disk, a file-size limit, a folder refusing writes
        sys.exit(f"{script}: could not write {e.filename or 'a file'}: {e.strerror or e} (no "
                 f"file is left half-written); {saved()}")
    finally:
        if not own:                   # the caller goes on: its next Ctrl-C must still work
            for sig, handler in found.items():
                signal.signal(sig, handler)


def read_rows(path, needs=("step",)):
    """The rows of a JSON-lines file ([] if none); a last line cut short is dropped, another that
    is not an object with the keys `needs` (a whole-number step) is a one-line ValueError."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(no, line) for no, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file of JSON rows; move it away") from None
    rows = []
    for no, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if no == lines[-1][0] and not line.endswith("\n"):
                print(f"{path}: dropped its half-written last line", file=sys.stderr)
                break
            raise ValueError(f"{path}, line {no}: not a JSON row; delete that line") from None
        if not isinstance(row, dict) or not all(k in row for k in needs):
            raise ValueError(f"{path}, line {no}: not a row with {', '.join(needs)}")
        if type(row.get("step", 0)) is not int:
            raise ValueError(f"{path}, line {no}: its step {row['step']!r} is not a whole "
                             f"number; delete that line")
        rows.append(row)
    return rows


def unwritable(path, flag, folder=False):
    """Why file (or folder) `path` cannot be written, a message naming `flag`, or None."""
    path = os.path.abspath(path)
    if os.path.exists(path) and os.path.isdir(path) != folder:
        return f"{flag} {path} is a {'file' if folder else 'folder'}; it must be a " \
               f"{'folder' if folder else 'file'}"
    parent = path if folder else os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path} cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK) or os.statvfs(parent).f_flag & os.ST_RDONLY:
        return f"{flag} {path} cannot be written: {parent} is not writable"
    return None


def _not_data_file(path):
    """A message if `path` is a file that main() did not write (a checkpoint, say), else None."""
    if not os.path.isfile(path):
        return None
    with contextlib.suppress(Exception):                     # an unreadable file is not ours
        old = torch.load(path, weights_only=True)
        if isinstance(old, dict) and {"spec", "tokens", "lengths", "labels"} <= set(old):
            return None
    return f"--out {path} exists and is not a data.py file; give another name (nothing written)"


def main(argv=None):
    """Command line (App. A.1): sample one language's sentences, task labels and spec."""
    spec = [a.split("=")[-1] for a in (argv if argv is not None else sys.argv[1:])
            if a.endswith(".json")]                             # a spec file: LANG F.json
    command("data.py", lambda: sample_to_file(argv),
            f"--n or the size of the language in {spec[0]}" if spec else
            "--n or the language's size",
            lambda: "nothing written (--out is written whole at the end); run it again")


def sample_to_file(argv=None):
    """main() without its one-line exits."""
    p = argparse.ArgumentParser(description="Sample a synthetic language (App. A.1): sentences, "
                                "task labels and the generator's spec, for torch.load(FILE, "
                                "weights_only=True).")
    a = p.add_argument
    a("kind", help=f"one of {', '.join(LANGUAGES)}, or a spec .json file")
    a("--n", type=int_flag(1, 10 ** 8), default=10000, help="number of sentences")
    a("--seed", type=int_flag(0, SEED_MAX), default=0, help="seed of the language and the sample")
    a("--out", required=True, help="output file (.pt)")
    a("--conditionals", action="store_true",
      help="also store the exact conditionals Pr(x_t | x_-t) [n, T, V] (large)")
    threads_flag(p)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if bad := unwritable(args.out, "--out") or _not_data_file(args.out):  # before minutes of work
        p.error(bad)
    try:
        lang = build_language(args.kind, args.seed)
    except ValueError as e:
        p.error(str(e))
    try:
        tokens, lengths = lang.sentences(args.n, seed=args.seed)
    except ValueError as e:  # a grammar whose sentences are (almost) never short enough
        p.error(f"{args.kind}: {e}")
    print(f"{lang!r}: {args.n} sentences, mean length {lengths.double().mean():.2f}")
    out = dict(spec=lang.spec(), seed=args.seed, tokens=tokens, lengths=lengths, labels={})
    for task in lang.tasks:  # seed + 1: not the sentences above; all tasks draw from one stream
        t, l, y = lang.task_data(task, args.n, seed=args.seed + 1)
        out["labels"][task] = {"tokens": t, "lengths": l, "labels": y}
        print(f"task {task}: {len(torch.unique(y))} distinct labels", flush=True)
    if args.conditionals:
        out["conditionals"] = torch.cat([lang.mlm_conditional(tokens[i:i + 500], lengths[i:i + 500])
                                         for i in range(0, args.n, 500)])
    h, se = mlm_entropy(lang, n=min(args.n, 1000), seed=args.seed + 2)
    print(f"optimal MLM loss (entropy): {h:.4f} +- {se:.4f} nats")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_whole(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
