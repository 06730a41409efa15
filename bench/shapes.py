"""Qwen2.5 model dimensions used by the benchmarks (random weights are built from these)."""

QWEN25 = {
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "3B": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    "14B": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
    ),
}


def linear_shapes(shape: str) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of a ``QWEN25`` shape but the head: q, k, v, o, gate, up, down per layer."""
    d = QWEN25[shape]
    hidden, inter = d["hidden_size"], d["intermediate_size"]
    kv = hidden // d["num_attention_heads"] * d["num_key_value_heads"]
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden)]
    return (layer + [(hidden, inter)]) * d["num_hidden_layers"]
