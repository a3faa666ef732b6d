"""Synthetic languages with exact masked-token conditionals (paper §2.2, App. A.1).

Everything else in this project rests on knowing the true conditional Pr(x_t = w | x_-t):
it gives the optimal MLM loss (its entropy; the "saturation regime" of §2.1), the exact KL of
a model to the truth (App. A.4) and the Bayes labels of the downstream tasks.

Three languages share one interface (see "the languages" below):

- `HMM`: a hidden Markov model (the paper's HMM set; every CPU experiment uses one), exact
  conditionals by forward-backward.
- `PCFG`: a probabilistic context-free grammar in Chomsky normal form (the paper's PCFG set),
  exact conditionals by inside-outside; `PCFG.random()` is a layered sparse grammar in the
  paper's regime (50 symbols, 200 words, length <= 32), `PCFG.from_rules()` reads the rule files
  the paper's authors released.
- `TeacherLM`: sentences from a small random causal transformer (stands in for the OPT set).

Special token ids (defined once, here): words are 0..V-1, `mask_id(V) == V`,
`pad_id(V) == V + 1`; a model over V words has vocab_size V + N_SPECIAL.

Banners mark [paper] code (the exact conditionals, the tasks, the samplers of the generative
stories) apart from [plumbing] (validation, spec round trips, the registry, the CLI).

Run:
    python data.py pcfg --n 1000 --seed 0 --out pcfg.pt      # sentences + task A/B/C labels
    python data.py pcfg --n 1000 --rules rule_deep_mlm.txt --out a.pt   # authors' grammar
    python data.py pcfg --n 200 --conditionals --out p.pt    # also the exact conditionals
    python data.py pcfg-small --n 1000 --out s.pt            # the CPU-scale PCFG (+ task D)
    python data.py hmm --n 10000 --out hmm.pt
The first takes about 11 s on one thread, mostly the task labels (`--threads`, default 1: on a
shared 2-core machine more threads were slower).
It prints the language, the mean length, the optimal MLM loss (entropy) and where it wrote a
dataset that `torch.load(FILE, weights_only=True)` reads back, generator spec included.
"""
import argparse
import inspect
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# ----------------------------------------------------------------- [plumbing] configuration ---

N_SPECIAL = 2  # [MASK] and [PAD] follow the V words

# The CPU-scale HMM ("hmm-small"): V=50, 20 states in 2 blocks, T=16 (entropy 2.8665 nats).
HMM_SMALL = dict(n_states=20, vocab_size=50, n_blocks=2, length=16)

# The CPU-scale PCFG ("pcfg-small" in train.py and the CLI): a grammar a 27k-parameter
# transformer saturates (KL <= 0.02 nats) in minutes on one CPU thread, where the paper's needs
# GPUs. Four levels keep sentences <= 8 words, so tasks A, B, C all name the root; task D, the
# symbol spanning words 3-4, lies two levels below it. Twelve words per last-level symbol
# (default V/4 = 6) make those symbols share words, so D depends less on the words alone: a
# linear probe on one-hot words gets 0.78 on it (0.93 with 6 words per symbol). The search for
# it (tf-1m, lr 5e-3, batch 512, one thread; KL at 1 / 3 / 5 / 10 minutes): this grammar 0.050 /
# 0.025 / 0.019 / 0.015; 6 words per symbol 0.047 / 0.023 / 0.017 / 0.012; 12 symbols 0.128 /
# 0.085 (stopped); lr 3e-3 0.050 / 0.029 / 0.023; batch 256 0.049 / 0.028; width 64 (tf-2m)
# 0.085 / 0.035; 3 layers 0.046 / 0.021.
PCFG_SMALL = dict(n_symbols=10, vocab_size=24, n_levels=4, rules_per_symbol=4,
                  words_per_symbol=12, max_len=8, span_tasks={"D": (2, 2)})


# ------------------------------------------------------ [paper] special ids, masking (§2.1) ---

def mask_id(V):
    """Id of the [MASK] token for a language with V words."""
    return V


def pad_id(V):
    """Id of the [PAD] token (positions >= a sentence's length)."""
    return V + 1


def mask_one(tokens, lengths, V, generator=None):
    """Mask one position per sentence, uniform among its words (the paper's default, §2.1):
    returns (inputs with mask_id(V) there, targets [n] = the masked words, positions [n])."""
    n = tokens.shape[0]
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    positions = (u * lengths).long().clamp(max=lengths - 1)
    inputs = tokens.clone()
    targets = tokens[torch.arange(n), positions].clone()
    inputs[torch.arange(n), positions] = mask_id(V)
    return inputs, targets, positions


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


# ================================================================================ languages ===
# Every language (HMM, PCFG, TeacherLM below) has:
#   .vocab_size, .max_len              V words (ids 0..V-1); the longest sentence
#   .sentences(n, seed)                (tokens [n, max_len] long, pad_id(V) after each length,
#                                       lengths [n] long): fresh sentences
#   .sample(n, seed)                   (tokens, lengths, *latents): the same draw plus the hidden
#                                       variables the tasks ask for (HMM: states, teacher: topics)
#   .mlm_conditional(tokens, lengths)  exact Pr(x_t = w | x_-t) [n, T, V] float64, 0 past the
#                                       length; mask_id words are summed out (not the teacher's)
#   .tasks, .n_classes(task), .task_data(task, n, seed)   downstream tasks: (tokens, lengths,
#                                       Bayes labels [n])
#   .spec(), cls.from_spec(spec), cls.random(seed=...)     plain-Python description (what
#                                       checkpoints store) and back; the seeded random language
# and, where they are cheap, log_prob (PCFG, teacher) and posteriors over the latent variables
# (state_posterior; span_, constituent_, task_posterior; topic_posterior).

# [plumbing] The named languages (train.py --lang and this CLI take the same names), each a
# function of the language's seed.
LANGUAGES = {
    "hmm-small": lambda seed: HMM.random(seed=seed, **HMM_SMALL),   # the CPU experiments'
    "hmm": lambda seed: HMM.random(seed=seed),                    # the paper's: 100 states, V=200
    "pcfg": lambda seed: PCFG.random(seed=seed),                  # the paper's: 50 symbols, V=200
    "pcfg-small": lambda seed: PCFG.random(seed=seed, **PCFG_SMALL),   # CPU scale (PCFG_SMALL)
    "teacher": lambda seed: TeacherLM.random(seed=seed),          # stands in for OPT's text
}


def build_language(name, seed=0, rules=None):
    """The named language of `seed` (LANGUAGES), or the PCFG read from a rule file."""
    if rules and name != "pcfg":
        raise ValueError("--rules only applies to pcfg")
    if rules:
        return PCFG.from_rules(Path(rules))
    return LANGUAGES[name](seed)


def language_from_spec(spec):
    """Rebuild a language from its .spec() (what checkpoints store)."""
    kinds = {"hmm": HMM, "pcfg": PCFG, "teacher": TeacherLM}
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in kinds:
        raise ValueError(f"unknown language kind {kind!r}; expected one of {sorted(kinds)}")
    return kinds[kind].from_spec(spec)


def mlm_entropy(lang, n=1000, seed=0, batch=500):
    """Optimal MLM loss (paper §2.1; App. A.4): E_x[(1/n_x) sum_t H(Pr(. | x_-t))] for one mask
    per sentence placed uniformly among its n_x positions, averaged exactly over the position,
    estimated over n fresh sentences; returns (mean, standard error) in nats."""
    tokens, lengths = lang.sentences(n, seed=seed)
    per_sentence = torch.empty(n, dtype=torch.float64)
    for i in range(0, n, batch):
        p = lang.mlm_conditional(tokens[i:i + batch], lengths[i:i + batch])
        h = -(p * p.clamp_min(1e-300).log()).sum(-1)  # [b, T], zero beyond the length
        per_sentence[i:i + batch] = h.sum(1) / lengths[i:i + batch]
    return per_sentence.mean().item(), (per_sentence.std() / math.sqrt(n)).item()


# ------------------------------------------------- [plumbing] shared by the languages below ---

def _as_float64(x, name):
    """`x` (tensor, numpy array or nested list) as a float64 CPU tensor, or a clear error."""
    try:
        if torch.is_tensor(x):
            return x.detach().to("cpu", torch.float64).clone()
        return torch.as_tensor(np.asarray(x, dtype=np.float64))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected a numeric array, got {type(x).__name__} ({e})")


def _check_sentences(who, tokens, lengths, V, max_width=None, no_mask=None):
    """Validate a batch: (tokens [n, T] long, lengths [n] long, valid [n, T] = position < length).
    lengths None means all T. Ids past a sentence's length are ignored (padding); inside it each
    must be a word 0..V-1 or mask_id(V), an unobserved word (refused, saying `no_mask`, when
    the language cannot sum one out)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 2 or max_width is not None and tokens.shape[1] > max_width:
        limit = "" if max_width is None else f" with T <= {max_width}"
        raise ValueError(f"{who}: tokens must be [n, T]{limit}; got shape {list(tokens.shape)}")
    n, T = tokens.shape
    lengths = torch.full((n,), T) if lengths is None else torch.as_tensor(lengths)
    lengths = lengths.long()
    if lengths.shape != (n,) or (lengths < 1).any() or (lengths > T).any():
        got = (f"values {lengths.min().item()}..{lengths.max().item()}"
               if lengths.shape == (n,) else f"shape {list(lengths.shape)}")
        raise ValueError(f"{who}: lengths must be [n] = [{n}] with 1 <= length <= T = {T} "
                         f"(the width of tokens); got {got}")
    valid = torch.arange(T) < lengths[:, None]
    masked = valid & (tokens == mask_id(V))
    if no_mask and masked.any():
        i, t = (int(v) for v in masked.nonzero()[0])
        raise ValueError(f"{who}: sentence {i} position {t} holds mask_id; {no_mask}")
    bad = valid & ~masked & ((tokens < 0) | (tokens >= V))
    if bad.any():
        i, t = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{who}: sentence {i} position {t} holds id {int(tokens[i, t])}, not a "
                         f"word id in 0..{V - 1}" + ("" if no_mask else " or mask_id")
                         + " (pad only beyond the length)")
    return tokens, lengths, valid


def _connected_components(link):
    """Component label of each node of an undirected graph given by a symmetric boolean
    adjacency matrix [N, N]: the smallest node id in its component."""
    label = torch.arange(link.shape[0])
    while True:  # each node takes its neighbours' smallest label until nothing changes
        new = torch.minimum(label, torch.where(link, label[None, :], len(label)).min(1).values)
        if torch.equal(new, label):
            return label
        label = new


def _cdf_table(p):
    """Inverse-CDF sampling table for the rows of p [R, K] (non-negative, rows not all zero):
    (row r's CDF + r, flattened; last non-zero column of each row; K). Offsetting row r by r
    makes one sorted array for all rows, so a batch of draws from different rows is a single
    searchsorted."""
    R, K = p.shape
    cdf = p.cumsum(1)
    cdf = cdf / cdf[:, -1:]  # ends at exactly 1
    last = K - 1 - (p > 0).flip(1).int().argmax(1)
    return (cdf + torch.arange(R, dtype=torch.float64)[:, None]).reshape(-1), last, K


def _draw_from_rows(table, rows, u):
    """One column drawn from row rows[i] of the table's matrix per uniform u[i] in [0, 1).
    Zero-probability columns are never drawn (their CDF equals the previous column's); the
    clamp to the row's last non-zero column only catches rounding in rows + u near 1."""
    flat, last, K = table
    idx = torch.searchsorted(flat, rows + u, right=True) - rows * K
    return torch.minimum(idx, last[rows])


# ====================================================================================== HMM ===

# -------------------------------------------------------------------- [plumbing] validation ---

def _hmm_check_rows(m, name, what, tol=1e-8):
    """Raise ValueError unless every row of `m` [R,K] is a probability distribution; the
    message names the row, e.g. "trans row 3 (transitions out of state 3)"."""
    def where(i):
        return f"HMM: {name} ({what})" if m.shape[0] == 1 else f"HMM: {name} row {i} ({what} {i})"
    if torch.isnan(m).any():
        raise ValueError(f"{where(int(torch.isnan(m).any(1).nonzero()[0]))} contains NaN")
    if (m < 0).any():
        i = int((m < 0).any(1).nonzero()[0])
        raise ValueError(f"{where(i)} has a negative entry (min {float(m[i].min()):.3g})")
    dev = (m.sum(1) - 1).abs()
    if (dev > tol).any():
        i = int(dev.argmax())
        raise ValueError(f"{where(i)} sums to {float(m[i].sum()):.12g}, off 1 by "
                         f"{float(dev[i]):.3g}; normalise it (tolerance {tol:g})")


def _hmm_renormalised(m):
    """m [R,K] with the rows whose sum is off 1 by more than 1e-12 divided by their sum."""
    s = m.sum(1, keepdim=True)
    return torch.where((s - 1).abs() > 1e-12, m / s, m)


def _hmm_blocks(trans, emit):
    """The blocks of an HMM: groups of states linked by a transition (either way) or by a word
    both can emit, with the words they emit. A sentence stays inside one block, so inference
    can run block by block (exactly). Returns [(states, words)] of long tensors."""
    nz = (emit > 0).double()
    label = _connected_components((trans > 0) | (trans > 0).T | ((nz @ nz.T) > 0))
    return [((label == l).nonzero()[:, 0], (emit[label == l] > 0).any(0).nonzero()[:, 0])
            for l in label.unique()]


# ------------------------------------------------------ [paper] forward-backward (App. A.1) ---

def _hmm_forward_backward(init, trans, emit, x, valid):
    """Scaled forward-backward pass over a batch (App. A.1: exact conditionals of an HMM).

    x, valid: (T, n) word ids and in-sentence mask, time-major so each step is contiguous.
    Returns (T, n, S) tensors: the predictive forward message a[t](h) ∝ Pr(h_t = h, x_<t), the
    emission likelihood e[t](h) = Pr(x_t | h_t = h) (1 at t >= length: those words are
    marginalised out), the backward message b[t](h) ∝ Pr(x_>t | h_t = h), each rescaled to sum
    1 (the scale cancels in every normalised quantity), and zero [n]: sentences of probability 0.
    """
    T, n = x.shape
    e = emit.T[x]  # (T, n, S)
    if not valid.all():
        e[~valid] = 1.0
    a = torch.empty_like(e)
    b = torch.empty_like(e)
    zero = torch.zeros(n, dtype=torch.bool)
    a[0] = init
    for t in range(T):
        post = a[t] * e[t]
        z = post.sum(1, keepdim=True)
        zero |= z[:, 0] == 0
        if t + 1 < T:
            torch.mm(post.div_(z.clamp_min(1e-300)), trans, out=a[t + 1])
    b[T - 1] = 1.0 / len(init)
    for t in range(T - 2, -1, -1):
        m = torch.mm(e[t + 1] * b[t + 1], trans.T, out=b[t])  # (n, S)
        m.div_(m.sum(1, keepdim=True).clamp_min(1e-300))
    return a, e, b, zero


class HMM:
    """A hidden Markov model language (paper §2.2, App. A.1): hidden states h_1..h_T with
    h_1 ~ init, h_{t+1} ~ trans[h_t], word x_t ~ emit[h_t]; every sentence has length T.

    `init` [S], `trans` [S,S] (rows: from-state), `emit` [S,V]; numpy arrays, torch tensors
    or nested lists, each row a probability distribution (checked; ValueError names the row).
    Downstream task "k" (paper: task-6, task-10) classifies the k-th hidden state (1-based).
    """

    # ----- [plumbing] construction, validation, spec -----

    def __init__(self, init, trans, emit, length=16):
        init, trans, emit = (_as_float64(init, "HMM init"), _as_float64(trans, "HMM trans"),
                             _as_float64(emit, "HMM emit"))
        if init.dim() != 1 or init.numel() == 0:  # shapes first: row checks index by them
            raise ValueError(f"HMM: init must have shape [S] (S >= 1); got {list(init.shape)}")
        S = init.numel()
        if trans.shape != (S, S):
            raise ValueError(f"HMM: trans must have shape [S,S] = [{S},{S}] (S from init); "
                             f"got {list(trans.shape)}")
        if emit.dim() != 2 or emit.shape[0] != S or emit.shape[1] == 0:
            raise ValueError(f"HMM: emit must have shape [S,V] = [{S},V]; got {list(emit.shape)}")
        if int(length) != length or length < 1:
            raise ValueError(f"HMM: length must be a positive integer; got {length!r}")
        _hmm_check_rows(init[None], "init", "the initial distribution")
        _hmm_check_rows(trans, "trans", "transitions out of state")
        _hmm_check_rows(emit, "emit", "emissions of state")
        # rows within the tolerance but off by more than rounding are renormalised, so every
        # row sums to 1 to ~1e-12 and spec() -> from_spec() gives back identical arrays
        self.init, self.trans, self.emit = (_hmm_renormalised(init[None])[0],
                                            _hmm_renormalised(trans), _hmm_renormalised(emit))
        self.n_states, self.vocab_size, self.max_len = S, emit.shape[1], int(length)
        self._cdf_init, self._cdf_trans, self._cdf_emit = (
            _cdf_table(self.init[None]), _cdf_table(self.trans), _cdf_table(self.emit))
        # blocks (sub-HMMs) for inference; words no state emits belong to block -1
        self._blocks = []
        self._word_block = torch.full((self.vocab_size,), -1, dtype=torch.long)
        self._word_local = torch.zeros(self.vocab_size, dtype=torch.long)
        for c, (states, words) in enumerate(_hmm_blocks(self.trans, self.emit)):
            self._word_block[words] = c
            self._word_local[words] = torch.arange(len(words))
            self._blocks.append((states, words, self.init[states],
                                 self.trans[states][:, states].contiguous(),
                                 self.emit[states][:, words].contiguous()))

    @classmethod
    def random(cls, n_states=100, vocab_size=200, seed=0, n_blocks=4, length=16,
               trans_concentration=0.5, emit_concentration=0.2):
        """Random block-diagonal HMM (paper §2.2: "random block-diagonal stochastic matrices").

        States and words are cut into `n_blocks` contiguous blocks of near-equal size; block b's
        states move only among block b's states and emit only block b's words. Each row's
        non-zero part is a Dirichlet(concentration) draw (numpy, `seed`): concentrations below
        1 give sparse, peaked rows, i.e. a language with structure to learn; init is uniform.
        Since a sentence never leaves its block, its first word reveals the block, and the
        conditional entropy is at most log(V / n_blocks). Measured (10,000 sentences): the
        defaults give 3.77 nats (the paper's HMM: 3.758) and a task-10 Bayes accuracy of 0.42
        against the sampled state; the CPU experiments' HMM.random(20, 50, n_blocks=2) gives
        2.87 nats and 0.64.
        """
        if not 1 <= n_blocks <= min(n_states, vocab_size):
            raise ValueError(f"HMM.random: n_blocks must be in 1..min(n_states, vocab_size) = "
                             f"1..{min(n_states, vocab_size)}; got {n_blocks}")
        if trans_concentration <= 0 or emit_concentration <= 0:
            raise ValueError("HMM.random: Dirichlet concentrations must be > 0; got "
                             f"{trans_concentration}, {emit_concentration}")
        rng = np.random.default_rng(seed)
        states = np.array_split(np.arange(n_states), n_blocks)
        words = np.array_split(np.arange(vocab_size), n_blocks)
        trans = np.zeros((n_states, n_states))
        emit = np.zeros((n_states, vocab_size))
        for hs, ws in zip(states, words):
            trans[hs[:, None], hs] = rng.dirichlet(np.full(len(hs), trans_concentration), len(hs))
            emit[hs[:, None], ws] = rng.dirichlet(np.full(len(ws), emit_concentration), len(hs))
        # Dirichlet draws with tiny concentrations can underflow to all-zero-but-one rows;
        # renormalising in float64 keeps every row an exact distribution.
        trans /= trans.sum(1, keepdims=True)
        emit /= emit.sum(1, keepdims=True)
        return cls(np.full(n_states, 1.0 / n_states), trans, emit, length=length)

    def __repr__(self):
        return (f"HMM(states={self.n_states}, V={self.vocab_size}, T={self.max_len}, "
                f"blocks={len(self._blocks)})")

    def spec(self):
        """Plain-Python description; data.language_from_spec(spec) rebuilds this HMM exactly."""
        return {"kind": "hmm", "length": self.max_len, "init": self.init.tolist(),
                "trans": self.trans.tolist(), "emit": self.emit.tolist()}

    @classmethod
    def from_spec(cls, spec):
        """Inverse of spec()."""
        return cls(spec["init"], spec["trans"], spec["emit"], length=spec["length"])

    # ----- [paper] sampling (§2.2) -----

    def sample(self, n, length=None, seed=0):
        """Draw n sentences: tokens [n,T] long, lengths [n] (all T) and hidden states [n,T] long
        (T = length, default self.max_len), vectorised over sentences by inverse-CDF sampling."""
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
        """Contract API: (tokens [n,T], lengths [n]) of fresh sentences (all of length T)."""
        tokens, lengths, _ = self.sample(n, seed=seed)
        return tokens, lengths

    # ----- [paper] exact inference: one scaled forward-backward pass per block -----

    def _passes(self, tokens, lengths):
        """Validate a batch and run the forward-backward pass, block by block.

        A sentence never leaves the block of states (and words) it starts in (see _hmm_blocks),
        so each sentence is processed by its block's sub-HMM alone: with B equal blocks this
        cuts the work by B^2 and is exact. A mask_id(V) token inside the length is unobserved:
        its emission factor is 1. Yields (valid [n,T], observed [n,T], rows [n_c], block, a, e,
        b) with the time-major messages of _hmm_forward_backward for the sentences `rows`.
        """
        tokens, lengths, valid = _check_sentences("HMM", tokens, lengths, self.vocab_size)
        seen = valid & (tokens != mask_id(self.vocab_size))  # a masked word is marginalised
        x = torch.where(seen, tokens, 0)
        block = self._block_of(x, seen)
        for c, (states, words, init, trans, emit) in enumerate(self._blocks):
            rows = (block == c).nonzero()[:, 0]
            if len(rows) == 0:
                continue
            xc = self._word_local[x[rows]].T  # (T, n_c): block-local word ids, time-major
            a, e, b, zero = _hmm_forward_backward(init, trans, emit, xc, seen[rows].T)
            if zero.any():
                i = int(rows[zero.nonzero()[0, 0]])
                raise ValueError(f"HMM: sentence {i} has probability 0 under this HMM; its "
                                 f"conditionals are undefined")
            yield valid, seen, rows, c, a, e, b

    def _block_of(self, x, seen):
        """The block of each sentence [n] (the block of its first observed word; 0 if none),
        or ValueError if its observed words cannot all come from one block."""
        first = x[torch.arange(len(x)), seen.int().argmax(1)]
        block = torch.where(seen.any(1), self._word_block[first], 0)  # -1: no state emits it
        mixed = seen & (self._word_block[x] != block[:, None])
        if mixed.any() or (block < 0).any():
            i, t = (int(v) for v in (mixed | (seen & (block[:, None] < 0))).nonzero()[0])
            raise ValueError(f"HMM: sentence {i} has probability 0 under this HMM (word "
                             f"{int(x[i, t])} at position {t} cannot occur with its other words)")
        return block

    def mlm_conditional(self, tokens, lengths=None):
        """Exact Pr(x_t = w | x_-t) for every position, [n,T,V] float64 (§2.1; App. A.1).

        Leaving the emission at t out: Pr(x_t = w | x_-t) ∝ Σ_h a[t](h) b[t](h) emit[h, w],
        with a[t] the predictive forward and b[t] the backward message of one forward-backward
        pass. Zero at t >= length (the words there are ignored). mask_id(V) at other positions
        marks unobserved words (marginalised), so masked model inputs can be passed as they are.
        """
        out = None
        for valid, seen, rows, c, a, _, b in self._passes(tokens, lengths):
            n, T = valid.shape
            states, words, _, _, emit = self._blocks[c]
            w = a.mul_(b).transpose(0, 1)  # (n_c, T, S_c) ∝ Pr(h_t = h | x_-t)
            w = (w / w.sum(-1, keepdim=True)).reshape(-1, len(states))
            # emit rows sum to 1 (renormalised in __init__): cond rows sum to 1 without a pass
            cond = w @ emit  # (n_c * T, V_c)
            if len(rows) == n and len(words) == self.vocab_size:
                out = cond.reshape(n, T, self.vocab_size)  # one block holds everything
                break
            if out is None:
                out = torch.zeros(n, T, self.vocab_size, dtype=torch.float64)
            if int(words[-1] - words[0]) + 1 == len(words):  # contiguous words: slice, faster
                out[rows, :, int(words[0]):int(words[-1]) + 1] = cond.view(len(rows), T, -1)
            else:
                out.view(n * T, -1)[(rows[:, None] * T + torch.arange(T)).reshape(-1, 1),
                                    words] = cond
        if out is None:  # empty batch
            return torch.zeros(*torch.as_tensor(tokens).shape, self.vocab_size,
                               dtype=torch.float64)
        if not valid.all():
            out[~valid] = 0.0
        # where x_-t holds no observed word (a one-word sentence, or only masks), nothing, not
        # even the block, is known: the conditional is the marginal Pr(x_t = w)
        alone = valid & (seen.sum(1, keepdim=True) - seen.long() == 0)
        if alone.any():
            out[alone] = self._marginals(T)[alone.nonzero()[:, 1]]
        return out

    def _marginals(self, T):
        """Pr(x_t = w) for t < T, [T, V]: init @ trans^t @ emit."""
        p, rows = self.init, []
        for _ in range(T):
            rows.append(p @ self.emit)
            p = p @ self.trans
        return torch.stack(rows)

    def state_posterior(self, tokens, lengths=None):
        """Pr(h_t = h | x) for every position, [n,T,S] float64 (forward-backward smoothing);
        rows at t >= length are the prior of h_t given the sentence."""
        out = None
        for valid, _, rows, c, a, e, b in self._passes(tokens, lengths):
            n, T = valid.shape
            states = self._blocks[c][0]
            p = a.mul_(e).mul_(b).transpose(0, 1)  # (n_c, T, S_c)
            p = (p / p.sum(-1, keepdim=True)).reshape(-1, len(states))
            if out is None:
                out = torch.zeros(n, T, self.n_states, dtype=torch.float64)
            flat = (rows[:, None] * T + torch.arange(T)).reshape(-1, 1)
            out.view(n * T, -1)[flat, states] = p
        if out is None:  # empty batch
            return torch.zeros(*torch.as_tensor(tokens).shape, self.n_states,
                               dtype=torch.float64)
        return out

    # ----- [paper] downstream tasks: classify the k-th hidden state (task-6, task-10) -----

    @property
    def tasks(self):
        """The paper's task names that fit this length (any "k" with 1 <= k <= T is accepted)."""
        return [k for k in ("6", "10") if int(k) <= self.max_len]

    def _task_position(self, task):
        k = str(task)
        if not (k.isdigit() and 1 <= int(k) <= self.max_len):
            raise ValueError(f"HMM: unknown task {task!r}; valid tasks are '1'..'{self.max_len}' "
                             f"(the k-th hidden state; paper: {self.tasks})")
        return int(k) - 1

    def n_classes(self, task):
        """Task-k is an n_states-way classification."""
        self._task_position(task)
        return self.n_states

    def task_data(self, task, n, seed=0, label="posterior"):
        """(tokens, lengths, labels [n]) for task-k: label = argmax_h Pr(h_k = h | x) (Bayes
        optimal, default) or, with label="sampled", the hidden state the sentence was drawn with."""
        t = self._task_position(task)
        if label not in ("posterior", "sampled"):
            raise ValueError(f"HMM: label must be 'posterior' or 'sampled'; got {label!r}")
        tokens, lengths, states = self.sample(n, seed=seed)
        if label == "sampled":
            labels = states[:, t].clone()
        else:
            labels = self.state_posterior(tokens)[:, t].argmax(-1)
        return tokens, lengths, labels


# ===================================================================================== PCFG ===

class PCFG:
    """A PCFG in Chomsky normal form (paper §2.2, App. A.1): symbol A rewrites to two symbols
    B C with probability binary[A,B,C] or to word w with probability lexical[A,w]; the tree's
    top symbol is drawn from `root`. Sentences longer than `max_len` are rejected when sampling
    (this conditions on the length, which leaves Pr(x_t | x_-t) unchanged).

    Downstream tasks (App. A.1): A, B, C classify the symbol spanning the first 32, 16, 8 words.
    `span_tasks` {name: (start, width)} adds tasks that classify the symbol spanning exactly
    words [start, start + width): on a short grammar A, B and C all name the root, and a span
    inside the sentence is a parse property the MLM has to encode below it.

    The class holds the grammar; its parts follow it: the rule-file parser (parse_rules), the
    exact inference (_InsideOutside) and the sampler (_grow_sentences)."""

    TASK_SPAN = {"A": 32, "B": 16, "C": 8}  # App. A.1: tasks A, B, C use span length L

    # ----- [plumbing] construction: validation, random grammar, rule files, spec -----

    def __init__(self, root, binary, lexical, max_len=32, symbols=None, words=None, origin=None,
                 tol=1e-6, span_tasks=None):
        root, binary = _as_float64(root, "root"), _as_float64(binary, "binary")
        lexical = _as_float64(lexical, "lexical")
        _check_grammar(root, binary, lexical, symbols, words, tol)
        if int(max_len) < 1:
            raise ValueError(f"max_len must be >= 1; got {max_len}")
        self.span_tasks = _check_span_tasks(span_tasks, int(max_len), self.TASK_SPAN)
        S, V = root.shape[0], lexical.shape[1]
        self.root, self.binary, self.lexical = root, binary, lexical
        self.n_symbols, self.vocab_size, self.max_len = S, V, int(max_len)
        self.symbols, self.words = symbols and list(symbols), words and list(words)
        self.origin = origin or {}
        self._io = _InsideOutside(root, binary, lexical)
        # sampling tables: a symbol's rule is one outcome, B*S+C (A -> B C) or S*S+w (A -> w)
        self._rule_cdf = _cdf_table(torch.cat([binary.reshape(S, S * S), lexical], 1))
        self._root_cdf = _cdf_table(root[None])

    @classmethod
    def random(cls, n_symbols=50, vocab_size=200, seed=0, n_levels=6, rules_per_symbol=20,
               p_lexical=0.2, words_per_symbol=None, upper_words=3, max_len=32,
               span_tasks=None):
        """A random layered sparse grammar in the paper's regime (App. A.1: |S| = 50, V = 200,
        length <= 32, tree depth <= 6), shaped like the authors' released grammar.

        Symbols are split into `n_levels` levels; a symbol of level l < n_levels - 1 has
        `rules_per_symbol` binary rules into pairs of level l+1 symbols (Dirichlet(1) weights,
        total 1 - p_lexical) and emits one of `upper_words` words with probability p_lexical
        (level 0, the root level, is always binary); last-level symbols emit one of
        `words_per_symbol` (default V/4) words with Dirichlet(0.5) weights. So trees terminate,
        sentences have at most 2^(n_levels-1) words, and the words of a position depend on the
        symbol above it: structure a model can learn. Built with numpy's seeded generator.
        `span_tasks` adds downstream tasks (see the class docstring)."""
        S, V, L = int(n_symbols), int(vocab_size), int(n_levels)
        if L < 2 or S < L:
            raise ValueError(f"need n_levels >= 2 and n_symbols >= n_levels; got {S}, {L}")
        if 2 ** (L - 1) > max_len:
            raise ValueError(f"2^(n_levels-1) = {2 ** (L - 1)} exceeds max_len = {max_len}")
        if not 0 <= p_lexical < 1:
            raise ValueError(f"p_lexical must be in [0, 1); got {p_lexical}")
        rng = np.random.default_rng(seed)
        sizes = [S // L + (i < S % L) for i in range(L)]
        start = np.cumsum([0] + sizes)
        level = [np.arange(start[i], start[i + 1]) for i in range(L)]
        wps = V // 4 if words_per_symbol is None else int(words_per_symbol)
        root = np.zeros(S)
        root[level[0]] = rng.dirichlet(np.ones(sizes[0]))
        binary, lexical = np.zeros((S, S, S)), np.zeros((S, V))
        for i in range(L - 1):
            nxt = level[i + 1]
            n_pairs = len(nxt) ** 2
            k = min(int(rules_per_symbol), n_pairs)
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
            w = rng.choice(V, size=min(wps, V), replace=False)
            lexical[a, w] = rng.dirichlet(np.full(len(w), 0.5))
        # Every word reachable: a word no last-level symbol emits gets a small share of one.
        for w in np.nonzero(lexical[last].sum(0) == 0)[0]:
            a = rng.choice(last)
            lexical[a, w] = lexical[a].mean()
            lexical[a] /= lexical[a].sum()
        origin = {"random": dict(n_symbols=S, vocab_size=V, seed=int(seed), n_levels=L,
                                 rules_per_symbol=int(rules_per_symbol),
                                 p_lexical=float(p_lexical), words_per_symbol=wps,
                                 upper_words=int(upper_words))}
        return cls(root, binary, lexical, max_len=max_len, origin=origin, span_tasks=span_tasks)

    @classmethod
    def from_rules(cls, path_or_text, max_len=32, tol=1e-2):
        """The grammar of a rule file in the authors' format (`LHS RHS1 [RHS2] probability` a
        line, as their `rule_deep_mlm.txt`), or of such text; see parse_rules."""
        return cls(max_len=max_len, **parse_rules(path_or_text, tol))

    def spec(self):
        """Plain-Python description; data.language_from_spec(spec) rebuilds this grammar exactly
        (rules stored sparsely as [A, B, C, p] and [A, w, p]; floats round-trip exactly)."""
        b = self.binary.nonzero()
        lx = self.lexical.nonzero()
        return {"kind": "pcfg", "n_symbols": self.n_symbols, "vocab_size": self.vocab_size,
                "max_len": self.max_len, "root": self.root.tolist(),
                "binary_rules": [[a, bb, c, self.binary[a, bb, c].item()]
                                 for a, bb, c in b.tolist()],
                "lexical_rules": [[a, w, self.lexical[a, w].item()] for a, w in lx.tolist()],
                "symbols": self.symbols, "words": self.words, "origin": self.origin,
                # only when present, so specs of grammars without them stay as they were
                **({"span_tasks": {k: list(v) for k, v in self.span_tasks.items()}}
                   if self.span_tasks else {})}

    @classmethod
    def from_spec(cls, spec):
        """Inverse of spec()."""
        S, V = spec["n_symbols"], spec["vocab_size"]
        binary = torch.zeros(S, S, S, dtype=torch.float64)
        lexical = torch.zeros(S, V, dtype=torch.float64)
        for a, b, c, p in spec["binary_rules"]:
            binary[a, b, c] = p
        for a, w, p in spec["lexical_rules"]:
            lexical[a, w] = p
        return cls(spec["root"], binary, lexical, max_len=spec["max_len"],
                   symbols=spec.get("symbols"), words=spec.get("words"),
                   origin=spec.get("origin"), span_tasks=spec.get("span_tasks"))

    def __repr__(self):
        src = f"rules: {self.origin['rules']}" if "rules" in self.origin else \
            next(iter(self.origin), "explicit")
        return (f"PCFG(symbols={self.n_symbols}, V={self.vocab_size}, max_len={self.max_len}, "
                f"binary_rules={int((self.binary > 0).sum())}, origin={src!r})")

    # ----- [paper] sampling (§2.2; the sampler is _grow_sentences below) -----

    def sample(self, n, seed=0, max_len=None):
        """Draw n sentences of at most max_len words (default self.max_len): tokens [n, max_len]
        long (pad_id beyond the length) and lengths [n] long. Trees that grow past max_len are
        dropped, so batches are drawn until n sentences are kept."""
        T = self.max_len if max_len is None else int(max_len)
        g = torch.Generator().manual_seed(int(seed))
        toks, lens, got, tries, drawn = [], [], 0, 0, 0
        while got < n:  # next batch: the rest at the kept fraction so far, 20% spare
            m = max(64, int(1.2 * (n - got) * drawn / max(got, 1)) if got else n + 64)
            m = min(m, 4 * n + 1000)
            t, l = _grow_sentences(self._root_cdf, self._rule_cdf, self.n_symbols,
                                   self.vocab_size, m, T, g)
            toks.append(t), lens.append(l)
            got, tries, drawn = got + len(l), tries + 1, drawn + m
            if tries > 50 and got < 0.001 * drawn:
                raise ValueError(f"fewer than 0.1% of sampled sentences have <= {T} words; "
                                 f"raise max_len or use a grammar with shorter sentences")
        return torch.cat(toks)[:n], torch.cat(lens)[:n]

    def sentences(self, n, seed=0):
        """Contract API: (tokens [n, max_len], lengths [n]) of fresh sentences."""
        return self.sample(n, seed=seed)

    # ----- [paper] exact probabilities by inside-outside (App. A.1; _InsideOutside below) -----

    def log_prob(self, tokens, lengths):
        """log Pr(x) of each sentence by the inside algorithm [n] float64 (unconditioned on
        length <= max_len; -inf for sentences the grammar cannot generate)."""
        tokens, lengths, _ = _check_sentences("PCFG", tokens, lengths, self.vocab_size)
        out = torch.empty(len(lengths), dtype=torch.float64)
        for idx in _length_batches(lengths):
            L = lengths[idx]
            leaf, logc = self._io.leaf(tokens[idx, :int(L.max())], L)
            chart = self._io.inside(leaf)[0]
            top = torch.stack([chart[l][r, 0, :-1] for r, l in enumerate(L.tolist())])  # [b, S]
            out[idx] = ((top @ self.root).log() + logc.sum(1)  # undo the exact scaling
                        - (L - 1).double() * math.log(self._io.bscale))
        return out

    def mlm_conditional(self, tokens, lengths):
        """Exact Pr(x_t = w | x_-t) [n, T, V] float64 for every position t < length (App. A.1):
        the outside score of the width-1 span at t (which does not involve x_t) times the
        lexical probabilities, normalised over w; one inside-outside pass per sentence, batched.
        Zero at t >= length; tokens there are ignored. mask_id words elsewhere are summed out,
        so a masked sentence gives the conditional of its masked position directly."""
        tokens, lengths, _ = _check_sentences("PCFG", tokens, lengths, self.vocab_size)
        n, T = tokens.shape
        out = torch.zeros(n, T, self.vocab_size, dtype=torch.float64)
        for idx in _length_batches(lengths):
            _, outside = self._io.charts(tokens[idx], lengths[idx])
            p = outside[1][..., :-1] @ self.lexical  # [b, T', V]
            z = p.sum(-1, keepdim=True)
            valid = torch.arange(p.shape[1]) < lengths[idx, None]
            if (valid & (z[..., 0] <= 0)).any():
                r = idx[(valid & (z[..., 0] <= 0)).nonzero()[0, 0]].item()
                raise ValueError(f"sentence {r} has probability 0 under the grammar even with one "
                                 f"word masked: no conditional exists")
            p = torch.where(valid[..., None], p / z.clamp_min(1e-300), torch.zeros_like(p))
            out[idx, :p.shape[1]] = p
        return out

    def span_posterior(self, tokens, lengths, span_len):
        """Pr(s spans exactly [0, m) | x) [n, S] with m = min(span_len, length): inside x outside
        of that span over Pr(x) (App. A.1). Rows sum to Pr([0, m) is a constituent | x) <= 1.
        A span [0, m) can only be a left child, of a span [0, j), so its outside score needs
        only the outside scores of the other spans starting at 0: one inside pass plus O(T)
        small products per sentence."""
        tokens, lengths, _ = _check_sentences("PCFG", tokens, lengths, self.vocab_size)
        S = self.n_symbols
        out = torch.zeros(len(lengths), S, dtype=torch.float64)
        m = lengths.clamp(max=int(span_len))
        for idx in _length_batches(lengths):
            L = lengths[idx]
            leaf, _ = self._io.leaf(tokens[idx, :int(L.max())], L)
            full = [None] + [c[..., :S] for c in self._io.inside(leaf)[0][1:]]
            out0 = self._io.prefix_outside(full, L)  # [b, T+1, S]: outside of [0, w)
            z = torch.stack([full[l][r, 0] @ self.root for r, l in enumerate(L.tolist())])
            if (z <= 0).any():
                raise ValueError(f"sentence {idx[(z <= 0).nonzero()[0, 0]].item()} has "
                                 f"probability 0 under the grammar: no span posterior exists")
            mi = m[idx]
            inside0 = torch.stack([full[w][r, 0] for r, w in enumerate(mi.tolist())])
            out[idx] = inside0 * out0[torch.arange(len(idx)), mi] / z[:, None]
        return out

    def constituent_posterior(self, tokens, lengths, start, width):
        """Pr(s spans exactly words [start, start + width) | x) [n, S]: inside x outside of that
        span over Pr(x) (App. A.1's span labels, at any position). Rows sum to Pr(that span is a
        constituent | x) <= 1; zero for sentences shorter than start + width. The scalings of
        inside, outside and Pr(x) (see _InsideOutside) are the same b^(L-1) / prod c_t: they
        cancel."""
        tokens, lengths, _ = _check_sentences("PCFG", tokens, lengths, self.vocab_size)
        S = self.n_symbols
        out = torch.zeros(len(lengths), S, dtype=torch.float64)
        for idx in _length_batches(lengths):
            L = lengths[idx]
            if int(L.max()) < start + width:  # no sentence of this batch reaches the span
                continue
            inside, outside = self._io.charts(tokens[idx], L)
            z = torch.stack([inside[l][r, 0, :S] @ self.root for r, l in enumerate(L.tolist())])
            if (z <= 0).any():
                raise ValueError(f"sentence {idx[(z <= 0).nonzero()[0, 0]].item()} has "
                                 f"probability 0 under the grammar: no span posterior exists")
            out[idx] = inside[width][:, start, :S] * outside[width][:, start, :S] / z[:, None]
        return out

    # ----- [paper] downstream tasks A, B, C (App. A.1) and span tasks -----

    @property
    def tasks(self):
        """Task names: A, B, C classify the symbol spanning the first 32, 16, 8 tokens; then
        the grammar's span tasks (the symbol spanning exactly words [start, start + width))."""
        return list(self.TASK_SPAN) + list(self.span_tasks)

    def _span_length(self, task):
        if task not in self.tasks:
            raise ValueError(f"unknown task {task!r} for {self!r}; valid tasks are {self.tasks}")
        return self.TASK_SPAN.get(task)

    def n_classes(self, task):
        """Each task is an n_symbols-way classification (paper: 50-way)."""
        self._span_length(task)
        return self.n_symbols

    def task_posterior(self, task, tokens, lengths):
        """Pr(s is the symbol task `task` asks for | x) [n, S]: span_posterior for A/B/C,
        constituent_posterior for a span task; rows sum to <= 1 (0: no such constituent)."""
        L = self._span_length(task)
        if L is not None:
            return self.span_posterior(tokens, lengths, L)
        return self.constituent_posterior(tokens, lengths, *self.span_tasks[task])

    def task_data(self, task, n, seed=0):
        """(tokens, lengths, labels [n]) for task A/B/C: label = argmax_s Pr(s spans exactly
        the first min(L, length) tokens | x), L = 32/16/8 (App. A.1); for a span task, words
        [start, start + width). Sentences in which no symbol can span those tokens (posterior
        mass 0: the label is undefined) are skipped, so the sentences are drawn from the
        language conditioned on that span being possible."""
        self._span_length(task)
        toks, lens, labs, got, tried, rnd = [], [], [], 0, 0, 0
        while got < n:
            rate = max(got / tried, 0.05) if tried else 1.0  # fraction of sentences kept so far
            t, l = self.sentences(int(1.1 * (n - got) / rate) + 16,
                                  seed=(seed + 1) * 1000003 + rnd)  # not sentences(seed)
            post = self.task_posterior(task, t, l)
            ok = post.sum(1) > 1e-12
            toks.append(t[ok]), lens.append(l[ok]), labs.append(post[ok].argmax(1))
            got, tried, rnd = got + int(ok.sum()), tried + len(l), rnd + 1
        return torch.cat(toks)[:n], torch.cat(lens)[:n], torch.cat(labs)[:n]


# -------------------------------------------------------------- [plumbing] PCFG: validation ---

def _check_grammar(root, binary, lexical, symbols, words, tol):
    """Raise ValueError unless root [S], binary [S,S,S], lexical [S,V] are a CNF grammar: shapes,
    finite non-negative entries, root and each symbol's rules summing to 1 within tol."""
    if root.dim() != 1:
        raise ValueError(f"root must be a vector [S]; got shape {tuple(root.shape)}")
    S = root.shape[0]
    if S == 0:
        raise ValueError("root is empty: a grammar needs at least one symbol")
    if tuple(binary.shape) != (S, S, S):
        raise ValueError(f"binary must have shape [S,S,S] = {(S, S, S)} (S = len(root)); "
                         f"got {tuple(binary.shape)}")
    if lexical.dim() != 2 or lexical.shape[0] != S or lexical.shape[1] == 0:
        raise ValueError(f"lexical must have shape [S,V] = [{S},V] with V >= 1; "
                         f"got {tuple(lexical.shape)}")
    if symbols is not None and len(symbols) != S or words is not None and \
            len(words) != lexical.shape[1]:
        raise ValueError(f"symbols / words must name all {S} symbols / "
                         f"{lexical.shape[1]} words")
    names = list(symbols) if symbols is not None else [str(a) for a in range(S)]
    for what, t in (("root", root), ("binary", binary), ("lexical", lexical)):
        bad = ~torch.isfinite(t)
        if bad.any():
            raise ValueError(f"{what} has NaN/Inf entries at {bad.nonzero()[0].tolist()}")
        if (t < 0).any():
            i = (t < 0).nonzero()[0].tolist()
            raise ValueError(f"{what} has negative entries, e.g. {what}{i} = {t[tuple(i)]}")
    if abs(root.sum().item() - 1) > tol:
        raise ValueError(f"root sums to {root.sum().item():.9g}, off by "
                         f"{root.sum().item() - 1:+.3g}; it must sum to 1")
    rows = binary.sum((1, 2)) + lexical.sum(1)
    for a in range(S):
        if abs(rows[a].item() - 1) > tol:
            raise ValueError(
                f"symbol {a} ({names[a]}): binary and lexical rules sum to "
                f"{rows[a].item():.9g}, off by {rows[a].item() - 1:+.3g}; each symbol's "
                f"rule probabilities must sum to 1")


def _check_span_tasks(span_tasks, max_len, reserved):
    """{name: (start, width)} of valid span tasks (JSON specs store the pair as a list: both
    accepted), or ValueError."""
    out = {}
    for name, where in (span_tasks or {}).items():
        ints = isinstance(where, (list, tuple)) and len(where) == 2 and \
            all(isinstance(v, int) and not isinstance(v, bool) for v in where)
        if not (isinstance(name, str) and name not in reserved and ints
                and where[0] >= 0 and where[1] >= 1 and sum(where) <= max_len):
            raise ValueError(f"span task {name!r}: {where!r} must be (start, width) with "
                             f"start >= 0, width >= 1, start + width <= max_len = {max_len}, "
                             f"named other than {list(reserved)}")
        out[name] = (where[0], where[1])
    return out


# ------------------------------------------------- [plumbing] PCFG: the authors' rule files ---

def parse_rules(path_or_text, tol=1e-2):
    """PCFG constructor arguments (root, binary, lexical, symbols, words, origin) from a grammar
    written one rule a line, `LHS RHS1 [RHS2] probability` (the format of the authors' released
    `rule_deep_mlm.txt`). Blank lines and `#` comments are skipped.

    Nonterminals are the symbols that appear as a left-hand side; the start symbol is the
    left-hand side of the first rule. Its unary rules `START Si p` become the root
    distribution (if it has binary/lexical rules instead, it is itself the only root).
    Symbol ids follow first appearance as a left-hand side (start symbol excluded); word ids
    follow first appearance in the file. Each left-hand side's probabilities are renormalised
    to sum to 1 (the authors' file is off by up to 2.3e-4) unless off by more than `tol`.
    A str is a path when it is one short line; an os.PathLike (pathlib.Path) always is.

    A small grammar in this format (a right-hand side that is never a left-hand side is a word):

        ROOT S 1.0
        S NP VP 1.0
        NP Det N 1.0
        VP V NP 0.7
        VP V Adv 0.3
        Det the 0.6
        Det a 0.4
        N dog 0.5
        N cat 0.5
        V sees 0.5
        V chases 0.5
        Adv quickly 1.0

    The authors' grammar is `pcfg/rule_deep_mlm.txt` in their repository
    (Liuhong99/implicitbiasmlmcode); read as it is: mean length 10.6 words, optimal MLM loss
    4.13 nats per word."""
    text, where = _rule_text(path_or_text)
    rules = _rule_lines(text, where)
    lhs_order = list(dict.fromkeys(r[1] for r in rules))
    nonterminals = set(lhs_order)
    start = rules[0][1]
    unary_start = [r for r in rules if r[1] == start and len(r[2]) == 1
                   and r[2][0] in nonterminals]
    if unary_start and any(start in r[2] for r in rules):
        raise ValueError(f"{where}: the start symbol {start} has unary rules, so it cannot "
                         f"appear on a right-hand side")
    symbols = [s for s in lhs_order if not (s == start and unary_start)]
    words = list(dict.fromkeys(rhs[0] for _, _, rhs, _ in rules
                               if len(rhs) == 1 and rhs[0] not in nonterminals))
    if not words:
        raise ValueError(f"{where}: no lexical rules (LHS word probability) found")
    root, binary, lexical = _rule_arrays(rules, where, symbols, words, start, bool(unary_start))
    for name, total in [(start, root.sum())] * bool(unary_start) + \
            [(s, binary[i].sum() + lexical[i].sum()) for i, s in enumerate(symbols)]:
        if abs(total - 1) > tol:
            raise ValueError(f"{where}: rules of {name} sum to {total:.6g}, off by "
                             f"{total - 1:+.3g} (more than tol = {tol})")
    root /= root.sum()
    z = binary.sum((1, 2)) + lexical.sum(1)
    binary /= z[:, None, None]
    lexical /= z[:, None]
    return dict(root=root, binary=binary, lexical=lexical, symbols=symbols, words=words,
                origin={"rules": where})


def _rule_text(path_or_text):
    """(text, where it came from) of a rule file path or of the rules themselves."""
    text = str(path_or_text)
    if not (isinstance(path_or_text, os.PathLike) or "\n" not in text and len(text.split()) < 3):
        return text, "<text>"
    if not os.path.isfile(text):
        raise ValueError(f"no such rule file: {text!r}")
    try:
        with open(text) as f:
            return f.read(), str(path_or_text)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read rule file {text!r}: {e}") from None


def _rule_lines(text, where):
    """The rules of a rule file: [(line number, lhs, [rhs...], probability)]."""
    rules = []
    for no, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        f = line.split()
        if len(f) not in (3, 4):
            raise ValueError(f"{where}, line {no}: expected 'LHS RHS1 [RHS2] probability', "
                             f"got {len(f)} fields: {line!r}")
        try:
            p = float(f[-1])
        except ValueError:
            raise ValueError(f"{where}, line {no}: probability {f[-1]!r} is not a number")
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"{where}, line {no}: probability {p} must be finite and >= 0")
        rules.append((no, f[0], f[1:-1], p))
    if not rules:
        raise ValueError(f"{where}: no rules found")
    return rules


def _rule_arrays(rules, where, symbols, words, start, unary_start):
    """root [S], binary [S,S,S], lexical [S,V] (numpy, not yet normalised) of parsed rules."""
    sid = {s: i for i, s in enumerate(symbols)}
    wid = {w: i for i, w in enumerate(words)}
    nonterminals = {lhs for _, lhs, _, _ in rules}
    S, V = len(symbols), len(words)
    root, binary, lexical = np.zeros(S), np.zeros((S, S, S)), np.zeros((S, V))
    for no, lhs, rhs, p in rules:
        if unary_start and lhs == start:
            if len(rhs) != 1 or rhs[0] not in nonterminals:
                raise ValueError(f"{where}, line {no}: the start symbol {start} has unary "
                                 f"rules to nonterminals, so all its rules must be unary")
            root[sid[rhs[0]]] += p
        elif len(rhs) == 2:
            for s in rhs:
                if s not in sid:
                    raise ValueError(f"{where}, line {no}: {s!r} on the right of a binary "
                                     f"rule is not a nonterminal (it has no rules)")
            binary[sid[lhs], sid[rhs[0]], sid[rhs[1]]] += p
        elif rhs[0] in nonterminals:
            raise ValueError(f"{where}, line {no}: unary rule {lhs} -> {rhs[0]} is only "
                             f"allowed from the start symbol {start} (CNF)")
        else:
            lexical[sid[lhs], wid[rhs[0]]] += p
    if not unary_start:
        root[sid[start]] = 1.0
    return root, binary, lexical


# -------------------------------------------------- [paper] PCFG: inside-outside (App. A.1) ---

def _pair_blocks(used):
    """Split the used (B, C) pairs of a boolean [S, S] matrix into connected blocks: a list of
    (rows, cols) of sorted symbol lists, such that every used pair lies in one block's
    rows x cols and no row or column is in two blocks (ordered by their first row)."""
    S = used.shape[0]
    link = torch.zeros(2 * S, 2 * S, dtype=torch.bool)  # nodes: rows B, then columns S + C
    link[:S, S:], link[S:, :S] = used, used.T
    label = _connected_components(link)
    return [((label[:S] == l).nonzero()[:, 0].tolist(), (label[S:] == l).nonzero()[:, 0].tolist())
            for l in label[:S][used.any(1)].unique().tolist()]


def _length_batches(lengths, size=128, spread=3):
    """Index batches of sentences sorted by length, at most `size` long and at most `spread`
    words apart, so padding to the batch's longest sentence costs little."""
    order = lengths.argsort(stable=True)
    srt = lengths[order].tolist()
    batches, start = [], 0
    for i in range(1, len(srt) + 1):
        if i == len(srt) or i - start == size or srt[i] > srt[start] + spread:
            batches.append(order[start:i])
            start = i
    return batches


class _InsideOutside:
    """The inside and outside passes of a CNF grammar over a batch of sentences (App. A.1).

    Scores are scaled (exact, closed form): in CNF every tree over a span of width w uses w
    leaves and w-1 binary rules, so dividing each position's leaf scores by c_t and multiplying
    binary rules by the constant b (`bscale`) rescales a span's inside score by
    b^(w-1) / prod c_t, the same for all its trees; in float64 this leaves hundreds of nats of
    headroom at length 32.

    Sparsity: the (B, C) pairs used by binary rules split into independent blocks (rows x cols;
    a layered grammar gives one block per level), so the sum over splits is a few small
    products instead of one S x S one. Charts come in three layouts per width w: full[w]
    [n, T-w+1, S+1] (column S is an always-zero pad) and, for the products, rows[w] / cols[w]
    [n, T-w+1, G*br / G*bc]: the symbols of each block's rows / columns."""

    def __init__(self, root, binary, lexical):
        S = root.shape[0]
        self.root, self.binary, self.lexical = root, binary, lexical
        blocks = _pair_blocks(binary.sum(0) > 0) or [([0], [0])]
        G = len(blocks)
        br, bc = max(len(r) for r, _ in blocks), max(len(c) for _, c in blocks)
        rows = torch.full((G, br), S, dtype=torch.long)  # index S = an always-zero column
        cols = torch.full((G, bc), S, dtype=torch.long)
        for g, (r, c) in enumerate(blocks):
            rows[g, :len(r)], cols[g, :len(c)] = torch.tensor(r), torch.tensor(c)
        nz = binary[binary > 0]
        self.bscale = 1.0 / nz.mean().item() if nz.numel() else 1.0
        ext = torch.zeros(S + 1, S + 1, S + 1, dtype=torch.float64)
        ext[:S, :S, :S] = binary * self.bscale
        # rules[(g, i, j), A] = b * binary[A, rows[g, i], cols[g, j]]  [G*br*bc, S+1]
        self.rules = ext[:, rows[:, :, None], cols[:, None, :]].reshape(S + 1, -1).T.contiguous()
        rows, cols = rows.reshape(-1), cols.reshape(-1)
        self.rules_all = torch.cat([self.rules, self.rules[:, rows], self.rules[:, cols]], 1)
        self.S1, self.rows, self.cols, self.G, self.br, self.bc = S + 1, rows, cols, G, br, bc

    def leaf(self, tokens, lengths):
        """Scaled leaf scores [n, T, S+1] (zero beyond the length and in the pad column S) and
        log c_t [n, T]. A mask_id word is unobserved: its leaf score Σ_w P(A -> w) sums it out."""
        V = self.lexical.shape[1]
        valid = torch.arange(tokens.shape[1]) < lengths[:, None]
        leaf = self.lexical.T[tokens.clamp(0, V - 1)]  # [n, T, S]
        masked = (tokens == mask_id(V))[..., None]
        leaf = torch.where(masked, self.lexical.sum(1), leaf)
        c = leaf.amax(-1)
        c = torch.where(valid & (c > 0), c, torch.ones_like(c))
        leaf = torch.where(valid[..., None], leaf / c[..., None], torch.zeros_like(leaf))
        return F.pad(leaf, (0, 1)), c.log()  # [n, T, S+1]: zero pad column

    def inside(self, leaf):
        """Inside pass: (full, rows, cols), the scaled inside score of every span in the three
        layouts. The sum over split points k is one batched product per width, before the
        rules are applied: pairs[i, B, C] = sum_k in(i, i+k, B) in(i+k, i+w, C)."""
        n, T = leaf.shape[:2]
        full, rows, cols = [None, leaf], [None, leaf[..., self.rows]], [None, leaf[..., self.cols]]
        for w in range(2, T + 1):
            left, right_t = self.children(rows, cols, w)
            pairs = torch.bmm(left, right_t.transpose(1, 2)).view(n, T - w + 1, -1)  # [n,ns,Q]
            new = pairs @ self.rules_all  # [n, ns, (S+1) + G*br + G*bc]: three layouts
            full.append(new[..., :self.S1])
            rows.append(new[..., self.S1:self.S1 + len(self.rows)])
            cols.append(new[..., self.S1 + len(self.rows):])
        return full, rows, cols

    def children(self, rows, cols, w):
        """Inside scores of the children of every span of width w, split k = 1..w-1, laid out
        for bmm: left [n*ns*G, br, w-1], right (transposed) [n*ns*G, bc, w-1]."""
        n, T = rows[1].shape[:2]
        ns, N = T - w + 1, rows[1].shape[0] * (T - w + 1) * self.G
        left = torch.stack([rows[k][:, :ns] for k in range(1, w)], -1)  # [n, ns, G*br, w-1]
        right = torch.stack([cols[w - k][:, k:k + ns] for k in range(1, w)], -1)
        return left.view(N, self.br, w - 1), right.view(N, self.bc, w - 1)

    def outside(self, inside, lengths):
        """Outside pass, the exact reverse of inside(): out[w] [n, T-w+1, S+1] is the scaled
        outside score of every span (the root seeds the span [0, length) of each sentence).
        Contributions to children are gathered in the block layouts and scattered back to the
        symbols once per width."""
        full, rows, cols = inside
        n, T, S1 = full[1].shape
        G, br, bc = self.G, self.br, self.bc
        out = [None] + [torch.zeros_like(c) for c in full[1:]]
        out_rows = [None] + [torch.zeros_like(c) for c in rows[1:]]
        out_cols = [None] + [torch.zeros_like(c) for c in cols[1:]]
        for w in range(T, 0, -1):
            ns = T - w + 1
            top = (lengths == w).nonzero()[:, 0]
            out[w][top, 0, :S1 - 1] += self.root
            out[w].index_add_(2, self.rows, out_rows[w]).index_add_(2, self.cols, out_cols[w])
            if w == 1:
                break
            left, right_t = self.children(rows, cols, w)
            g = (out[w] @ self.rules.T).view(n * ns * G, br, bc)  # outside x rule, per pair
            to_left = torch.bmm(g, right_t).view(n, ns, G * br, w - 1)
            to_right = torch.bmm(g.transpose(1, 2), left).view(n, ns, G * bc, w - 1)
            for k in range(1, w):
                out_rows[k][:, :ns] += to_left[..., k - 1]
                out_cols[w - k][:, k:k + ns] += to_right[..., k - 1]
        return out

    def charts(self, tokens, lengths):
        """Scaled inside and outside charts (full layout) of a batch, trimmed to its longest
        sentence."""
        leaf, _ = self.leaf(tokens[:, :int(lengths.max())], lengths)
        inside = self.inside(leaf)
        return inside[0], self.outside(inside, lengths)

    def prefix_outside(self, full, lengths):
        """Scaled outside scores of the spans [0, w) only, [n, T+1, S], from the inside chart
        `full` (columns :S): a span [0, m) is the left child of a span [0, j), so
        out(0, m, B) = sum_j sum_{A,C} out(0, j, A) b(A, B, C) in(m, j, C)."""
        n, S = len(lengths), self.root.shape[0]
        T = len(full) - 1
        rules = (self.binary * self.bscale).reshape(S, S * S)  # scaled like inside()'s
        out0 = torch.zeros(n, T + 1, S, dtype=torch.float64)
        for j in range(T, 1, -1):
            out0[lengths == j, j] += self.root
            M = (out0[:, j] @ rules).view(n, S, S)  # [n, B, C]: sum_A out(0,j,A) b(A,B,C)
            right = torch.stack([full[j - k][:, k] for k in range(1, j)], 1)  # in(k, j)
            out0[:, 1:j] += torch.einsum("nbc,nkc->nkb", M, right)
        out0[lengths == 1, 1] += self.root
        return out0


# --------------------------------------------------------- [paper] PCFG: the sampler (§2.2) ---

def _grow_sentences(root_cdf, rule_cdf, S, V, m, T, g):
    """Grow m trees top-down, all at once, and return the sentences of those with <= T words:
    (tokens [k, T] long, pad_id(V) beyond the length; lengths [k]), k <= m.

    Each row holds a tree's frontier left to right: symbols still to rewrite and words already
    emitted. A round rewrites every pending symbol of every row by one rule drawn from its CDF
    (outcome B*S+C: the two symbols B C; outcome S*S+w: the word w). A row whose frontier
    outgrows T words can only get longer, so it is dropped at once."""
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


# =============================================================================== teacher LM ===

# -------------------------------------------------------------- [paper] the teacher network ---

def _teacher_attention(q, k, v, past_k, past_v):
    """Causal multi-head attention of m new positions over P cached ones plus themselves.

    q, k, v: (B, C, H, m, dh) for C candidate continuations that share one cached prefix
    past_k, past_v: (B, H, P, dh). Scores against the prefix are computed once per prefix with
    the C*m queries stacked (no copy of the cache per candidate). Returns (B, C, H, m, dh).
    """
    B, C, H, m, dh = q.shape
    P = past_k.shape[2]
    qs = q.transpose(1, 2).reshape(B, H, C * m, dh)
    s_past = (qs @ past_k.transpose(-1, -2)).reshape(B, H, C, m, P).transpose(1, 2)
    s_new = q @ k.transpose(-1, -2)  # (B, C, H, m, m)
    s_new += torch.full((m, m), float("-inf"), dtype=q.dtype).triu(1)  # causal
    p = torch.cat([s_past, s_new], -1).mul_(dh ** -0.5).softmax(-1)  # (B, C, H, m, P + m)
    out = p[..., P:] @ v
    if P:
        pp = p[..., :P].transpose(1, 2).reshape(B, H, C * m, P)
        out = out + (pp @ past_v).reshape(B, H, C, m, dh).transpose(1, 2)
    return out


class TeacherLM:
    """Teacher-LM language: sentences sampled from a small random causal transformer, the
    paper's OPT-generated dataset (§2.2, App. A.1) at a size whose exact conditionals a CPU
    can afford. No download: the teacher is initialised from `seed` and never trained.

    Generation (paper: "starting from the bos token, we sample every token ... from the
    predicted autoregressive LM probability ... length restricted to 24"): draw a latent topic
    z uniformly from n_topics, then x_1, x_2, ... ~ Pr(. | bos, x_<t, z) until the teacher emits
    eos or the sentence reaches `length` words (eos is not allowed as the first token). The
    paper's 3.2e9 tokens in 2e8 sentences (16 per sentence, maximum 24) indicate variable
    lengths, hence eos; sentences are padded with pad_id(V) after their length.

    Vocabulary (paper: "only the top-2000 most frequent tokens"): a random teacher has no
    token counts to rank, so "top-k" is simply a V-word output layer (plus eos); a Zipf-shaped
    bias -zipf*log(1 + w) on the word logits gives a skewed unigram distribution, as real text
    has. Defaults (V 100, T 24): mean length ≈ 16 words, MLM entropy ≈ 2.5 nats against a
    unigram entropy ≈ 3.7 and log V = 4.6, Bayes accuracy of the topic task ≈ 0.90.

    Topic z enters as an embedding added at every position (like a control code), so it shapes
    the whole sentence; the downstream task "topic" (our stand-in for SST-2/QNLI, which need
    real text) classifies z from x with the Bayes label argmax_z Pr(z | x).

    The network: token + position + topic embeddings, n_layers pre-LN blocks (causal
    multi-head self-attention, ReLU MLP of width 4*d_model), a final LayerNorm and an output
    layer over V words + eos; no biases; Gaussian weights scaled so activations stay O(1).
    `temperature` divides the network's logits (lower: more peaked, lower entropy); `eos_bias`
    is added to the eos logit and sets the mean length; `topic_strength` scales the topic
    embeddings and so how visible z is in the sentence.

    The exact MLM conditional comes from the joint, Pr(x) = Σ_z Pr(z) Π_t Pr(x_t | x_<t, z)
    (times Pr(eos | x, z) when the sentence is shorter than `length`): for each position t the
    teacher scores all V candidate words at once, reusing the cached prefix x_<t (App. A.1).
    """

    # ----- [plumbing] construction, validation, spec -----

    def __init__(self, vocab_size=100, length=24, n_topics=2, d_model=32, n_layers=2,
                 n_heads=4, temperature=0.5, zipf=0.5, eos_bias=1.0, topic_strength=0.3,
                 seed=0):
        if vocab_size < 1 or length < 1 or n_topics < 1 or n_layers < 0:
            raise ValueError("TeacherLM: vocab_size, length and n_topics must be >= 1 and "
                             f"n_layers >= 0; got {vocab_size}, {length}, {n_topics}, {n_layers}")
        if d_model < 1 or n_heads < 1 or d_model % n_heads:
            raise ValueError(f"TeacherLM: d_model ({d_model}) must be a positive multiple of "
                             f"n_heads ({n_heads})")
        if not temperature > 0:
            raise ValueError(f"TeacherLM: temperature must be > 0; got {temperature}")
        self.args = dict(vocab_size=int(vocab_size), length=int(length),
                         n_topics=int(n_topics), d_model=int(d_model), n_layers=int(n_layers),
                         n_heads=int(n_heads), temperature=float(temperature), zipf=float(zipf),
                         eos_bias=float(eos_bias), topic_strength=float(topic_strength),
                         seed=int(seed))
        self.vocab_size, self.max_len, self.n_topics = int(vocab_size), int(length), int(n_topics)
        self.eos = self.bos = self.vocab_size  # internal ids: output V = eos, input V = bos
        self.n_heads = int(n_heads)
        V, d = self.vocab_size, int(d_model)
        g = torch.Generator().manual_seed(int(seed))

        def randn(*shape, std):  # every weight a seeded Gaussian; std keeps activations O(1)
            return torch.randn(*shape, generator=g, dtype=torch.float64) * std

        self.emb = randn(V + 1, d, std=1.0)  # words 0..V-1, bos = V
        self.pos = randn(self.max_len, d, std=1.0)
        self.topic = randn(self.n_topics, d, std=topic_strength)
        self.layers = [dict(wqkv=randn(d, 3 * d, std=d ** -0.5), wo=randn(d, d, std=d ** -0.5),
                            w1=randn(d, 4 * d, std=d ** -0.5),
                            w2=randn(4 * d, d, std=(4 * d) ** -0.5))
                       for _ in range(int(n_layers))]
        self.wout = randn(d, V + 1, std=d ** -0.5 / temperature)
        self.bias = torch.cat([-zipf * torch.arange(1, V + 1, dtype=torch.float64).log(),
                               torch.tensor([eos_bias], dtype=torch.float64)])

    @classmethod
    def random(cls, seed=0, **kwargs):
        """The random teacher of `seed` (same name as PCFG.random / HMM.random)."""
        return cls(seed=seed, **kwargs)

    def __repr__(self):
        return (f"TeacherLM(V={self.vocab_size}, max_len={self.max_len}, "
                f"topics={self.n_topics}, seed={self.args['seed']})")

    def spec(self):
        """Plain-Python description: the constructor's arguments (the weights follow from the
        seed); data.language_from_spec(spec) rebuilds an identical teacher."""
        return {"kind": "teacher", **self.args}

    @classmethod
    def from_spec(cls, spec):
        """Inverse of spec()."""
        args = {k: v for k, v in spec.items() if k != "kind"}
        known = list(inspect.signature(cls).parameters)
        if set(args) - set(known):
            raise ValueError(f"TeacherLM spec: unknown keys {sorted(set(args) - set(known))}; "
                             f"expected some of {known}")
        return cls(**args)

    # ----- [paper] the teacher network -----

    def _forward(self, inputs, start, topics, past=None):
        """Logits of the next token (V words + eos) at m new positions.

        inputs (B, C, m): token ids at positions start..start+m-1 (bos = V); topics (B,);
        past: per layer (k, v) of shape (B, H, start, dh), shared by the C candidates.
        Returns logits (B, C, m, V+1) and the cache of the new positions of candidate 0: per
        layer (k, v) of shape (B, H, m, dh).
        """
        B, C, m = inputs.shape
        H = self.n_heads
        h = self.emb[inputs] + self.pos[start:start + m] + self.topic[topics][:, None, None]
        new = []
        for i, L in enumerate(self.layers):
            x = F.layer_norm(h, h.shape[-1:])
            q, k, v = (x @ L["wqkv"]).view(B, C, m, 3, H, -1).permute(3, 0, 1, 4, 2, 5)
            if past is None or start == 0:
                pk = pv = q.new_zeros(B, H, 0, q.shape[-1])
            else:
                pk, pv = past[i]
            a = _teacher_attention(q, k, v, pk, pv)  # (B, C, H, m, dh)
            h = h + a.transpose(2, 3).reshape(B, C, m, -1) @ L["wo"]
            x = F.layer_norm(h, h.shape[-1:])
            h = h + torch.relu(x @ L["w1"]) @ L["w2"]
            new.append((k, v))
        logits = F.layer_norm(h, h.shape[-1:]) @ self.wout + self.bias
        if start == 0:  # eos cannot be the first token: every sentence has >= 1 word
            logits[..., 0, self.eos] = float("-inf")
        return logits, [(k[:, 0], v[:, 0]) for k, v in new]  # cache of candidate 0

    def _prefix(self, cache, P):
        """The cache of the first P positions (a prefix shared by candidates)."""
        return [(k[:, :, :P], v[:, :, :P]) for k, v in cache]

    def _extend(self, past, new):
        """The cache `past` followed by the cache `new` of the next positions."""
        return [(torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in
                zip(past, new)]

    # ----- [paper] sampling (App. A.1) -----

    def sample(self, n, seed=0):
        """Draw n sentences: tokens [n,T] (pad_id(V) after the length), lengths [n], topics [n];
        autoregressive with a key/value cache, vectorised over sentences."""
        g = torch.Generator().manual_seed(int(seed))
        T, V = self.max_len, self.vocab_size
        topics = torch.randint(self.n_topics, (n,), generator=g)
        tokens = torch.full((n, T), pad_id(V), dtype=torch.long)
        lengths = torch.full((n,), T, dtype=torch.long)
        past = None
        prev = torch.full((n,), self.bos, dtype=torch.long)
        done = torch.zeros(n, dtype=torch.bool)
        for t in range(T):
            logits, new = self._forward(prev[:, None, None], t, topics, past)
            past = new if past is None else self._extend(past, new)
            x = torch.multinomial(logits[:, 0, 0].softmax(-1), 1, generator=g)[:, 0]
            ended = ~done & (x == self.eos)
            lengths[ended] = t
            done |= ended
            if done.all():
                break
            tokens[~done, t] = x[~done]
            prev = torch.where(done, 0, x)  # finished rows keep running on a dummy word
        return tokens, lengths, topics

    def sentences(self, n, seed=0):
        """Contract API: (tokens [n,T], lengths [n]) of fresh sentences."""
        tokens, lengths, _ = self.sample(n, seed=seed)
        return tokens, lengths

    # ----- [paper] exact probabilities (App. A.1) -----

    def _words(self, tokens, lengths):
        """Validate a batch; returns word ids widened to max_len (0 beyond each length: a
        sentence of length T < max_len still has its eos factor at position T), lengths, and
        the in-sentence mask [n,T] of the given width."""
        tokens, lengths, valid = _check_sentences(
            "TeacherLM", tokens, lengths, self.vocab_size, max_width=self.max_len,
            no_mask="marginalising a masked word would cost V times more. Put any word there: "
                    "the conditional at that position does not depend on it (every word has "
                    "positive probability under the teacher)")
        x = torch.zeros(len(tokens), self.max_len, dtype=torch.long)
        x[:, :tokens.shape[1]] = torch.where(valid, tokens, 0)
        return x, lengths, valid

    def _targets(self, x, lengths):
        """Next-token targets per output position p (input position p holds bos, x_1..): x_p
        inside the sentence, eos at p = length (< max_len), -1 (no factor) beyond."""
        n, T = x.shape
        p = torch.arange(T)
        tgt = torch.where(p < lengths[:, None], x, -1)
        tgt[(p == lengths[:, None]) & (lengths[:, None] < self.max_len)] = self.eos
        return tgt

    def _topic_log_joint(self, x, lengths):
        """log Pr(x | z) for every topic: (n, K), plus the full-forward log-probs (n*K, T, V+1)
        and caches, topic-major rows (row = z * n + i)."""
        n, T = x.shape
        K = self.n_topics
        inputs = torch.cat([torch.full((n, 1), self.bos), x[:, :T - 1]], 1).repeat(K, 1)
        topics = torch.arange(K).repeat_interleave(n)
        logits, cache = self._forward(inputs[:, None], 0, topics)
        logp = logits[:, 0].log_softmax(-1)  # (n*K, T, V+1)
        tgt = self._targets(x, lengths).repeat(K, 1)
        f = logp.gather(2, tgt.clamp_min(0)[..., None])[..., 0] * (tgt >= 0)
        return f.sum(1).view(K, n).T, f, logp, tgt, cache, topics

    def log_prob(self, tokens, lengths=None):
        """log Pr(x) = log Σ_z Pr(z) Pr(x | z) (App. A.1), [n] float64."""
        x, lengths, _ = self._words(tokens, lengths)
        lj = self._topic_log_joint(x, lengths)[0]
        return torch.logsumexp(lj, 1) - math.log(self.n_topics)

    def topic_posterior(self, tokens, lengths=None):
        """Pr(z | x) for every topic, [n, K] float64 (Bayes' rule on the teacher's joint)."""
        x, lengths, _ = self._words(tokens, lengths)
        return self._topic_log_joint(x, lengths)[0].softmax(1)

    def mlm_conditional(self, tokens, lengths=None, chunk=None):
        """Exact Pr(x_t = w | x_-t) for every position, [n,T,V] float64 (§2.1, App. A.1);
        `chunk`: sentences per batch (default: by size).

        Pr(x_t = w | x_-t) ∝ Σ_z Pr(x_<t | z) Pr(w | x_<t, z) Π_{s>t} Pr(x_s | x_<t, w,
        x_t+1..s-1, z) (with the eos factor at s = length < max_len). For each t the V
        candidates' suffixes run through the teacher as one batch over the cached prefix.
        Cost ≈ V * length^2 / 2 token evaluations per sentence and topic. Zero at t >= length.
        """
        x, lengths, valid = self._words(tokens, lengths)
        n, T = x.shape  # T = max_len
        out = torch.zeros(n, T, self.vocab_size, dtype=torch.float64)
        # small batches stay in cache: ~5e5 logits per batch was fastest here (1 sentence at
        # the default size; 4 and 16 sentences were 1.3x and 2x slower)
        chunk = chunk or max(1, 500_000 // (self.vocab_size * T * (self.vocab_size + 1)
                                             * self.n_topics))
        order = lengths.argsort()  # similar lengths share a chunk: less padded work
        for i in range(0, n, chunk):
            rows = order[i:i + chunk]
            out[rows] = self._conditional_chunk(x[rows], lengths[rows])
        return out[:, :valid.shape[1]] * valid[..., None]

    def _conditional_chunk(self, x, lengths):
        """mlm_conditional for one batch of word ids x [n, max_len]; returns [n, max_len, V]."""
        n, T = x.shape
        V, K = self.vocab_size, self.n_topics
        _, f, logp, tgt, cache, topics = self._topic_log_joint(x, lengths)
        prefix = f.cumsum(1) - f  # (n*K, T): log Pr(x_<t | z)
        out = torch.zeros(n, T, V, dtype=torch.float64)
        words = torch.arange(V)
        for t in range(int(lengths.max())):
            # suffix positions t+1..t+m carry the factors changed by x_t; the last factor is
            # at position length (eos) or length - 1 (a full-length sentence)
            m = min(T - 1, int(lengths.max())) - t
            lj = prefix[:, t, None] + logp[:, t, :V]  # (n*K, V)
            if m > 0:
                cand = torch.cat([words[None, :, None].expand(n * K, V, 1),
                                  x.repeat(K, 1)[:, None, t + 1:t + m].expand(n * K, V, m - 1)],
                                 2)  # (n*K, V, m): inputs w, x_t+1, ..., x_t+m-1
                past = self._prefix(cache, t + 1)
                logits, _ = self._forward(cand, t + 1, topics, past)  # (n*K, V, m, V+1)
                tg = tgt[:, t + 1:t + 1 + m]  # (n*K, m)
                suf = logits.gather(3, tg.clamp_min(0)[:, None, :, None].expand(-1, V, -1, 1))
                suf = suf[..., 0] - logits.logsumexp(3)  # log-probs of the actual next tokens
                lj = lj + (suf * (tg >= 0)[:, None]).sum(2)
            lj = torch.logsumexp(lj.view(K, n, V), 0)  # mix topics (uniform prior)
            out[:, t] = lj.softmax(-1)
        return out

    # ----- [paper] downstream task: the latent topic -----

    @property
    def tasks(self):
        """One sentence-level task: "topic", the latent z the teacher conditioned on."""
        return ["topic"]

    def n_classes(self, task):
        """"topic" is an n_topics-way classification."""
        if task != "topic":
            raise ValueError(f"TeacherLM: unknown task {task!r}; valid tasks: {self.tasks}")
        return self.n_topics

    def task_data(self, task, n, seed=0, label="posterior"):
        """(tokens, lengths, labels [n]) for "topic": label = argmax_z Pr(z | x) (Bayes optimal,
        default) or, with label="sampled", the topic the sentence was drawn with."""
        self.n_classes(task)
        if label not in ("posterior", "sampled"):
            raise ValueError(f"TeacherLM: label must be 'posterior' or 'sampled'; got {label!r}")
        tokens, lengths, topics = self.sample(n, seed=seed)
        if label == "sampled":
            return tokens, lengths, topics
        return tokens, lengths, self.topic_posterior(tokens, lengths).argmax(1)


# =========================================================================== [plumbing] CLI ===

def _parser():
    """The command line: one language, its size and seed, where to write (help= on each)."""
    p = argparse.ArgumentParser(description="Sample a synthetic language dataset (paper App. "
                                "A.1) with task labels and the generator's spec; reload it with "
                                "torch.load(FILE, weights_only=True).")
    p.add_argument("kind", choices=list(LANGUAGES),
                   help="which language (pcfg-small: the CPU-scale PCFG, PCFG_SMALL)")
    p.add_argument("--n", type=int, default=10000, help="number of sentences")
    p.add_argument("--seed", type=int, default=0, help="seed of the language and the sample")
    p.add_argument("--out", required=True, help="output file (.pt)")
    p.add_argument("--rules", default=None, help="pcfg only: read the grammar from this rule "
                   "file (format of PCFG.from_rules) instead of PCFG.random(seed)")
    p.add_argument("--conditionals", action="store_true",
                   help="also store the exact conditionals Pr(x_t|x_-t) [n,T,V] (large)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on 2 shared cores an uncapped run took "
                        "3 min instead of 12 s)")
    return p


def _argument_errors(args):
    """What is wrong with the arguments, checked before any sampling: a bad --out would
    otherwise fail after minutes of work."""
    bad = [f"--{k} must be >= 1 (got {getattr(args, k)})" for k in ("n", "threads")
           if getattr(args, k) < 1]
    if not 0 <= args.seed < 2**32:
        bad.append(f"--seed must be in 0..{2**32 - 1} (got {args.seed})")
    if args.rules and args.kind != "pcfg":
        bad.append(f"--rules only applies to pcfg (got kind {args.kind})")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out):
        bad.append(f"--out {args.out} is a directory; give a file name such as {args.kind}.pt")
    elif not os.path.isdir(out_dir):
        bad.append(f"--out {args.out}: directory {out_dir} does not exist; create it first")
    return bad


def main(argv=None):
    """Command line (App. A.1): sample one language's sentences, task labels and spec."""
    p = _parser()
    args = p.parse_args(argv)
    bad = _argument_errors(args)
    if bad:
        p.error("; ".join(bad))
    torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        lang = build_language(args.kind, args.seed, args.rules)
    except ValueError as e:
        p.error(f"--rules: {e}")
    print(f"language: {lang!r}", flush=True)
    tokens, lengths = lang.sentences(args.n, seed=args.seed)
    print(f"sampled {args.n} sentences, mean length {lengths.double().mean():.2f} "
          f"({time.time() - t0:.1f} s)", flush=True)
    out = {"spec": lang.spec(), "seed": args.seed, "tokens": tokens, "lengths": lengths,
           "labels": {}}
    for task in lang.tasks:  # each task gets its own fresh sentences, as the paper's sets do
        t, l, y = lang.task_data(task, args.n, seed=args.seed + 1)
        out["labels"][task] = {"tokens": t, "lengths": l, "labels": y}
        print(f"task {task}: {args.n} labelled sentences, {len(torch.unique(y))} distinct "
              f"labels ({time.time() - t0:.1f} s)", flush=True)
    if args.conditionals:
        cond = []
        for i in range(0, args.n, 500):
            cond.append(lang.mlm_conditional(tokens[i:i + 500], lengths[i:i + 500]))
            print(f"conditionals {min(i + 500, args.n)}/{args.n} ({time.time() - t0:.1f} s)",
                  flush=True)
        out["conditionals"] = torch.cat(cond)
    h, se = mlm_entropy(lang, n=min(args.n, 1000), seed=args.seed + 2)
    print(f"optimal MLM loss (entropy): {h:.4f} +- {se:.4f} nats", flush=True)
    torch.save(out, args.out)
    print(f"wrote {args.out} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
