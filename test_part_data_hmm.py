"""Tests of the HMM and teacher-LM languages (data.py section; paper §2.2, App. A.1).

Run: OMP_NUM_THREADS=1 python -m pytest -q test_part_data_hmm.py
"""
import io
import itertools
import json
import math

import numpy as np
import pytest
import torch

import data

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------- HMM ---

def _data_hmm_joint(h, x, states=None):
    """Brute force Pr(x) (or Pr(x, states)) by summing over every hidden sequence."""
    T = len(x)
    init, trans, emit = h.init.numpy(), h.trans.numpy(), h.emit.numpy()
    paths = (np.array(list(itertools.product(range(h.n_states), repeat=T)))
             if states is None else np.array([states]))  # (P, T)
    p = init[paths[:, 0]] * emit[paths[:, 0], x[0]]
    for t in range(1, T):
        p = p * trans[paths[:, t - 1], paths[:, t]] * emit[paths[:, t], x[t]]
    return float(p.sum())


def _data_hmm_tiny_blocks():
    """A 5-state, 6-word HMM with two blocks whose states and words are interleaved (not
    contiguous), so the block-by-block inference path with scattered columns is exercised."""
    rng = np.random.default_rng(3)
    S, V = 5, 6
    state_block = np.array([0, 1, 0, 1, 0])
    word_block = np.array([1, 0, 0, 1, 0, 1])
    trans = rng.random((S, S)) * (state_block[:, None] == state_block[None, :])
    emit = rng.random((S, V)) * (state_block[:, None] == word_block[None, :])
    init = rng.random(S)
    return data.HMM(init / init.sum(), trans / trans.sum(1, keepdims=True),
                    emit / emit.sum(1, keepdims=True), length=4)


@pytest.mark.parametrize("which", ["dense", "blocks"])
def test_data_hmm_conditional_equals_brute_force(which):
    h = (data.HMM.random(3, 4, seed=1, n_blocks=1, length=4, emit_concentration=1.0)
         if which == "dense" else _data_hmm_tiny_blocks())
    tokens, _ = h.sample(6, seed=0)
    lengths = torch.tensor([4, 4, 3, 2, 1, 4])
    cond = h.mlm_conditional(tokens, lengths)
    assert cond.dtype == torch.float64 and cond.shape == (6, 4, h.vocab_size)
    for i in range(6):
        L = int(lengths[i])
        x = tokens[i, :L].tolist()
        for t in range(L):
            joint = []
            for w in range(h.vocab_size):
                y = list(x)
                y[t] = w
                joint.append(_data_hmm_joint(h, y))
            exact = torch.tensor(joint, dtype=torch.float64) / sum(joint)
            assert torch.allclose(cond[i, t], exact, atol=1e-10, rtol=0)
        assert (cond[i, L:] == 0).all()


def test_data_hmm_state_posterior_equals_brute_force():
    h = _data_hmm_tiny_blocks()
    tokens, _ = h.sample(4, seed=1)
    post = h.state_posterior(tokens)
    for i in range(4):
        x = tokens[i].tolist()
        px = _data_hmm_joint(h, x)
        exact = torch.zeros(4, h.n_states, dtype=torch.float64)
        for hs in itertools.product(range(h.n_states), repeat=4):
            p = _data_hmm_joint(h, x, hs)
            for t in range(4):
                exact[t, hs[t]] += p / px
        assert torch.allclose(post[i], exact, atol=1e-10, rtol=0)


def test_data_hmm_sampling_matches_joint():
    h = data.HMM.random(2, 3, seed=4, n_blocks=1, length=3, trans_concentration=1.0,
                        emit_concentration=1.0)
    N = 200_000
    tokens, states = h.sample(N, seed=7)
    code = (tokens * 2 + states) @ torch.tensor([36, 6, 1])  # one id per (words, states) path
    freq = torch.bincount(code, minlength=216).double() / N
    worst = 0.0
    for x in itertools.product(range(3), repeat=3):
        for hs in itertools.product(range(2), repeat=3):
            p = _data_hmm_joint(h, x, hs)
            k = sum((2 * xi + hi) * m for xi, hi, m in zip(x, hs, (36, 6, 1)))
            worst = max(worst, abs(float(freq[k]) - p) / math.sqrt(p * (1 - p) / N + 1e-12))
    assert worst < 5.0  # no cell more than 5 standard errors off (216 cells)


def test_data_hmm_default_conditionals_normalised():
    h = data.HMM.random(seed=0)
    tokens, lengths = h.sentences(200, seed=0)
    assert tokens.shape == (200, 16) and (lengths == 16).all()
    cond = h.mlm_conditional(tokens, lengths)
    assert torch.isfinite(cond).all() and (cond >= 0).all()
    assert torch.allclose(cond.sum(-1), torch.ones(200, 16, dtype=torch.float64), atol=1e-12)
    # a sentence's own word always has positive conditional probability
    assert (cond.gather(2, tokens[..., None]) > 0).all()
    post = h.state_posterior(tokens)
    assert torch.allclose(post.sum(-1), torch.ones(200, 16, dtype=torch.float64), atol=1e-12)
    # padding beyond the length is ignored
    short = tokens.clone()
    short[:, 10:] = data.pad_id(h.vocab_size)
    c2 = h.mlm_conditional(short, torch.full((200,), 10))
    assert (c2[:, 10:] == 0).all()
    assert torch.allclose(c2.sum(-1)[:, :10], torch.ones(200, 10, dtype=torch.float64))


def test_data_hmm_masked_words_are_marginalised():
    h = _data_hmm_tiny_blocks()
    V = h.vocab_size
    tokens, _ = h.sample(6, seed=2)
    lengths = torch.tensor([4, 4, 4, 3, 2, 4])
    masked = tokens.clone()
    masked[:, 1] = data.mask_id(V)  # one mask: the conditional there does not depend on x_2
    masked[0, 2] = data.mask_id(V)  # sentence 0: two masks
    masked[4, 0] = data.mask_id(V)  # sentence 4: nothing observed but x_2
    cond, cm = h.mlm_conditional(tokens, lengths), h.mlm_conditional(masked, lengths)
    one = [1, 2, 3, 5]  # sentences with a single mask: unchanged conditional there
    assert torch.allclose(cm[one, 1], cond[one, 1], atol=1e-12)
    for i in (0, 3, 4):  # every position against brute force, masked words summed out
        L = int(lengths[i])
        for t in range(L):
            joint = torch.zeros(V, dtype=torch.float64)
            free = [s for s in range(L) if s != t and masked[i, s] == data.mask_id(V)]
            for w in range(V):
                for fill in itertools.product(range(V), repeat=len(free)):
                    y = tokens[i, :L].tolist()
                    y[t] = w
                    for s, u in zip(free, fill):
                        y[s] = u
                    joint[w] += _data_hmm_joint(h, y)
            assert torch.allclose(cm[i, t], joint / joint.sum(), atol=1e-10, rtol=0)


def test_data_hmm_small_cpu_language():
    h = data.HMM.random(20, 50, n_blocks=2, seed=0)
    tokens, lengths = h.sentences(2000, seed=1)
    cond = h.mlm_conditional(tokens, lengths)
    ent = -(cond * cond.clamp_min(1e-300).log()).sum(-1).mean()
    assert 2.0 < float(ent) < math.log(25)  # at most log(V / n_blocks)


def test_data_hmm_invalid_inputs_raise():
    good = data.HMM.random(3, 4, seed=0, n_blocks=1)
    init, trans, emit = good.init.numpy(), good.trans.numpy(), good.emit.numpy()
    bad_row = trans.copy()
    bad_row[1, 0] += 0.1
    with pytest.raises(ValueError, match=r"trans row 1 .* off 1 by 0\.1"):
        data.HMM(init, bad_row, emit)
    neg = emit.copy()
    neg[2, 0], neg[2, 1] = -0.1, neg[2, 1] + neg[2, 0] + 0.1
    with pytest.raises(ValueError, match="emit row 2 .*negative"):
        data.HMM(init, trans, neg)
    nan = torch.tensor(init)
    nan[0] = float("nan")
    with pytest.raises(ValueError, match="init .*NaN"):
        data.HMM(nan, trans, emit)
    with pytest.raises(ValueError, match=r"trans must have shape \[S,S\]"):
        data.HMM(init, trans[:2], emit)
    with pytest.raises(ValueError, match=r"emit must have shape"):
        data.HMM(init, trans, emit[:2])
    with pytest.raises(ValueError, match="HMM trans: expected a numeric array"):
        data.HMM(init, "abc", emit)
    with pytest.raises(ValueError, match="n_blocks"):
        data.HMM.random(3, 4, n_blocks=5)
    tokens, _ = good.sample(3, seed=0)
    tokens[1, 2] = data.pad_id(4)  # padding inside the length
    with pytest.raises(ValueError, match="sentence 1 position 2 holds id 5"):
        good.mlm_conditional(tokens)
    with pytest.raises(ValueError, match="lengths"):
        good.mlm_conditional(tokens[:, :3], torch.tensor([3, 0, 3]))
    blocks = _data_hmm_tiny_blocks()
    with pytest.raises(ValueError, match="sentence 0 has probability 0"):
        blocks.mlm_conditional(torch.tensor([[1, 0, 1, 1]]))  # words of two blocks
    with pytest.raises(ValueError, match="valid tasks are '1'..'16'"):
        good.task_data("17", 5)
    with pytest.raises(ValueError, match="valid tasks"):
        good.n_classes("A")


def test_data_hmm_spec_round_trip():
    h = data.HMM.random(10, 12, seed=5, n_blocks=3, length=7)
    spec = h.spec()
    assert spec["kind"] == "hmm"
    json.dumps(spec)  # plain Python types only
    buf = io.BytesIO()
    torch.save({"language": spec}, buf)
    buf.seek(0)
    spec2 = torch.load(buf, weights_only=True)["language"]
    h2 = data.HMM.from_spec(spec2)
    assert h2.spec() == spec  # spec is a stable identity (no drift from renormalising)
    assert torch.equal(h.init, h2.init) and torch.equal(h.trans, h2.trans)
    assert torch.equal(h.emit, h2.emit) and h2.max_len == 7
    tokens, lengths = h.sentences(50, seed=2)
    assert torch.equal(tokens, h2.sentences(50, seed=2)[0])
    assert torch.equal(h.mlm_conditional(tokens, lengths), h2.mlm_conditional(tokens, lengths))


def test_data_hmm_task_labels():
    h = data.HMM.random(12, 20, seed=2, n_blocks=2)
    assert h.tasks == ["6", "10"] and h.n_classes("10") == 12
    tokens, lengths, labels = h.task_data("10", 300, seed=3)
    assert labels.shape == (300,) and labels.dtype == torch.long
    assert ((labels >= 0) & (labels < 12)).all()
    _, states = h.sample(300, seed=3)
    _, _, sampled = h.task_data("10", 300, seed=3, label="sampled")
    assert torch.equal(sampled, states[:, 9])
    # the Bayes label beats the majority class at predicting the sampled state
    assert (labels == sampled).double().mean() > torch.bincount(sampled).max() / 300


# ------------------------------------------------------------------------------ teacher LM ---

def _data_teacher_reference_log_joint(lm, tokens, lengths):
    """log Pr(x | z) for every topic, [n, K], by a plain full-sequence causal transformer on the
    teacher's weights (PyTorch's scaled_dot_product_attention; no cache, no candidate batching)."""
    import torch.nn.functional as F
    n, T = tokens.shape
    out = torch.zeros(n, lm.n_topics, dtype=torch.float64)
    for i in range(n):
        L = int(lengths[i])
        x = tokens[i, :L]
        inp = torch.cat([torch.tensor([lm.bos]), x])[:lm.max_len]  # bos, x_1..x_L (<= T)
        tgt = torch.cat([x, torch.tensor([lm.eos])])[:len(inp)]  # x_1..x_L, eos if L < T
        for z in range(lm.n_topics):
            h = lm.emb[inp] + lm.pos[:len(inp)] + lm.topic[z]
            for W in lm.layers:
                q, k, v = (F.layer_norm(h, h.shape[-1:]) @ W["wqkv"]).chunk(3, -1)
                q, k, v = (a.view(len(inp), lm.n_heads, -1).transpose(0, 1) for a in (q, k, v))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                h = h + a.transpose(0, 1).reshape(len(inp), -1) @ W["wo"]
                h = h + torch.relu(F.layer_norm(h, h.shape[-1:]) @ W["w1"]) @ W["w2"]
            logits = F.layer_norm(h, h.shape[-1:]) @ lm.wout + lm.bias
            logits[0, lm.eos] = float("-inf")
            out[i, z] = logits.log_softmax(-1).gather(1, tgt[:, None]).sum()
    return out


def _data_teacher_tiny(V=3, T=3, seed=1):
    return data.TeacherLM(vocab_size=V, length=T, d_model=8, n_heads=2, n_topics=2,
                          temperature=0.7, seed=seed)


def test_data_teacher_log_prob_matches_reference():
    lm = _data_teacher_tiny(V=6, T=6, seed=2)
    tokens, lengths, _ = lm.sample(12, seed=0)
    ref = _data_teacher_reference_log_joint(lm, tokens, lengths)
    assert torch.allclose(lm.log_prob(tokens, lengths), ref.logsumexp(1) - math.log(2),
                          atol=1e-10, rtol=0)
    assert torch.allclose(lm.topic_posterior(tokens, lengths), ref.softmax(1), atol=1e-10)


def test_data_teacher_joint_sums_to_one_and_sampling_matches():
    lm = _data_teacher_tiny()
    sents = [list(s) + [data.pad_id(3)] * (3 - L)
             for L in (1, 2, 3) for s in itertools.product(range(3), repeat=L)]
    tokens = torch.tensor(sents)
    lengths = (tokens < 3).sum(1)
    p = _data_teacher_reference_log_joint(lm, tokens, lengths).exp().mean(1)  # uniform topics
    assert abs(float(p.sum()) - 1) < 1e-12  # every sentence (with eos or truncated) counted once
    N = 40_000
    sample, slen, _ = lm.sample(N, seed=3)
    assert ((sample >= 3) == (torch.arange(3) >= slen[:, None])).all()  # pad exactly after length
    code = {tuple(s): j for j, s in enumerate(sents)}
    freq = torch.bincount(torch.tensor([code[tuple(s)] for s in sample.tolist()]),
                          minlength=len(sents)).double() / N
    z = (freq - p).abs() / (p * (1 - p) / N).sqrt()
    assert float(z.max()) < 5.0


@pytest.mark.parametrize("V,T", [(3, 3), (6, 6)])
def test_data_teacher_conditional_equals_brute_force(V, T):
    lm = _data_teacher_tiny(V, T, seed=V)
    tokens, lengths, _ = lm.sample(8, seed=1)
    cond = lm.mlm_conditional(tokens, lengths, chunk=3)  # chunks mix lengths: exercises masking
    assert cond.shape == (8, T, V) and cond.dtype == torch.float64
    for i in range(8):
        L = int(lengths[i])
        for t in range(L):
            cands = tokens[i].repeat(V, 1)
            cands[:, t] = torch.arange(V)
            joint = _data_teacher_reference_log_joint(lm, cands, torch.full((V,), L))
            exact = joint.logsumexp(1).softmax(0)
            assert torch.allclose(cond[i, t], exact, atol=1e-10, rtol=0)
        assert (cond[i, L:] == 0).all()
    # a narrower token tensor (width = the longest sentence) gives the same answers
    W = int(lengths.max())
    assert torch.allclose(lm.mlm_conditional(tokens[:, :W], lengths), cond[:, :W], atol=1e-12)
    assert torch.allclose(lm.log_prob(tokens[:, :W], lengths), lm.log_prob(tokens, lengths),
                          atol=1e-12)


def test_data_teacher_default_language():
    lm = data.TeacherLM()
    tokens, lengths = lm.sentences(300, seed=0)
    V = lm.vocab_size
    assert tokens.shape == (300, 24) and lengths.min() >= 1 and lengths.max() <= 24
    inside = torch.arange(24) < lengths[:, None]
    assert ((tokens < V) == inside).all() and (tokens[~inside] == data.pad_id(V)).all()
    assert 8 < lengths.double().mean() < 22  # eos ends most sentences before 24
    short = lengths.argsort()[:3]
    cond = lm.mlm_conditional(tokens[short], lengths[short])
    assert torch.isfinite(cond).all()
    sums = cond.sum(-1)
    assert torch.allclose(sums[inside[short]], torch.ones((), dtype=torch.float64), atol=1e-12)
    assert (sums[~inside[short]] == 0).all()
    ent = -(cond * cond.clamp_min(1e-300).log()).sum(-1)[inside[short]].mean()
    assert float(ent) < 0.8 * math.log(V)  # a peaked, learnable language


def test_data_teacher_invalid_inputs_raise():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        data.TeacherLM(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="temperature"):
        data.TeacherLM(temperature=0)
    with pytest.raises(ValueError, match="vocab_size"):
        data.TeacherLM(vocab_size=0)
    lm = _data_teacher_tiny(4, 5)
    tokens, lengths, _ = lm.sample(3, seed=0)
    tokens[2, 0] = -1
    with pytest.raises(ValueError, match="sentence 2 position 0 holds id -1"):
        lm.mlm_conditional(tokens, lengths)
    with pytest.raises(ValueError, match="lengths"):
        lm.log_prob(tokens.abs(), torch.tensor([1, 2, 6]))
    masked = tokens.abs()
    masked[1, 0] = data.mask_id(4)
    with pytest.raises(ValueError, match="sentence 1 position 0 holds mask_id"):
        lm.mlm_conditional(masked, lengths)
    with pytest.raises(ValueError, match="T <= 5"):
        lm.mlm_conditional(torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"valid tasks: \['topic'\]"):
        lm.task_data("A", 5)
    with pytest.raises(ValueError, match="unknown"):
        data.TeacherLM.from_spec({**lm.spec(), "layers": 3})


def test_data_teacher_spec_round_trip():
    lm = _data_teacher_tiny(5, 6, seed=7)
    spec = lm.spec()
    assert spec["kind"] == "teacher"
    json.dumps(spec)
    buf = io.BytesIO()
    torch.save({"language": spec}, buf)
    buf.seek(0)
    lm2 = data.TeacherLM.from_spec(torch.load(buf, weights_only=True)["language"])
    for a, b in zip([lm.emb, lm.pos, lm.topic, lm.wout, lm.bias] +
                    [w for L in lm.layers for w in L.values()],
                    [lm2.emb, lm2.pos, lm2.topic, lm2.wout, lm2.bias] +
                    [w for L in lm2.layers for w in L.values()]):
        assert torch.equal(a, b)
    tokens, lengths = lm.sentences(20, seed=4)
    t2, l2 = lm2.sentences(20, seed=4)
    assert torch.equal(tokens, t2) and torch.equal(lengths, l2)
    assert torch.equal(lm.mlm_conditional(tokens, lengths), lm2.mlm_conditional(tokens, lengths))


def test_data_teacher_task_labels():
    lm = data.TeacherLM(vocab_size=20, length=10, d_model=16, seed=3)
    assert lm.tasks == ["topic"] and lm.n_classes("topic") == 2
    tokens, lengths, labels = lm.task_data("topic", 400, seed=5)
    assert labels.shape == (400,) and ((labels >= 0) & (labels < 2)).all()
    _, _, topics = lm.sample(400, seed=5)
    _, _, sampled = lm.task_data("topic", 400, seed=5, label="sampled")
    assert torch.equal(sampled, topics)
    assert (labels == topics).double().mean() > 0.6  # the topic is visible in the sentence


def test_data_teacher_opt_adapter_needs_transformers(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install transformers"):
        data.OPTTeacher("anywhere")


def test_data_teacher_opt_adapter_tiny_local_model(tmp_path):
    # skipped without the optional transformers package (not in requirements.txt); where it is
    # installed, importing it takes most of this test's time
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="no local model"):
        data.OPTTeacher(tmp_path / "missing")
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                 num_attention_heads=2, max_position_embeddings=32,
                                 word_embed_proj_dim=16)
    transformers.OPTForCausalLM(cfg).save_pretrained(tmp_path)
    lm = data.OPTTeacher(tmp_path, top_k=4, length=4)
    tokens, lengths = lm.sentences(6, seed=0)
    # log Pr(x) straight from the HF model, restricted to the top-k words + eos
    model = lm.model
    for i in range(6):
        L = int(lengths[i])
        ids = torch.cat([torch.tensor([cfg.bos_token_id]), lm.out_ids[tokens[i, :L]]])
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double()[:, lm.out_ids]
        logits[0, -1] = float("-inf")
        tgt = torch.cat([tokens[i, :L], torch.tensor([4])]) if L < 4 else tokens[i, :L]
        ref = logits[:len(tgt)].log_softmax(-1).gather(1, tgt[:, None]).sum()
        assert abs(float(lm.log_prob(tokens[i:i + 1], lengths[i:i + 1])[0] - ref)) < 1e-10
    cond = lm.mlm_conditional(tokens, lengths)
    for i in range(6):
        for t in range(int(lengths[i])):
            cands = tokens[i].repeat(4, 1)
            cands[:, t] = torch.arange(4)
            exact = lm.log_prob(cands, lengths[i].repeat(4)).softmax(0)
            assert torch.allclose(cond[i, t], exact, atol=1e-10, rtol=0)
    assert torch.equal(data.TeacherLM.from_spec(lm.spec()).mlm_conditional(tokens, lengths), cond)
