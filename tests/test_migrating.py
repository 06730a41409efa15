"""Configs written for Axolotl, TRL / open-r1 and Unsloth run as written; what cannot run is refused in one pass.

The configs here are written in each tool's style for these tests (a local dataset and the tiny model instead of
the hub's). The checks that need no engine run the CLI's --check in-process; one two-step run per source style.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from colocate_grpo import models
from colocate_grpo.config import ConfigError, load_config
from colocate_grpo.train import check_inputs, grpo_args, main, train

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3="}]

REWARDS = '''
import json
from pathlib import Path

SEEN = Path(__file__).with_name("seen.jsonl")


def solution_reward(prompts, completions, completion_ids, solution, answers, difficulty, **kwargs):
    """Scores against TRL/open-r1's 'solution' column; logs what it was given, with the types."""
    with SEEN.open("a") as log:
        log.write(json.dumps({
            "prompt": prompts[0],
            "generated": len(completion_ids[0]) > 0,
            "solution": type(solution[0]).__name__,
            "answers": answers[0],
            "difficulty": type(difficulty[0]).__name__,
            "columns": sorted(kwargs),
        }) + "\\n")
    text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(s in t) for s, t in zip(solution, text)]
'''


def write_dataset(folder: Path) -> Path:
    """A JSONL of sums: a conversational 'prompt', a text 'question', a 'solution', list and int columns."""
    rows = []
    for a in range(8):
        question = f"{a}+{a + 1}="
        rows.append(
            {
                "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": question}],
                "question": question,
                "solution": str(2 * a + 1),
                "answers": [str(2 * a + 1), f"{2 * a + 1}.0"],
                "difficulty": a,
            }
        )
    path = folder / "sums.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


@pytest.fixture
def rewards_module(tmp_path, monkeypatch, request):
    """A reward module in tmp_path, importable (as TRL's CLI imports it from the working directory)."""
    name = "rewards_" + re.sub(r"\W", "_", request.node.name)
    (tmp_path / f"{name}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def axolotl_yaml(data: Path, out: Path, rewards: str) -> str:
    return f"""
base_model: tiny
rl: grpo
strict: false
chat_template: tokenizer_default
datasets:
  - path: {data}
    split: train
dataset_prepared_path: last_run_prepared
val_set_size: 0.0
sequence_len: 96
sample_packing: false
pad_to_sequence_len: false

adapter: lora
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_modules:
  - q_proj
  - v_proj

micro_batch_size: 8
gradient_accumulation_steps: 1
num_epochs: 1
max_steps: 2
optimizer: adamw_torch
lr_scheduler: constant
learning_rate: 1.0e-3
bf16: auto
tf32: false
gradient_checkpointing: false
flash_attention: false
logging_steps: 1
warmup_steps: 0
evals_per_epoch:
saves_per_epoch:
special_tokens:
wandb_project:
wandb_entity:
output_dir: {out}
max_prompt_length: 64

trl:
  use_vllm: true
  vllm_mode: colocate
  vllm_enable_sleep_mode: true
  beta: 0.0
  num_generations: 4
  max_completion_length: 4
  temperature: 1.0
  reward_funcs:
    - {rewards}.solution_reward
  reward_weights: [1.0]
  logging_steps: 1

vllm:
  enforce_eager: true  # on the CPU: no torch.compile at start
"""


def trl_flat_yaml(data: Path, out: Path, rewards: str) -> str:
    return f"""
# Model arguments
model_name_or_path: tiny
model_revision: main
dtype: bfloat16
attn_implementation: sdpa
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: all-linear

# Data arguments
dataset_name: {data}
dataset_prompt_column: question
dataset_train_split: train
system_prompt: Add the two numbers.

# GRPO trainer config
bf16: true
use_vllm: true
vllm_mode: colocate
vllm_gpu_memory_utilization: 0.3
do_eval: false
gradient_accumulation_steps: 1
gradient_checkpointing: false
learning_rate: 1.0e-03
log_level: info
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
max_prompt_length: 64
max_completion_length: 4
max_steps: 2
num_generations: 4
num_train_epochs: 1
output_dir: {out}
per_device_train_batch_size: 8
report_to: none
reward_funcs:
- {rewards}.solution_reward
reward_weights:
- 1.0
save_strategy: "no"
seed: 42
temperature: 0.9
beta: 0.0
loss_type: dr_grpo
scale_rewards: false
warmup_ratio: 0.1
vllm:
  enforce_eager: true  # on the CPU: no torch.compile at start (the one block of ours)
"""


def unsloth_arguments(data: Path, out: Path, rewards: str) -> dict:
    """FastLanguageModel.from_pretrained, get_peft_model and GRPOConfig keyword arguments, as one mapping."""
    return {
        # FastLanguageModel.from_pretrained(...)
        "model_name": "tiny",
        "max_seq_length": 64,  # the tiny model's context
        "load_in_4bit": False,
        "fast_inference": True,
        "max_lora_rank": 8,
        "gpu_memory_utilization": 0.5,
        # FastLanguageModel.get_peft_model(...)
        "r": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "lora_alpha": 16,
        "use_gradient_checkpointing": "unsloth",
        "random_state": 3407,
        # load_dataset(...)
        "dataset_name": str(data),
        # GRPOConfig(...)
        "vllm_sampling_params": {  # SamplingParams(...) in the notebooks
            "min_p": 0.1,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 3407,
            "stop": ["\n\n"],
            "include_stop_str_in_output": True,
        },
        "learning_rate": 5e-6,
        "adam_beta1": 0.9,
        "adam_beta2": 0.99,
        "weight_decay": 0.1,
        "warmup_ratio": 0.1,
        "lr_scheduler_type": "cosine",
        "optim": "adamw_torch",
        "logging_steps": 1,
        "per_device_train_batch_size": 1,  # as the notebooks write it: Unsloth raises it to num_generations
        "gradient_accumulation_steps": 1,
        "num_generations": 4,
        "max_prompt_length": 32,
        "max_completion_length": 4,
        "max_steps": 2,
        "save_steps": 250,
        "max_grad_norm": 0.1,
        "report_to": "none",
        "output_dir": str(out),
        "reward_funcs": [f"{rewards}.solution_reward"],
        "vllm": {"enforce_eager": True},  # on the CPU: no torch.compile at start
    }


def source_config(style: str, tmp_path: Path, rewards: str) -> str | dict:
    data, out = write_dataset(tmp_path), tmp_path / "out"
    if style == "unsloth":
        return unsloth_arguments(data, out, rewards)
    text = axolotl_yaml(data, out, rewards) if style == "axolotl" else trl_flat_yaml(data, out, rewards)
    path = tmp_path / f"{style}.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("style", ["axolotl", "trl", "unsloth"])
def test_a_config_from_each_source_passes_the_check_and_trains_two_steps(tmp_path, rewards_module, style, capsys):
    config = source_config(style, tmp_path, rewards_module)
    if isinstance(config, str):
        assert main(["--check", config]) == 0, capsys.readouterr().err
    else:
        check_inputs(load_config(config))
    result = train(config)
    assert result.metrics.history[-1]["step"] == 2
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    during_training = [s for s in seen if s["generated"]]
    assert during_training, "the reward was not called on generated completions"
    for call in during_training:
        # Every column reaches the reward under its own name, with its own type.
        assert call["solution"] == "str" and call["difficulty"] == "int"
        assert isinstance(call["answers"], list) and len(call["answers"]) == 2
        assert {"question", "trainer_state"} <= set(call["columns"])
        prompt = call["prompt"]
        if style == "axolotl":  # the conversational column, as it is: not wrapped in another user message
            assert prompt[0] == {"role": "system", "content": "Add."} and prompt[1]["role"] == "user"
            assert len(prompt) == 2 and isinstance(prompt[1]["content"], str)
        elif style == "trl":  # open-r1's system_prompt and prompt column
            assert prompt[0] == {"role": "system", "content": "Add the two numbers."} and len(prompt) == 2
    written = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert written["task"] is None and written["dataset"]["path"].endswith("sums.jsonl")


def test_the_mapping_of_each_source(tmp_path):
    data, out = write_dataset(tmp_path), tmp_path / "out"
    axolotl = load_config(axolotl_yaml(data, out, "r"))
    assert axolotl.lora_target_modules == ["q_proj", "v_proj"] and axolotl.lora_target_linear is False
    assert axolotl.trl["optim"] == "adamw_torch" and axolotl.trl["num_train_epochs"] == 1
    flat = load_config(trl_flat_yaml(data, out, "r"))
    assert flat.base_model == "tiny" and flat.micro_batch_size == 8 and flat.adapter == "lora"
    assert flat.dataset.prompt_column == "question" and flat.dataset.system_prompt == "Add the two numbers."
    assert flat.trl["loss_type"] == "dr_grpo" and flat.trl["model_init_kwargs"] == {"attn_implementation": "sdpa"}
    assert flat.vllm.gpu_memory_utilization == 0.3 and flat.lora_target_linear is True
    unsloth = load_config(unsloth_arguments(data, out, "r"))
    assert unsloth.lora_r == 8 and unsloth.seed == 3407 and unsloth.gradient_checkpointing is True
    assert unsloth.micro_batch_size == 4  # per_device_train_batch_size 1, raised to num_generations as Unsloth does
    # vLLM's sampling arguments, but the seed: TRL asks for each completion on its own, one seed would repeat them.
    assert unsloth.trl["generation_kwargs"] == {
        "min_p": 0.1,
        "top_p": 1.0,
        "top_k": -1,
        "stop": ["\n\n"],
        "include_stop_str_in_output": True,
    }
    assert unsloth.vllm.max_model_len == 64 and unsloth.vllm.gpu_memory_utilization == 0.5
    args = grpo_args(unsloth, "cpu", torch.bfloat16)
    assert args.optim == "adamw_torch" and args.max_grad_norm == 0.1 and args.lr_scheduler_type == "cosine"


def test_an_unsloth_notebooks_batch_of_one_runs_as_unsloth_runs_it_and_a_trl_configs_is_refused_as_trl_does(caplog):
    notebook = {"model_name": "tiny", "per_device_train_batch_size": 1, "num_generations": 6}
    with caplog.at_level("WARNING", logger="colocate_grpo"):
        config = load_config(notebook)
    assert (config.micro_batch_size, config.gradient_accumulation_steps) == (6, 1)
    assert "micro_batch_size 1 -> 6 (as Unsloth runs it" in caplog.text
    # A whole number of groups, or TRL's own batch keys, stay as written.
    assert load_config({**notebook, "gradient_accumulation_steps": 6}).micro_batch_size == 1
    with pytest.raises(ConfigError, match="must be a multiple of trl.num_generations"):
        load_config({**notebook, "steps_per_generation": 1})
    with pytest.raises(ConfigError, match="must be a multiple of trl.num_generations"):
        load_config({"model_name_or_path": "tiny", "per_device_train_batch_size": 1, "num_generations": 6})


def check_cli(tmp_path: Path, text: str, capsys) -> tuple[int, str]:
    """The CLI's --check on ``text``, in this process: its exit code and stderr."""
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    code = main(["--check", str(path)])
    return code, capsys.readouterr().err


# Keys the run sets in TRL's GRPOConfig, written by the user under trl:: each is taken, or moved to its key of
# ours; never a duplicate keyword argument. Each: the value written, where it lands, what that holds.
USER_WRITTEN = {
    "bf16": (True, "args.bf16", False),  # agrees with the CPU's bf16; the model itself is bf16 there: no autocast
    "fp16": (False, "args.fp16", False),
    "report_to": ("none", "args.report_to", []),
    "logging_steps": (3, "args.logging_steps", 3),
    "save_steps": (5, "args.save_steps", 5),
    "save_strategy": ("epoch", "args.save_strategy.value", "epoch"),
    "gradient_checkpointing": (False, "args.gradient_checkpointing", False),
    "ddp_find_unused_parameters": (True, "args.ddp_find_unused_parameters", True),
    "learning_rate": (3e-4, "args.learning_rate", 3e-4),
    "max_steps": (7, "args.max_steps", 7),
    "seed": (5, "args.seed", 5),
    "output_dir": ("elsewhere", "args.output_dir", "elsewhere"),
    "per_device_train_batch_size": (16, "args.per_device_train_batch_size", 16),
    "gradient_accumulation_steps": (2, "args.gradient_accumulation_steps", 2),
    "use_cpu": (True, "config.device", "cpu"),
    "vllm_max_model_length": (1000, "args.vllm_max_model_length", 1000),
    "vllm_gpu_memory_utilization": (0.5, "config.vllm.gpu_memory_utilization", 0.5),
}


@pytest.mark.parametrize("key", sorted(USER_WRITTEN))
def test_keys_the_run_sets_are_taken_from_the_trl_block(key):
    value, where, expected = USER_WRITTEN[key]
    config = load_config({"trl": {key: value}})
    found = {"config": config, "args": grpo_args(config, "cpu", torch.bfloat16)}
    name, *attributes = where.split(".")
    for attribute in attributes:
        found[name] = getattr(found[name], attribute)
    assert found[name] == expected


def test_every_argument_the_run_sets_is_covered(monkeypatch):
    """A new argument of grpo_args that a trl: key could duplicate must be handled (and listed above)."""
    import trl

    captured = {}
    config = load_config({})
    monkeypatch.setattr(trl, "GRPOConfig", lambda **kwargs: captured.update(kwargs))
    grpo_args(config, "cpu", torch.bfloat16)
    ours = set(captured) - set(config.trl_settings)
    assert ours <= set(USER_WRITTEN), ours - set(USER_WRITTEN)


def test_bf16_that_disagrees_with_the_device_is_refused(tmp_path, capsys):
    code, err = check_cli(tmp_path, "output_dir: out\ntrl:\n  bf16: false\n", capsys)
    assert code == 2 and "'trl.bf16: false'" in err and "fp32 training is not supported" in err


def test_every_problem_is_reported_in_one_run(tmp_path, capsys):
    text = """
output_dir: out
lora_rr: 8
num_generation: 4
trl:
  loss_type: dr_grpoo
  reward_weights: [1.0, 0.5]
  temperature: -1.0
  generation_kwargs: {seed: 3407}
  max_completion_length:
  vllm_server_host: 0.0.0.0
plugins:
  - axolotl.integrations.liger.LigerPlugin
vllm:
  host: 0.0.0.0
  tensor_parallel_size: 2
"""
    code, err = check_cli(tmp_path, text, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("colocate_grpo: config error: ")
    lines = [line for line in err.splitlines() if line.startswith("- ")]
    expected = [
        "Unknown key 'lora_rr'. Did you mean 'lora_r'?",
        "Unknown key 'num_generation'. Did you mean 'trl.num_generations'?",
        "'trl.loss_type: dr_grpoo' is not one TRL accepts",
        "Did you mean 'dr_grpo'?",
        "'trl.reward_weights' has 2 weights for 1 reward functions",
        "'trl.temperature' must be positive",
        "'trl.generation_kwargs.seed' would make each prompt's completions the same",
        "'trl.max_completion_length' is empty",
        "'trl.vllm_server_host' is a server-mode setting",
        "'plugins: ['axolotl.integrations.liger.LigerPlugin']' is not supported",
        "'vllm.host' is a vLLM server setting",
        "'vllm.tensor_parallel_size' is a vLLM server setting",
    ]
    for fragment in expected:
        assert any(fragment in line for line in lines), (fragment, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"trl": {"async_prefetch": True}}, "'trl.async_prefetch' asks for generation in the background"),
        ({"trl": {"vllm_mode": "server"}}, "server mode runs the engine apart"),
        ({"wandb_project": "gsm8k"}, "'trl.report_to: wandb' and WANDB_PROJECT"),
        ({"datasets": [{"path": "a"}, {"path": "b"}]}, "a run trains on one"),
        ({"datasets": [{"path": "openai/gsm8k", "type": "rewards.oai_gsm8k_transform"}]}, "dataset transforms"),
        ({"trl": {"reward_funcs": ["accuracy", "format"]}}, "'accuracy' is a name in a reward registry"),
        ({"trl": {"model_init_kwargs": {"revision": "v2"}}}, "'trl.model_init_kwargs.revision' is not applied"),
        ({"trl": {"eval_strategy": "steps"}}, "Evaluation"),
        ({"trl": {"sync_ref_model": True, "beta": 0.1}}, "'trl.sync_ref_model: true' with LoRA"),
        ({"trl": {"report_to": "wandbb"}}, "Did you mean 'wandb'"),
        ({"trl": {"top_p": 1.5}}, "'trl.top_p' must be in (0, 1]"),
        ({"learning_rate": 1e-4, "trl": {"learning_rate": 1e-5}}, "given twice"),
        ({"use_rslora": True}, "'use_rslora: True' is not supported"),
        ({"max_steps": -1}, "'max_steps: -1' trains for trl.num_train_epochs"),
    ],
)
def test_what_cannot_run_here_is_named_with_the_alternative(raw, fragment):
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    assert fragment in str(caught.value), str(caught.value)


def test_flat_trl_keys_and_trl_blocks_keys_of_ours_land_where_they_belong():
    config = load_config({"num_generations": 4, "micro_batch_size": 8, "trl": {"max_prompt_length": 100}})
    assert (
        config.trl["num_generations"] == 4 and config.max_prompt_length == 100 and "max_prompt_length" not in config.trl
    )
    epochs = load_config({"num_train_epochs": 2})
    assert epochs.max_steps == -1 and grpo_args(epochs, "cpu", torch.bfloat16).num_train_epochs == 2
    # TRL's registry names for its own rewards become their dotted paths.
    assert load_config({"trl": {"reward_funcs": ["think_format_reward"]}}).reward_funcs == [
        "trl.rewards.think_format_reward"
    ]


def test_trl_accepts_what_trl_accepts():
    config = load_config(
        {"trl": {"loss_type": "dr_grpo", "scale_rewards": False, "top_k": -1, "steps_per_generation": 2}}
    )
    args = grpo_args(config, "cpu", torch.bfloat16)
    assert args.loss_type == "dr_grpo" and args.scale_rewards == "none" and args.generation_batch_size == 16


def test_trl_choices_are_trls():
    """Our list of loss types and modes is the one in TRL's own field docs."""
    import dataclasses

    from trl import GRPOConfig

    from colocate_grpo.validation import TRL_CHOICES

    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GRPOConfig)}
    for key, allowed in TRL_CHOICES.items():
        if key == "save_strategy":
            continue  # transformers' enum
        for value in allowed:
            if isinstance(value, str):
                assert value in helps[key], (key, value)


def test_trl_refusals_come_from_trl_at_check_time(tmp_path, capsys):
    text = "output_dir: out\ntrl:\n  generation_batch_size: 16\n  steps_per_generation: 2\n"
    code, err = check_cli(tmp_path, text, capsys)
    assert code == 2 and "TRL's GRPOConfig refuses" in err and "steps_per_generation" in err


def test_lora_target_modules_alone_is_accepted_and_both_are_refused():
    assert load_config({"lora_target_modules": ["q_proj"]}).lora_target_linear is False
    with pytest.raises(ConfigError, match="not both"):
        load_config({"lora_target_modules": ["q_proj"], "lora_target_linear": True})


def test_model_init_kwargs_attention_reaches_the_model():
    config = load_config(
        {"max_steps": 2, "num_prompts": 16, "trl": {"model_init_kwargs": {"attn_implementation": "eager"}}}
    )
    inputs = check_inputs(config)
    model = models.load_model(config, inputs.plan, inputs.path)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "base_model: Qwen/Qwen2.5-0.5B-Instrct\n",
            ["'base_model: Qwen/Qwen2.5-0.5B-Instrct'", "local Hugging Face cache"],
        ),
        ("base_model: not a hub id!\n", ["'base_model: not a hub id!'", "valid hub id"]),
        ("trl:\n  max_completion_length:\n", ["'trl.max_completion_length' is empty", "TRL's default"]),
        ("lora_r:\n", ["'lora_r' is empty", "an integer"]),
        (
            "max_prompt_length: 16\ntrl:\n  max_completion_length: 4\nvllm:\n  max_model_len: 96\n",
            ["'vllm.max_model_len: 96' is above the context of tiny (64 tokens"],
        ),
    ],
)
def test_unloadable_models_and_empty_values_exit_2(tmp_path, capsys, text, fragments):
    code, err = check_cli(tmp_path, "output_dir: out\n" + text, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_stored_quantized_is_refused_with_the_unquantized_one_as_the_fix(tmp_path, capsys):
    from colocate_grpo.tiny import tiny_model_path

    stored = tmp_path / "tiny-bnb-4bit"  # as Unsloth uploads its 4-bit models
    stored.mkdir()
    config = json.loads((tiny_model_path() / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (stored / "config.json").write_text(json.dumps(config))
    code, err = check_cli(tmp_path, f"output_dir: out\nbase_model: {stored}\n", capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"'base_model: {stored}' is stored quantized (bitsandbytes" in err and "'load_in_4bit: true'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "fragments"),
    [
        ("def broken(:\n    pass\n", ["has a syntax error at", "line 1"]),
        ("x = 1\nraise RuntimeError('no API key')\n", ["raised RuntimeError: no API key", "line 2"]),
        ("import not_installed_package\n", ["needs 'not_installed_package', which is not installed"]),
    ],
)
def test_a_reward_module_that_fails_to_import_exits_2_with_its_line(tmp_path, monkeypatch, capsys, source, fragments):
    name = f"bad_rewards_{abs(hash(source))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = check_cli(tmp_path, f"output_dir: out\ntrl:\n  reward_funcs: [{name}.f, also_missing.g]\n", capsys)
    sys.modules.pop(name, None)
    assert code == 2 and "Traceback" not in err
    for fragment in [*fragments, f"'{name}.f'", "cannot import module 'also_missing'"]:
        assert fragment in err, err


def test_a_reward_needing_a_missing_column_names_it(tmp_path, monkeypatch):
    (tmp_path / "needs_solution.py").write_text(
        "def f(completions, solution, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="needs a 'solution' column.*under its own name"):
        check_inputs(load_config({"trl": {"reward_funcs": ["needs_solution.f"]}, "num_prompts": 8}))
    sys.modules.pop("needs_solution", None)


def dataset_of(tmp_path: Path, **dataset) -> tuple:
    config = load_config(
        {
            "task": None,
            "dataset": {"path": str(write_dataset(tmp_path)), **dataset},
            "trl": {"reward_funcs": ["colocate_grpo.tasks.accuracy_reward"]},
        }
    )
    tokenizer = models.load_tokenizer(models.model_path(config))
    return config, tokenizer


def test_a_conversational_prompt_column_is_used_as_it_is(tmp_path):
    config, tokenizer = dataset_of(tmp_path, answer_column="answers")
    dataset = models.build_dataset(config, tokenizer)
    assert dataset[1]["prompt"] == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    assert dataset[1]["answer"] == ["3", "3.0"]  # the list, not its text
    assert {"question", "solution", "answers", "difficulty"} <= set(dataset.column_names)


@pytest.mark.parametrize(
    ("dataset", "fragment"),
    [
        ({"prompt_column": "difficulty"}, "'dataset.prompt_column: difficulty': row 0 holds int"),
        ({"prompt_column": "answers"}, "'dataset.prompt_column: answers': row 0 holds list"),
        ({"chat": False}, "holds chat messages but 'dataset.chat: false'"),
        ({"system_prompt": "Be brief."}, "carry their own system message"),
    ],
)
def test_prompt_columns_that_are_neither_text_nor_messages_are_refused(tmp_path, dataset, fragment):
    config, tokenizer = dataset_of(tmp_path, **dataset)
    with pytest.raises(ConfigError) as caught:
        models.build_dataset(config, tokenizer)
    assert fragment in str(caught.value), str(caught.value)


def test_the_migration_guide_examples_load(tmp_path):
    """Each YAML example of docs/migrating.md loads as written (the dataset and rewards are only named)."""
    text = (REPO / "docs" / "migrating.md").read_text()
    examples = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert len(examples) >= 3
    for example in examples:
        config = load_config(example)
        assert config.trl.get("reward_funcs"), example


@pytest.mark.slow
def test_report_to_trackio_logs_locally(tmp_path):
    """A two-step run with report_to: trackio writes its metrics to TRACKIO_DIR, offline, beside metrics.jsonl."""
    pytest.importorskip("trackio")
    config = yaml.safe_load((REPO / "colocate_grpo" / "configs" / "tiny.yaml").read_text())
    config.update({"output_dir": str(tmp_path / "out"), "max_steps": 2, "num_prompts": 64})
    config["trl"].update({"report_to": "trackio", "project": "colocate-test"})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "colocate_grpo.train", "cfg.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "metrics.jsonl").is_file()
    assert list((tmp_path / "trackio").rglob("*colocate-test*")), list((tmp_path / "trackio").rglob("*"))
