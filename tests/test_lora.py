"""LoRA numerics against references: straight-through gradients, exact merges, retained update."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from colocate_grpo.lora import (
    FactorsKey,
    MergeAwareLoraLinear,
    RetainedUpdate,
    install_merge_aware,
    lora_factors,
    merge_aware_linear,
    merged_weight,
    overwrite,
    retained_update,
    temporarily_merged,
)


class TwoLinears(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def peft_model(seed: int = 0, dropout: float = 0.0, dtype=torch.bfloat16, **extra):
    torch.manual_seed(seed)
    base = TwoLinears().to(dtype)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["up", "down"], **extra)
    model = get_peft_model(base, config)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: give the adapter a real, RL-sized delta
            torch.nn.init.normal_(param, std=1e-3)
    return model


def cpu_linear(x, weight, bias=None):
    """``x @ weight^T + bias`` as merge-aware LoRA computes it on a CPU: the same values in fp32, rounded once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def assert_bitwise_equal(before, model):
    after = base_weights(model)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name


@pytest.mark.parametrize(("out_f", "in_f", "rank", "tokens"), [(48, 32, 4, 10), (96, 64, 16, 33), (17, 40, 1, 7)])
def test_gradients_match_an_fp64_straight_through_reference(out_f, in_f, rank, tokens):
    torch.manual_seed(out_f + rank)
    x = torch.randn(2, tokens, in_f).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(out_f, in_f).to(torch.bfloat16)
    bias = torch.randn(out_f).to(torch.bfloat16)
    lora_A = (torch.randn(rank, in_f) * 0.1).requires_grad_()
    lora_B = (torch.randn(out_f, rank) * 0.1).requires_grad_()
    upstream = torch.randn(2, tokens, out_f)

    y = merge_aware_linear(x, weight, bias, lora_A, lora_B, 2.0, torch.bfloat16)
    y.backward(upstream.to(y.dtype))

    # fp64 reference: the cast is the identity for gradients.
    x64, A64, B64 = (t.detach().double().requires_grad_() for t in (x, lora_A, lora_B))
    y64 = F.linear(x64, weight.double() + 2.0 * B64 @ A64, bias.double())
    y64.backward(upstream.to(torch.bfloat16).double())
    # bf16 GEMMs with fp32 accumulation (PEFT's precision under autocast): bf16-level relative error.
    for grad, reference in [(lora_A.grad, A64.grad), (lora_B.grad, B64.grad)]:
        assert (grad.double() - reference).norm() / reference.norm() < 1e-2
    # dL/dx goes through the weight the forward used, the cast one; bf16 output rounding only.
    merged = merged_weight(weight, lora_A.detach(), lora_B.detach(), 2.0, torch.bfloat16)
    expected_grad_x = upstream.to(torch.bfloat16).double() @ merged.double()
    assert torch.allclose(x.grad.double(), expected_grad_x, rtol=1e-2, atol=1e-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_uses_the_merged_cast_weight_bitwise(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 32).to(dtype)
    weight = torch.randn(24, 32).to(dtype)
    lora_A, lora_B = torch.randn(4, 32) * 1e-2, torch.randn(24, 4) * 1e-2
    merged = merged_weight(weight, lora_A, lora_B, 2.0, dtype)
    y = merge_aware_linear(x, weight, None, lora_A, lora_B, 2.0, dtype)
    assert y.dtype == dtype and torch.equal(y, cpu_linear(x, merged))


def test_fp16_mode_serves_fp16_weights():
    model = peft_model(dtype=torch.float16)
    install_merge_aware(model, "fp16")
    layer = model.base_model.model.up
    assert layer.merge_dtype == torch.float16
    x = torch.randn(3, 64).to(torch.float16)
    merged = merged_weight(layer.base_layer.weight, *lora_factors(layer), torch.float16)
    assert torch.equal(layer(x), cpu_linear(x, merged, layer.base_layer.bias))


def test_several_active_adapters_are_refused():
    model = peft_model()
    model.add_adapter("second", LoraConfig(r=4, target_modules=["up", "down"]))
    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match="Several LoRA adapters are active"):
        lora_factors(model.base_model.model.up)


def lora_layers(model):
    return [model.base_model.model.up, model.base_model.model.down]


def test_factors_key_is_unchanged_by_training_and_changed_by_whatever_changes_the_factors():
    model = peft_model()
    model.add_adapter("second", LoraConfig(r=4, target_modules=["up", "down"]))
    key = FactorsKey(lora_layers(model))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # an optimizer step: in place
    assert not key.changed()
    up = model.base_model.model.up

    def changes(change, undo=None) -> bool:
        before = FactorsKey(lora_layers(model))
        change()
        changed = before.changed()
        if undo is not None:
            undo()
            assert not before.changed()
        return changed

    assert changes(lambda: model.base_model.set_adapter("second"), lambda: model.base_model.set_adapter("default"))
    assert changes(model.base_model.disable_adapter_layers, model.base_model.enable_adapter_layers)
    assert changes(lambda: up.set_scale("default", 2.0), lambda: up.set_scale("default", 1.0))
    assert changes(lambda: up.merge(), lambda: up.unmerge())
    weight = up.lora_A["default"].weight
    assert changes(lambda: setattr(weight, "data", weight.data.clone()))  # new memory
    assert changes(lambda: model.add_adapter("third", LoraConfig(r=4, target_modules=["up"])))
    assert changes(lambda: model.delete_adapter("third"))
    assert changes(lambda: model.delete_adapter("default"))  # the active adapter gone


def test_merge_aware_layer_matches_its_merged_weight_and_respects_disable_adapters():
    model = peft_model()
    assert install_merge_aware(model, "bf16") == 2
    layer = model.base_model.model.up
    assert isinstance(layer, MergeAwareLoraLinear)
    x = torch.randn(3, 64).to(torch.bfloat16)
    merged = merged_weight(layer.base_layer.weight, *lora_factors(layer), torch.bfloat16)
    assert torch.equal(layer(x), cpu_linear(x, merged, layer.base_layer.bias))
    with model.disable_adapter():
        assert torch.equal(layer(x), layer.base_layer(x))


def test_dropout_uses_the_residual_form_and_is_exact_in_eval():
    model = peft_model(dropout=0.5)
    install_merge_aware(model)
    layer = model.base_model.model.up
    x = torch.randn(3, 64).to(torch.bfloat16)
    merged = merged_weight(layer.base_layer.weight, *lora_factors(layer), torch.bfloat16)
    model.eval()
    assert torch.equal(layer(x), cpu_linear(x, merged, layer.base_layer.bias))
    model.train()
    assert not torch.equal(layer(x), cpu_linear(x, merged, layer.base_layer.bias))


def test_dora_is_rejected_with_a_clear_message():
    model = peft_model(use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        install_merge_aware(model)


def test_the_colocated_trainer_refuses_dora_before_its_engine_starts(tmp_path):
    from trl import GRPOConfig

    from colocate_grpo.trainer import ColocateGRPOTrainer

    with pytest.raises(ValueError, match="DoRA adapters cannot be served"):
        ColocateGRPOTrainer(peft_model(use_dora=True), [], GRPOConfig(output_dir=str(tmp_path), use_cpu=True))


def test_training_moves_the_served_weight():
    model = peft_model()
    install_merge_aware(model)
    layer = model.base_model.model.up
    before = merged_weight(layer.base_layer.weight, *lora_factors(layer), torch.bfloat16)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model(torch.randn(8, 64).to(torch.bfloat16)).float().pow(2).mean().backward()
    optimizer.step()
    after = merged_weight(layer.base_layer.weight, *lora_factors(layer), torch.bfloat16)
    assert not torch.equal(before, after)


@pytest.mark.parametrize("merge_aware", [False, True])
def test_temporary_merges_restore_the_base_bitwise_after_1000_cycles(merge_aware):
    model = peft_model()
    if merge_aware:
        install_merge_aware(model)
    before = base_weights(model)
    x = torch.randn(2, 64).to(torch.bfloat16)
    for _ in range(1000):
        with temporarily_merged(model):
            pass
    assert_bitwise_equal(before, model)
    with temporarily_merged(model):
        merged_out = model.base_model.model.up.base_layer(x)
    assert not torch.equal(merged_out, model.base_model.model.up.base_layer(x))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_temporary_merge_restores_on_exceptions(error):
    model = peft_model()
    before = base_weights(model)
    with pytest.raises(error), temporarily_merged(model):
        assert not torch.equal(
            model.base_model.model.up.base_layer.weight, before["base_model.model.up.base_layer.weight"]
        )
        raise error
    assert_bitwise_equal(before, model)


def bits(tensor):
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_merge_written_in_place_is_undone_bitwise(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.02).to(dtype)
    # Values a merge moves by many units in the last place, across zero, and special ones.
    weight.view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, float("inf"), float("nan")]).to(dtype)
    before = weight.clone()
    lora_A, lora_B = torch.randn(8, 64) * 0.05, torch.randn(96, 8) * 0.05
    merged = merged_weight(weight, lora_A, lora_B, 2.0, dtype)
    record = overwrite(weight, merged)
    assert torch.equal(bits(weight), bits(merged))
    assert torch.equal(bits(record.original()), bits(before)) and torch.equal(bits(weight), bits(merged))
    record.restore()
    record.restore()  # again, as after an interrupt in the first: nothing more to do
    assert torch.equal(bits(weight), bits(before))


def test_a_merge_record_kept_in_a_reused_buffer_restores_bitwise_each_time():
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.02).to(torch.bfloat16)
    before = weight.clone()
    buffer = torch.full((96, 64), 7, dtype=torch.int8)  # stale contents, as after an earlier merge
    for scale in (1e-3, 3e-3):  # two merges through the same buffer, as two syncs
        merged = merged_weight(weight, torch.randn(8, 64) * 1e-2, torch.randn(96, 8) * scale, 2.0)
        record = overwrite(weight, merged, steps_out=buffer)
        assert record.steps.data_ptr() == buffer.data_ptr() and torch.equal(bits(weight), bits(merged))
        assert torch.equal(bits(record.original()), bits(before))
        record.restore()
        assert torch.equal(bits(weight), bits(before))


def test_a_bf16_merge_record_takes_about_a_byte_a_weight_and_a_copy_at_most():
    torch.manual_seed(0)
    weight = (torch.randn(512, 256) * 0.02).to(torch.bfloat16)
    lora_A, lora_B = torch.randn(16, 256) * 1e-2, torch.randn(512, 16) * 1e-3  # an RL-sized delta
    record = overwrite(weight, merged_weight(weight, lora_A, lora_B, 2.0))
    assert record.outlier_count < weight.numel() // 100
    assert record.nbytes < 0.6 * weight.nbytes
    wild = overwrite(weight, torch.randn_like(weight))  # every value moved far: the old bits kept whole
    assert wild.copy is not None and wild.nbytes == weight.nbytes


def test_peft_merge_unmerge_drifts_while_merge_aware_is_exact():
    """PEFT's bf16 merge/unmerge adds then subtracts the delta, rounding both times (TRL issue 6688)."""
    ordinary, exact = peft_model(seed=1), peft_model(seed=1)
    install_merge_aware(exact)
    before = base_weights(ordinary)
    for _ in range(100):
        ordinary.merge_adapter()
        ordinary.unmerge_adapter()
        exact.merge_adapter()
        exact.unmerge_adapter()
    drift = max((base_weights(ordinary)[n].float() - v.float()).abs().max() for n, v in before.items())
    assert drift > 0, "PEFT's merge/unmerge no longer drifts: update the docs"
    assert_bitwise_equal(before, exact)


def test_retained_is_zero_below_half_a_bf16_step_and_one_for_large_deltas():
    weight = torch.full((64, 64), 1.0, dtype=torch.bfloat16)  # bf16 step at 1.0 is 2**-7
    tiny_delta = torch.full((64, 64), 2.0**-10)
    big_delta = torch.full((64, 64), 0.5)
    small, large = RetainedUpdate(), RetainedUpdate()
    small.add(weight, tiny_delta, (weight.float() + tiny_delta).to(torch.bfloat16))
    large.add(weight, big_delta, (weight.float() + big_delta).to(torch.bfloat16))
    assert small.retained == 0.0 and small.changed_fraction == 0.0
    assert large.retained == pytest.approx(1.0, abs=1e-3) and large.changed_fraction == 1.0


def test_retained_update_of_a_model_grows_with_the_delta():
    model = peft_model()
    small = retained_update(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(100)
    large = retained_update(model)
    assert 0.0 <= small.retained < large.retained <= 1.01
    assert small.changed_fraction < large.changed_fraction
