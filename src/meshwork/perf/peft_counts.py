"""Trainable-parameter counts of parameter-efficient fine-tuning, by hand (pure Python).

The formulas that models/lora.py and models/adapters.py must reproduce, for a
Llama-style decoder (grouped-query attention, SwiGLU), and the LoRA paper's
GPT-3 175B figures (Hu et al., 2021, Table 4: LoRA on W_q and W_v of
96 layers of d_model 12288 trains 4.7M parameters at r = 1 and 37.7M at r = 8):

>>> millions(gpt3_175b_lora(1)), millions(gpt3_175b_lora(8))
('4.7M', '37.7M')
>>> gpt3_175b_lora(8)            # 96 layers x 2 matrices x (12288 r + r 12288)
37748736

A projection of I inputs and O outputs gets A (I, r) and B (r, O): r (I + O).
"""

from __future__ import annotations

from collections.abc import Iterable

# GPT-3 175B (Brown et al., 2020, Table 2.1): 96 heads of 128, d_ff = 4 d_model.
GPT3_175B = dict(n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, head_dim=128, d_ff=4 * 12288)


def projection_shapes(
    *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int
) -> dict[str, tuple[int, int]]:
    """finetune.targets name -> (inputs, outputs) of that projection in one layer.

    >>> projection_shapes(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)["k"]
    (64, 32)
    """
    D, H, G, K, F = d_model, n_heads, n_kv_heads, head_dim, d_ff
    return {
        "q": (D, H * K),
        "k": (D, G * K),
        "v": (D, G * K),
        "o": (H * K, D),
        "gate": (D, F),
        "up": (D, F),
        "down": (F, D),
    }


def lora_params(
    targets: Iterable[str],
    *,
    n_layers: int,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    d_ff: int,
    rank: int,
) -> int:
    """LoRA's (and QLoRA's) trainable parameters: r (inputs + outputs) per target per layer.

    >>> lora_params(["q", "v"], n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, rank=4)
    1792
    """
    shapes = projection_shapes(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=d_ff)
    unknown = set(targets) - set(shapes)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; choose among {', '.join(shapes)}")
    return n_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in set(targets))


def adapter_params(*, n_layers: int, d_model: int, rank: int) -> int:
    """Houlsby adapters, two per layer (after attention, after the MLP), each
    down (D, r) + bias r + up (r, D) + bias D.

    >>> adapter_params(n_layers=2, d_model=64, rank=4)
    2320
    """
    return n_layers * 2 * (2 * d_model * rank + rank + d_model)


def prefix_params(
    *, n_layers: int, d_model: int, n_kv_heads: int, head_dim: int, prefix_len: int, prefix_hidden: int = 0
) -> int:
    """Prefix tuning: P keys and P values of G K per layer (hidden = 0); or, reparameterized,
    per layer an embedding (P, D) and an MLP D -> hidden -> 2 G K with biases.

    >>> prefix_params(n_layers=2, d_model=64, n_kv_heads=2, head_dim=16, prefix_len=8)
    1024
    >>> prefix_params(n_layers=2, d_model=64, n_kv_heads=2, head_dim=16, prefix_len=8, prefix_hidden=32)
    9408
    """
    P, D, kv, h = prefix_len, d_model, 2 * n_kv_heads * head_dim, prefix_hidden
    if h == 0:
        return n_layers * P * kv
    return n_layers * (P * D + D * h + h + h * kv + kv)


def finetune_params(model, ft) -> int | None:
    """Trainable parameters of `ft` (a FinetuneConfig) on `model` (a dense ModelConfig);
    None for methods none and full (every parameter)."""
    dims = dict(n_layers=model.n_layers, d_model=model.d_model)
    heads = dict(
        n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, head_dim=model.head_dim or model.d_model // model.n_heads
    )
    if ft.method in ("lora", "qlora"):
        return lora_params(ft.targets, **dims, **heads, d_ff=model.d_ff, rank=ft.rank)
    if ft.method == "adapter":
        return adapter_params(**dims, rank=ft.rank)
    if ft.method == "prefix":
        return prefix_params(
            **dims,
            n_kv_heads=heads["n_kv_heads"],
            head_dim=heads["head_dim"],
            prefix_len=ft.prefix_len,
            prefix_hidden=ft.prefix_hidden,
        )
    return None


def gpt3_175b_lora(rank: int, targets: Iterable[str] = ("q", "v")) -> int:
    """LoRA's trainable parameters on GPT-3 175B (see the module docstring)."""
    return lora_params(targets, **GPT3_175B, rank=rank)


def millions(n: int) -> str:
    """n as the LoRA paper prints it: one decimal, in millions.

    >>> millions(4_718_592)
    '4.7M'
    """
    return f"{n / 1e6:.1f}M"
