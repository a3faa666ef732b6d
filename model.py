"""Masked-LM networks of the paper (App. B.1): BERT-style transformers (post- or pre-LN), the
bidirectional LSTMs of its HMM experiments (§2.2), named size presets, and grow(), which embeds
a model in a wider and deeper one computing the same function (App. B.1.3).

    python model.py                 # list the presets with their parameter counts

Interface (used by train.py, hessian.py, probe.py):
    config = config_from_preset("tf-2m", vocab_size=V + 2, pad_id=V + 1, max_len=32)
    net = build(config)             # nn.Module with .config
    logits = net(tokens)            # [B, T, vocab_size]; tokens == config.pad_id are padding
    logits = net(tokens, masked_at)  # [B, vocab_size]: row b at masked_at[b] (the MLM step)
    h = net.features(tokens)        # [B, T, d], the last-layer representations probes read
    big = grow(net, width=2, extra_layers=1)   # same logits, 2x heads/width, one more block

Reading order: ModelConfig and PRESETS (the sizes), attention and its fused form (the switch
FUSED_ATTENTION), initialisation and the padding mask, the transformer's blocks, the LSTM, grow
with the post-LN blocks it stacks; then the plumbing (config_from_preset, the preset listing).
.bench/check_grow.py measures grow() against the paper's zero-filled blocks.
"""
import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_DIM = 64  # App. B.1.2, following BERT: every attention head has dimension 64
# The switch between attention() (False: the plain form, what a student writes) and PyTorch's
# fused kernel (True: fast_attention, for GPU runs: train.py --fused-attention); the tests hold
# the two equal. Attention dropout (training with dropout > 0) always takes the fused kernel.
FUSED_ATTENTION = False
LN_EPS = 1e-5  # LayerNorm eps (PyTorch's default); grow()'s post-LN depth construction uses it
ARCHS = ("transformer", "lstm")
LNS = ("post", "pre")
SPLITS = ("even", "random")  # grow(): how a weight that reads k copies is shared among them


@dataclass
class ModelConfig:
    """Everything needed to rebuild a network; plain types, so asdict() goes into checkpoints."""
    vocab_size: int  # words + special tokens (data.py: V + N_SPECIAL)
    pad_id: int  # token id of padding (data.py: pad_id(V)); keys there are masked out
    max_len: int  # number of learned positions (transformer); longest accepted input
    arch: str = "transformer"  # "transformer" | "lstm"
    n_layers: int = 2  # transformer blocks, or stacked bidirectional LSTM layers
    n_heads: int = 1  # transformer only: d = head_dim * n_heads
    ln: str = "pre"  # transformer only: "post" (paper's text) | "pre" (authors' released code)
    dropout: float = 0.0  # on embeddings, attention, residual branches / between LSTM layers
    lstm_hidden: int = 128  # LSTM only: hidden size H per direction; features have d = 2H
    head_dim: int = HEAD_DIM  # transformer only: the paper's (BERT's) 64; 32 in tf-small, tf-deep

    def __post_init__(self):
        for name, value, allowed in (("arch", self.arch, ARCHS), ("ln", self.ln, LNS)):
            if value not in allowed:
                raise ValueError(f"ModelConfig: {name} must be one of {allowed}, got {value!r}")
        for name in ("vocab_size", "max_len", "n_layers", "n_heads", "lstm_hidden", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig: {name} must be an integer >= 1, got {v!r}")
        if not (isinstance(self.pad_id, int) and 0 <= self.pad_id < self.vocab_size):
            raise ValueError(f"ModelConfig: pad_id must be in [0, vocab_size={self.vocab_size}), "
                             f"got {self.pad_id!r} (data.py: pad_id(V) = V + 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig: dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def d(self):
        """Width of the representations that features() returns."""
        return self.head_dim * self.n_heads if self.arch == "transformer" else 2 * self.lstm_hidden


# Sizes (§2.2: transformers 2M-730M, LSTMs 10M-135M; the shapes are ours). The paper-scale
# presets (-2m ... -730m) are named for their parameter count, within 5%, at their family's
# REFERENCE vocabulary (BERT's; the paper's HMM), the CPU presets for the language they saturate.
# On a small vocabulary a transformer is much smaller (train.py: tf-deep 201,354 on pcfg-deep).
REFERENCE = {"transformer": dict(vocab_size=30522, pad_id=0, max_len=128),
             "lstm": dict(vocab_size=202, pad_id=201, max_len=32)}
PRESETS = {
    "tf-small": dict(arch="transformer", n_heads=1, n_layers=2, head_dim=32),  # CPU: "pcfg-small"
    "tf-deep": dict(arch="transformer", n_heads=2, n_layers=4, head_dim=32),  # CPU: "pcfg-deep"
    "tf-2m": dict(arch="transformer", n_heads=1, n_layers=2),
    "tf-4m": dict(arch="transformer", n_heads=2, n_layers=1),
    "tf-9m": dict(arch="transformer", n_heads=4, n_layers=1),
    "tf-41m": dict(arch="transformer", n_heads=8, n_layers=8),
    "tf-235m": dict(arch="transformer", n_heads=16, n_layers=16),
    "tf-730m": dict(arch="transformer", n_heads=24, n_layers=24),
    "lstm-small": dict(arch="lstm", lstm_hidden=32, n_layers=2),  # CPU: "hmm-small"
    "lstm-4m": dict(arch="lstm", lstm_hidden=128, n_layers=10),  # §2.3: "the smallest 4M model"
    "lstm-10m": dict(arch="lstm", lstm_hidden=192, n_layers=12),
    "lstm-36m": dict(arch="lstm", lstm_hidden=512, n_layers=6),
    "lstm-135m": dict(arch="lstm", lstm_hidden=640, n_layers=14),
}


# =============== the paper's models (App. B.1): BERT-style transformer, bidirectional LSTM, grow()

def attention(q, k, v, keep):
    """Scaled dot-product attention of every head (App. B.1.2; Vaswani et al. 2017):

        Attn(Q, K, V) = softmax(Q K^T / sqrt(d_head) + M) V,   M[s, t] = -inf if key t is padding

    so that no position reads a padded one. q, k, v: [B, n_heads, T, d_head] (each head's
    queries, keys, values); keep: [B, T] bool, True at real tokens (at least one per row).
    Returns [B, n_heads, T, d_head], in q's dtype and device. SelfAttention runs this form;
    FUSED_ATTENTION = True runs PyTorch's fused kernel instead (fast_attention, tested equal)."""
    # BEGIN EXERCISE attention
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v
    # END EXERCISE attention


def fast_attention(q, k, v, keep, dropout=0.0):
    """attention() through PyTorch's fused kernel, plus attention dropout while training."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :],
                                          dropout_p=dropout)


def _init_weights(module):
    """BERT initialisation: N(0, 0.02) weights, zero biases, LayerNorm gain 1 and bias 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LSTM):
        for name, p in module.named_parameters():
            nn.init.normal_(p, std=0.02) if name.startswith("weight") else nn.init.zeros_(p)


def _keep_mask(tokens, config):
    """True at real tokens; rows that are all padding keep every position (avoids NaN)."""
    if tokens.dim() != 2 or tokens.shape[1] > config.max_len:
        raise ValueError(f"tokens must be [B, T <= max_len={config.max_len}], got "
                         f"{tuple(tokens.shape)}")

    keep = tokens != config.pad_id
    return keep | ~keep.any(1, keepdim=True)


class SelfAttention(nn.Module):
    """Multi-head self-attention, head dimension head_dim (BERT's 64; 32 in the CPU presets),
    padded keys masked (App. B.1.2)."""

    def __init__(self, config):
        super().__init__()
        d = config.d
        self.n_heads, self.head_dim, self.dropout = config.n_heads, config.head_dim, config.dropout
        # rows: [queries; keys; values], head j at rows hd*j..hd*j+hd-1
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)  # the output matrix O
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, h, keep):
        B, T, d = h.shape
        q, k, v = self.qkv(h).split(d, dim=2)
        q, k, v = (x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for x in (q, k, v))  # (B, nh, T, hd)
        dropout = self.dropout if self.training else 0.0
        y = (fast_attention(q, k, v, keep, dropout) if FUSED_ATTENTION or dropout
             else attention(q, k, v, keep))
        y = y.transpose(1, 2).reshape(B, T, d)  # heads side by side
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise MLP of width 4d with GeLU (App. B.1.2)."""

    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.d, 4 * config.d)
        self.proj = nn.Linear(4 * config.d, config.d)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, h):
        return self.drop(self.proj(F.gelu(self.fc(h))))


class Block(nn.Module):
    """One transformer block: post-LN (the paper's text)  v = LN(h + Attn(h)), h' = LN(v + MLP(v));
    pre-LN (the authors' released code)  v = h + Attn(LN(h)), h' = v + MLP(LN(v))."""

    def __init__(self, config):
        super().__init__()
        self.pre = config.ln == "pre"
        self.ln_1 = nn.LayerNorm(config.d, eps=LN_EPS)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d, eps=LN_EPS)
        self.mlp = MLP(config)

    def forward(self, h, keep, masked_at=None):
        """h' [B, T, d], or with `masked_at` [B] only h'[b, masked_at[b]], [B, d]: the MLP is
        position-wise, so it may skip the rows no one reads (attention reads them all)."""
        rows = (slice(None) if masked_at is None
                else (torch.arange(len(masked_at), device=masked_at.device), masked_at))
        if self.pre:
            h = h + self.attn(self.ln_1(h), keep)
            h = h[rows]
            return h + self.mlp(self.ln_2(h))
        v = self.ln_1(h + self.attn(h, keep))[rows]
        return self.ln_2(v + self.mlp(v))


class Transformer(nn.Module):
    """BERT-style masked LM (App. B.1.2): h_0 = LN(W_E[x] + P) with learned positions P, then
    the blocks (pre-LN: and a final LayerNorm), logits = h_L W_E^T + b with the token embedding
    W_E tied to the output layer. Outputs at real positions do not depend on padded ones."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        d = config.d
        self.wte = nn.Embedding(config.vocab_size, d)  # W_E, also the output layer
        self.wpe = nn.Embedding(config.max_len, d)  # learned positions
        self.ln_emb = nn.LayerNorm(d, eps=LN_EPS)  # h_0 = LN(embedding)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(d, eps=LN_EPS) if config.ln == "pre" else None
        self.out_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.apply(_init_weights)

    def features(self, tokens, masked_at=None):
        """h_L: last-layer representations [B, T, d]; with `masked_at` (a position per row, [B])
        only h_L[b, masked_at[b]], [B, d]: the last block's MLP then runs on B rows, not B * T."""
        keep = _keep_mask(tokens, self.config)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.drop(self.ln_emb(self.wte(tokens) + self.wpe(pos)))  # (B, T, d)
        for i, block in enumerate(self.blocks):
            h = block(h, keep, masked_at if i == len(self.blocks) - 1 else None)
        return self.ln_f(h) if self.ln_f is not None else h

    def forward(self, tokens, masked_at=None):
        """Logits h_L W_E^T + b, [B, T, vocab_size]; with `masked_at` [B], at those positions:
        [B, vocab_size] (the MLM loss of one masked word per sentence reads no other)."""
        return self.features(tokens, masked_at) @ self.wte.weight.T + self.out_bias


class LSTM(nn.Module):
    """Bidirectional LSTM masked LM (the paper's HMM models, §2.2): embed [vocab, H], then
    nn.LSTM(H, H, n_layers, bidirectional) with PyTorch's parameter names and gate order
    (i, f, g, o: hessian.py's FunctionalLSTM re-implements it), then head [vocab, 2H]. Features:
    the top layer's [forward, backward] states, d = 2H. Padding is a suffix (data.py's
    convention); padded rows are packed, so the backward direction starts at the last real token."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        H = config.lstm_hidden
        self.embed = nn.Embedding(config.vocab_size, H)
        self.drop = nn.Dropout(config.dropout)
        self.lstm = nn.LSTM(H, H, config.n_layers, batch_first=True, bidirectional=True,
                            dropout=config.dropout if config.n_layers > 1 else 0.0)
        self.head = nn.Linear(2 * H, config.vocab_size)
        self.apply(_init_weights)

    def features(self, tokens):
        """Top layer's [forward, backward] states, [B, T, 2H]."""
        keep = _keep_mask(tokens, self.config)
        x = self.drop(self.embed(tokens))  # (B, T, H)
        if bool(keep.all()):  # no padding (fixed-length HMM sentences): nothing to pack
            return self.lstm(x)[0]
        lengths = keep.sum(1).cpu()  # padding is a suffix
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out = self.lstm(packed)[0]
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                total_length=tokens.shape[1])[0]

    def forward(self, tokens, masked_at=None):
        """Logits [B, T, vocab_size], or with `masked_at` [B] only at masked_at[b]: [B, vocab]."""
        h = self.features(tokens)
        if masked_at is not None:
            h = h[torch.arange(len(masked_at), device=masked_at.device), masked_at]
        return self.head(self.drop(h))


def _deepen_post_ln(state, n_layers, extra_layers, s=0.5):
    """Exact post-LN blocks on top (grow()). With N(y) = P y / sqrt(var(y) + eps), P centring,
    and c > 0: N(c N_e(y)) = N_e'(y) c / sqrt(c^2 + eps), e' = eps e / (c^2 + eps): a LayerNorm of
    a scalar-gain, bias-free LayerNorm output normalises y again, with a smaller effective eps.
    So: the old last block's y = v + MLP(v) is scaled by s (its N(y) then has effective eps
    eps / s^2), its second LayerNorm gets gain c, bias 0; the new LayerNorms gain sqrt(c^2 + eps),
    bias 0, except the last: gamma sqrt(c^2 + eps) / c and beta (the old last gain and bias). With
    c^2 = eps (s^(-2/m) - 1) over the m = 2 * extra_layers new LayerNorms the effective eps is
    back to eps at the last one, whose output is gamma N(y) + beta = h_L. Edits `state`."""
    old, top = f"blocks.{n_layers - 1}.", f"blocks.{n_layers + extra_layers - 1}.ln_2."
    m = 2 * extra_layers  # LayerNorms applied by the new blocks
    c = math.sqrt(LN_EPS * (s ** (-2 / m) - 1))  # brings the effective eps back to LN_EPS
    g = math.sqrt(c * c + LN_EPS)  # keeps the scalar factor at c through every new LayerNorm
    gamma, beta = state[old + "ln_2.weight"], state[old + "ln_2.bias"]
    for name in ("ln_1.weight", "ln_1.bias", "mlp.proj.weight", "mlp.proj.bias"):
        state[old + name] = state[old + name] * s  # y = v + MLP(v) becomes s * y
    state[old + "mlp.fc.weight"] = state[old + "mlp.fc.weight"] / s
    state[old + "ln_2.weight"], state[old + "ln_2.bias"] = (
        torch.full_like(gamma, c), torch.zeros_like(beta))
    for i in range(n_layers, n_layers + extra_layers):
        for ln in ("ln_1", "ln_2"):
            state[f"blocks.{i}.{ln}.weight"] = torch.full_like(gamma, g)
            state[f"blocks.{i}.{ln}.bias"] = torch.zeros_like(beta)
    state[top + "weight"], state[top + "bias"] = gamma * (g / c), beta


def build(config):
    """Network for `config`: a Transformer or an LSTM masked LM."""
    return Transformer(config) if config.arch == "transformer" else LSTM(config)


def grow(model, width=2, extra_layers=0, seed=0, split="even"):
    """App. B.1.3: the model embedded in one with `width` = k times the heads, features and MLP
    units (LSTM: hidden units) and `extra_layers` more transformer blocks on top, computing the
    same logits (exactly, up to float rounding). The source model is left unchanged.

    Width: every feature, head, MLP unit and LSTM unit (per gate, per direction) is copied k
    times and every weight that reads copies is split among them: split="even", w/k to each
    copy; split="random", w times fractions drawn per weight entry, uniform in [0.5, 1.5]
    normalised to sum 1 over the k copies (a torch.Generator seeded `seed`). Each residual
    stream / LSTM state is then exactly [h, ..., h]. The tied output layer would give k times
    the logits, so the LayerNorm producing h_L (pre-LN: ln_f; post-LN: the last block's ln_2)
    has its gain and bias divided by k (features() become [h, ..., h] / k); the LSTM's head
    divides by k instead. (Why per entry, and why "even" copies stay copies: the README.)
    Depth (transformers): new blocks from build() under torch.manual_seed(seed) inside
    torch.random.fork_rng, with zero attention and MLP output projections: the identity on a
    pre-LN stream; on a post-LN stream call _deepen_post_ln(state, config.n_layers,
    extra_layers) on the grown state dict after the width copies. Returns a new model with the
    source's config save for the sizes, on its device, dtype and train/eval mode.
    LSTM depth has no exact construction (a layer has no residual path): ValueError."""
    config = model.config
    if not (isinstance(width, int) and width >= 1
            and isinstance(extra_layers, int) and extra_layers >= 0):
        raise ValueError(f"grow: width must be an integer >= 1 and extra_layers an integer >= 0, "
                         f"got width={width!r}, extra_layers={extra_layers!r}")
    if split not in SPLITS:
        raise ValueError(f"grow: split must be one of {SPLITS}, got {split!r}")
    if extra_layers and config.arch == "lstm":
        raise ValueError("grow: extra_layers > 0 is not supported for an LSTM: a layer has no "
                         "residual path, so no new layer on top reproduces the old outputs")

    # BEGIN EXERCISE grow requires attention
    k, gen = width, torch.Generator().manual_seed(seed)

    def shares(b, copies_out):  # b copied copies_out x k; the k input copies share each entry
        if split == "even":
            return b.repeat(copies_out, k) / k
        u = torch.rand(k, copies_out * b.shape[0], b.shape[1], generator=gen,
                       dtype=torch.float64) + 0.5
        return b.repeat(copies_out, k) * torch.cat(list(u / u.sum(0)), 1).to(b)

    def tile(w, n_row=1, n_col=1):  # w in n_row x n_col blocks (gates, q/k/v), each copied k x k
        return torch.cat([torch.cat([shares(b, k) for b in row.chunk(n_col, 1)], 1)
                          for row in w.chunk(n_row, 0)], 0)

    def tile_vec(b, n=1):  # b in n parts, each repeated k times
        return torch.cat([part.repeat(k) for part in b.chunk(n)])

    state = {}
    for name, p in model.state_dict().items():
        if name in ("wte.weight", "wpe.weight", "embed.weight"):
            state[name] = p.repeat(1, k)  # embeddings produce the stream [e, e, ..., e]
        elif name in ("out_bias", "head.bias"):
            state[name] = p
        elif name == "head.weight":  # reads [forward, backward], each now k copies
            state[name] = torch.cat([shares(b, 1) for b in p.chunk(2, 1)], 1)
        elif name.endswith("qkv.weight"):
            state[name] = tile(p, n_row=3)  # queries, keys, values each: heads copied
        elif name.endswith("qkv.bias"):
            state[name] = tile_vec(p, n=3)
        elif name.startswith("lstm.weight_ih_l0"):  # reads the embedding; gates (i, f, g, o)
            state[name] = tile(p, n_row=4)
        elif name.startswith("lstm.weight_ih"):  # reads [forward, backward] of the layer below
            state[name] = tile(p, n_row=4, n_col=2)
        elif name.startswith("lstm.weight_hh"):
            state[name] = tile(p, n_row=4)
        elif name.startswith("lstm."):
            state[name] = tile_vec(p, n=4)  # gate biases
        elif p.dim() == 2:
            state[name] = tile(p)  # attention output O, MLP fc and proj
        else:
            state[name] = tile_vec(p)  # LayerNorm gains and biases, linear biases
    if config.arch == "transformer":  # tied W_E: h_L = [h, ..., h] would give k times the logits
        last = "ln_f" if config.ln == "pre" else f"blocks.{config.n_layers - 1}.ln_2"
        state[last + ".weight"] = state[last + ".weight"] / k
        state[last + ".bias"] = state[last + ".bias"] / k
        if extra_layers and config.ln == "post":
            _deepen_post_ln(state, config.n_layers, extra_layers)
        wider = {"n_heads": k * config.n_heads, "n_layers": config.n_layers + extra_layers}
    else:
        wider = {"lstm_hidden": k * config.lstm_hidden}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        big = build(ModelConfig(**{**vars(config), **wider}))
    p = next(model.parameters())
    big = big.to(device=p.device, dtype=p.dtype)
    missing, unexpected = big.load_state_dict(state, strict=False)
    assert not unexpected and all(int(n.split(".")[1]) >= config.n_layers for n in missing)
    with torch.no_grad():
        for block in big.blocks[config.n_layers:] if config.arch == "transformer" else []:
            for layer in (block.attn.proj, block.mlp.proj):  # zero branches: Attn = MLP = 0
                layer.weight.zero_()
                layer.bias.zero_()
    return big.train(model.training)
    # END EXERCISE grow


# ================================================== plumbing: presets, sizes, the command line


def n_params(model):
    """Number of parameters (tied W_E counted once)."""
    return sum(p.numel() for p in model.parameters())


def config_from_preset(name, vocab_size, pad_id, max_len, **overrides):
    """ModelConfig for preset `name` on a language with `vocab_size` tokens (incl. specials)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    return ModelConfig(vocab_size=vocab_size, pad_id=pad_id, max_len=max_len, **fields)


def preset_n_params(name):
    """Parameter count of preset `name` at its family's REFERENCE vocabulary (no memory used)."""
    config = config_from_preset(name, **REFERENCE[PRESETS[name]["arch"]])
    with torch.device("meta"):
        return n_params(build(config))


def main(argv=None):
    argparse.ArgumentParser(description="List model.py's size presets (App. B.1).").parse_args(argv)
    for name in PRESETS:
        ref = REFERENCE[PRESETS[name]["arch"]]
        print(f"{name:10s} {preset_n_params(name):>13,d} parameters "
              f"at vocab_size={ref['vocab_size']}, max_len={ref['max_len']}")


if __name__ == "__main__":
    main()
