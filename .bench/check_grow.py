"""grow() against App. B.1's zero-filled blocks (paper App. B.1.2-B.1.3): the max |logit
difference| between a random float64 model and its grown copy, at three LayerNorm parameter
draws, beside the paper's construction (blocks of zero weights on top: exact for pre-LN, not
for post-LN, whose last LayerNorm then normalises twice). The README's departures quote it.
    python .bench/check_grow.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from model import ModelConfig, build, grow  # noqa: E402

def zero_filled_blocks(model, extra_layers=1):
    """App. B.1's depth construction taken literally: `extra_layers` transformer blocks on top
    with every weight and bias zero (LayerNorms at gain 1, bias 0). Exact for pre-LN; changes a
    post-LN model's logits (grow()'s docstring). A demonstration; grow() is the exact tool."""
    if model.config.arch != "transformer":
        raise ValueError("zero_filled_blocks: transformers only (App. B.1.2)")
    config = ModelConfig(**{**vars(model.config), "n_layers": model.config.n_layers + extra_layers})
    p = next(model.parameters())
    big = build(config).to(device=p.device, dtype=p.dtype)
    big.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for block in big.blocks[model.config.n_layers:]:
            for name, q in block.named_parameters():
                if not name.startswith("ln_"):
                    q.zero_()
    return big.train(model.training)


# (arch, ln, width, extra_layers)
GROW_CHECKS = [("transformer", "pre", 2, 2), ("transformer", "post", 2, 2),
               ("transformer", "post", 3, 0), ("lstm", "pre", 2, 0)]
LN_DRAWS = {"LN 1, 0": (0.0, 0.0), "LN 1±0.1, ±0.05": (0.1, 0.05), "LN ~N(0, 1)": None}


def check_grow(seed=0):
    """Rows (case, {LayerNorm draw: max |logit diff|}) for grow() and for the paper's zero-filled
    blocks, on float64 models with weights ~ N(0, 1) and LayerNorm gains/biases drawn three ways
    (LN_DRAWS): at their init (1, 0), trained-like (1 + 0.1 z, 0.05 z), and ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 12, (8, 16), generator=g)
    tokens[torch.arange(16) >= torch.randint(1, 17, (8, 1), generator=g)] = 13  # pad_id 13
    rows = []
    for arch, ln, width, extra in GROW_CHECKS:
        grown, zero = {}, {}
        for draw, spread in LN_DRAWS.items():
            small = build(ModelConfig(vocab_size=14, pad_id=13, max_len=16, arch=arch, ln=ln,
                                      n_layers=2, lstm_hidden=32)).double().eval()
            with torch.no_grad():
                for name, p in small.named_parameters():
                    p.normal_(generator=g)
                    is_ln = "ln" in name.split(".")[-2] if "." in name else False
                    if is_ln and spread is not None:  # gain 1 + a z, bias b z
                        p.mul_(spread[0] if name.endswith("weight") else spread[1])
                        p.add_(1.0 if name.endswith("weight") else 0.0)
            logits = small(tokens)
            grown[draw] = (grow(small, width, extra)(tokens) - logits).abs().max().item()
            if arch == "transformer":
                zero[draw] = (zero_filled_blocks(small)(tokens) - logits).abs().max().item()
        case = f"{arch} ln={ln}" if arch == "transformer" else arch
        rows.append((f"{case} grow(width={width}, extra_layers={extra})", grown))
        if zero:
            rows.append((f"{case} zero-filled block on top (paper's)", zero))
    return rows



if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"{'max |logit diff|':52s}" + "".join(f"{d:>18s}" for d in LN_DRAWS))
    for case, diffs in check_grow():
        print(f"{case:52s}" + "".join(f"{diffs[d]:18.3g}" for d in LN_DRAWS))
