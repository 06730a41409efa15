"""Qwen2.5 model dimensions used by the benchmarks (random weights are built from these)."""

from collections.abc import Mapping

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


def layer_linears(dims: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of one decoder layer of a Qwen2 with these dimensions (a ``QWEN25`` entry or a
    config's ``to_dict()``), by its name in the layer: q, k, v, o, gate, up, down."""
    hidden, inter = dims["hidden_size"], dims["intermediate_size"]
    kv = hidden // dims["num_attention_heads"] * dims["num_key_value_heads"]
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def linear_shapes(shape: str) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of a ``QWEN25`` shape but the head: q, k, v, o, gate, up, down per layer."""
    return list(layer_linears(QWEN25[shape]).values()) * QWEN25[shape]["num_hidden_layers"]
