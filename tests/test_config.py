"""The validator on good and bad configs, and the CLI's exit codes and messages."""

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from colocate_grpo.config import ConfigError, describe, load_config, packaged_configs
from colocate_grpo.plan import merge_aware_mode
from colocate_grpo.train import default_config_path

REPO = Path(__file__).resolve().parents[1]


def error_for(raw: dict | str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    return str(caught.value)


def test_packaged_default_and_examples_validate():
    tiny = load_config(default_config_path())
    assert tiny.base_model == "tiny" and tiny.task == "arithmetic"
    assert tiny.reward_funcs == ["colocate_grpo.tasks.arithmetic_reward"]
    examples = packaged_configs()
    assert {"tiny", "qwen2.5-0.5b-gsm8k", "qwen2.5-1.5b-gsm8k"} <= set(examples)
    for name, path in examples.items():
        assert load_config(name) == load_config(path) == load_config(f"{name}.yaml")


def test_a_missing_config_file_names_the_packaged_ones(tmp_path):
    (tmp_path / "tiny.yaml").write_text("base_model: tiny\nmax_steps: 7\n")
    with contextlib.chdir(tmp_path):  # a file in the working directory comes before a packaged config's name
        assert load_config("tiny.yaml").max_steps == 7 and load_config("tiny").max_steps == 300
    message = error_for(str(tmp_path / "qwen2.5-0.5b-gsm8k.yaml"))
    assert "Config file not found" in message and "qwen2.5-0.5b-gsm8k, qwen2.5-1.5b-gsm8k, tiny" in message


def test_defaults_are_a_colocated_sleeping_engine():
    config = load_config({})
    assert config.trl_settings["vllm_mode"] == "colocate"
    assert config.trl_settings["vllm_enable_sleep_mode"] is True
    assert config.vllm.gpu_memory_utilization == "auto"
    assert config.vllm.enforce_eager is False  # CUDA graphs: stock TRL builds its engine with them
    assert config.vllm.max_model_len is None  # the plan derives it: prompt + completion, at most the context


@pytest.mark.parametrize(
    ("raw", "dtype", "mode"),
    [
        ({}, torch.bfloat16, "bf16"),  # merge-aware by default, in the training dtype
        ({}, torch.float16, "fp16"),  # GPUs without bf16 (the T4)
        ({"lora_merge_aware": None}, torch.bfloat16, None),  # PEFT's LoRA when asked for
        ({"lora_merge_aware": "fp16"}, torch.bfloat16, "fp16"),
        ({"adapter": None}, torch.bfloat16, None),
        ({"trl": {"vllm_lora_sync": True}}, torch.bfloat16, None),  # the engine applies the adapter: no merge
        ({"load_in_4bit": True}, torch.bfloat16, None),  # a 4-bit base: the adapter is served
    ],
)
def test_lora_is_merge_aware_by_default_where_it_applies(raw, dtype, mode):
    assert merge_aware_mode(load_config(raw), dtype) == mode


def test_trl_mapping_fields_take_a_mapping():
    assert load_config({"trl": {"generation_kwargs": {"stop": ["\n"]}}}).trl["generation_kwargs"] == {"stop": ["\n"]}


def test_yaml_1_1_exponent_without_dot_is_a_number():
    assert load_config("learning_rate: 1e-5\n").learning_rate == 1e-5


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"lora_rr": 8}, ["Unknown key 'lora_rr'", "Did you mean 'lora_r'"]),
        ({"model": "gpt2"}, ["Unknown key 'model'", "Did you mean 'base_model'"]),  # not a key a run drops
        ({"vllm": {"gpu_memory_utilisation": 0.3}}, ["'vllm.gpu_memory_utilisation'", "gpu_memory_utilization"]),
        ({"trl": {"num_generation": 8}}, ["'trl.num_generation'", "num_generations"]),
        ({"lora_r": "big"}, ["'lora_r' must be an integer", "'big'"]),
        ({"lora_target_linear": "yes"}, ["'lora_target_linear' must be true or false"]),
        ({"trl": {"temperature": "hot"}}, ["'trl.temperature'", "'hot'"]),
        ({"vllm": {"gpu_memory_utilization": 1.5}}, ["'vllm.gpu_memory_utilization' must be 'auto' or in (0, 1]"]),
        ({"vllm": {"gpu_memory_utilization": "atuo"}}, ["'vllm.gpu_memory_utilization' must be a number or 'auto'"]),
        ({"load_in_4bit": True, "trl": {"vllm_lora_sync": False}}, ["'load_in_4bit: true' is served", "remove"]),
        ({"load_in_4bit": True, "peft_use_dora": True}, ["'load_in_4bit: true'", "no DoRA"]),
        ({"load_in_8bit": True}, ["'load_in_8bit: true' cannot be served", "no in-flight 8-bit", "bf16 base"]),
        ({"vllm": {"max_model_len": 100}}, ["'vllm.max_model_len' (100) is below", "512 + 256"]),
        ({"lora_merge_aware": "bf17"}, ["'lora_merge_aware' must be", "'bf16'"]),
        ({"lora_merge_aware": "bf16", "peft_use_dora": True}, ["'peft_use_dora: true'", "Remove"]),
        ({"lora_merge_aware": "bf16", "load_in_4bit": True}, ["'load_in_4bit: true'"]),
        ({"lora_merge_aware": "bf16", "trl": {"vllm_lora_sync": True}}, ["'trl.vllm_lora_sync: true'"]),
        ({"adapter": None, "trl": {"vllm_lora_sync": True}}, ["full fine-tuning has none", "'adapter: lora'"]),
        ({"peft_use_dora": True, "trl": {"vllm_lora_sync": True}}, ["no DoRA", "'peft_use_dora'"]),
        ({"peft_use_dora": True}, ["'peft_use_dora: true' cannot be served", "without DoRA's magnitude"]),
        (
            {"lora_target_linear": False, "lora_target_modules": ["lm_head"], "trl": {"vllm_lora_sync": True}},
            ["'lora_target_modules' lists lm_head", "remove them"],
        ),
        ({"adapter": None, "trl": {"cast_lm_head_to_fp32": True}}, ["would train an fp32 head", "'adapter: lora'"]),
        (
            {"lora_target_linear": False, "lora_target_modules": ["lm_head"], "trl": {"cast_lm_head_to_fp32": True}},
            ["needs a head without LoRA"],
        ),
        ({"trl": {"vllm_tensor_parallel_size": 2}}, ["'trl.vllm_tensor_parallel_size: 2'", "data parallel"]),
        ({"trl": {"vllm_mode": "server"}}, ["'trl.vllm_mode: server' is not supported"]),
        ({"trl": {"vllm_server_host": "0.0.0.0"}}, ["server-mode setting"]),
        ({"trl": {"vllm_sync_interval": 5}}, ["'trl.vllm_sync_interval' is not supported"]),
        (
            {"learning_rate": 1e-4, "trl": {"learning_rate": 1e-5}},
            ["'trl.learning_rate' and 'learning_rate' are one setting, given twice", "keep one"],
        ),
        ({"micro_batch_size": 6}, ["must be a multiple of trl.num_generations (8)"]),
        ({"trl": {"num_generations": 1}}, ["'trl.num_generations' must be at least 2"]),
        ({"task": None}, ["Nothing to train on"]),
        ({"task": None, "dataset": {"path": "x"}}, ["'trl.reward_funcs' is empty"]),
        ({"dataset": {"path": "x"}}, ["Set either 'task' or 'dataset'"]),
        ({"dataset": {"split": "train"}, "task": None}, ["Missing required key 'dataset.path'"]),
        ({"adapter": None, "lora_merge_aware": "bf16"}, ["need 'adapter: lora'"]),
        ([1, 2], ["must be a mapping"]),
    ],
)
def test_bad_configs_name_the_key_and_the_fix(raw, expected):
    message = error_for(raw)
    for fragment in expected:
        assert fragment in message, message


def test_malformed_yaml_gives_the_line():
    message = error_for("lora_r: 8\ntrl:\n  num_generations: [8\n")
    assert "not valid YAML" in message and "line" in message


def test_missing_file():
    assert "Config file not found" in error_for(Path("/nonexistent/cfg.yaml"))


def test_reference_lists_every_key():
    reference = describe()
    for key in ["base_model", "lora_merge_aware", "gpu_memory_utilization", "sleep_level", "prompt_column"]:
        assert f"`{key}`" in reference


def test_the_cli_process_exits_2_with_one_line(tmp_path):
    """The other CLI tests run its ``main`` in the test's process (the ``run_cli`` fixture); this one, the command."""
    (tmp_path / "cfg.yaml").write_text("lora_rr: 8\noutput_dir: out\n")
    result = subprocess.run(
        [sys.executable, "-m", "colocate_grpo.train", "cfg.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("colocate_grpo: config error:") and "Did you mean 'lora_r'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("lora_rr: 8\noutput_dir: out\n", "Did you mean 'lora_r'"),
        ("output_dir: out\nvllm:\n  gpu_memory_utilization: 2\n", "vllm.gpu_memory_utilization"),
        ("output_dir: out\ntrl: [1\n", "not valid YAML"),
        ("output_dir: out\nbase_model: ./no/such/model\n", "not a model directory"),
        ("output_dir: out\ntrl:\n  reward_funcs: [no_such_module.reward]\n", "cannot import module"),
        ("output_dir: out\ntrl:\n  use_liger_kernel: true\n", "'trl.use_liger_kernel: true'"),  # CPU or package
    ],
)
def test_cli_bad_input_exits_2_with_one_message_and_writes_nothing(run_cli, tmp_path, text, fragment):
    (tmp_path / "cfg.yaml").write_text(text)
    result = run_cli("cfg.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert fragment in result.stderr
    assert result.stderr.startswith("colocate_grpo: config error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config", ["path", "name"])
def test_cli_check_accepts_a_good_config(run_cli, tmp_path, config):
    result = run_cli("--check", str(default_config_path()) if config == "path" else "tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_cli_check_reads_the_prompts_too(run_cli, tmp_path):
    config = load_config(default_config_path()).to_dict()
    config.update({"output_dir": str(tmp_path / "out"), "max_prompt_length": 2})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("--check", str(tmp_path / "cfg.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "longer than 'max_prompt_length' (2 tokens)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_readme_config_reference_is_current():
    readme = (REPO / "README.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    embedded = readme[readme.index(start) + len(start) : readme.index(end)]
    assert embedded.strip() == describe().strip(), "regenerate the README's config reference from describe()"


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    ci_command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command in readme


BAD_REWARDS = """
def raises(completions, **kwargs):
    raise KeyError("answer")


def nan(completions, **kwargs):
    return [float("nan") for _ in completions]


def none(completions, **kwargs):
    return [None for _ in completions]


def too_few(completions, **kwargs):
    return [1.0]
"""


@pytest.mark.parametrize(
    ("reward", "fragment"),
    [
        ("raises", "raised KeyError: 'answer'"),
        ("nan", "returned nan for an empty completion"),
        ("too_few", "returned 1 scores for 2 completions"),
    ],
)
def test_cli_bad_reward_functions_exit_2_before_training(run_cli, tmp_path, reward, fragment):
    (tmp_path / "my_rewards.py").write_text(BAD_REWARDS)
    (tmp_path / "cfg.yaml").write_text(f"output_dir: out\ntrl:\n  reward_funcs: [my_rewards.{reward}]\n")
    result = run_cli("cfg.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr and f"my_rewards.{reward}" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_reward_may_return_none_for_a_sample_it_does_not_apply_to():
    """TRL counts None as not scored by that reward (colocate_grpo.rewards counts them during the run)."""
    from datasets import Dataset

    from colocate_grpo.models import check_rewards_run

    def judge_long_answers_only(completions, **kwargs):
        return [None for _ in completions]

    check_rewards_run([judge_long_answers_only], Dataset.from_dict({"prompt": ["1+1=", "2+2="]}))


def local_dataset(tmp_path) -> str:
    folder = tmp_path / "sums"
    folder.mkdir()
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(folder)


def dataset_config(tmp_path, **dataset) -> dict:
    return {
        "output_dir": str(tmp_path / "out"),
        "task": None,
        "dataset": {"path": local_dataset(tmp_path), **dataset},
        "trl": {"reward_funcs": ["colocate_grpo.tasks.accuracy_reward"]},
    }


def test_a_local_dataset_becomes_chat_prompts_with_answers(tmp_path):
    from colocate_grpo import models

    config = load_config(
        dataset_config(tmp_path, prompt_column="question", answer_column="answer", system_prompt="Add.")
    )
    tokenizer = models.load_tokenizer(models.model_path(config))
    dataset = models.build_dataset(config, tokenizer)
    assert dataset[1]["prompt"] == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    # Every column stays, as TRL passes each to the rewards.
    assert dataset[1]["answer"] == "2" and set(dataset.column_names) == {"prompt", "question", "answer"}


def test_a_missing_dataset_column_is_named_with_the_columns_there(tmp_path):
    from colocate_grpo.train import build_trainer

    with pytest.raises(ConfigError, match=r"'dataset.prompt_column: prompt' is not a column .* question, answer"):
        build_trainer(dataset_config(tmp_path, answer_column="answer"))
    assert not (tmp_path / "out").exists()


def test_chat_prompts_for_a_tokenizer_without_a_chat_template_exit_2(run_cli, tmp_path):
    from colocate_grpo.tiny import tiny_model_path

    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_path(), base)
    (base / "chat_template.jinja").unlink()
    config = dataset_config(tmp_path, prompt_column="question", answer_column="answer")
    config["base_model"] = str(base)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("cfg.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "'dataset.chat: true' but the tokenizer of" in result.stderr and "dataset.chat: false" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_4bit_base_runs_on_the_cpu_and_is_refused_without_bitsandbytes(monkeypatch):
    from colocate_grpo.models import resolve_device

    config = load_config({"load_in_4bit": True})
    assert resolve_device(config) == "cpu"  # its NF4 values in bf16 (tests/test_nf4.py)
    # Where bitsandbytes is missing: refused before any model loads, with the install line.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ConfigError, match=r"needs bitsandbytes.*\[quant\]"):
        resolve_device(config)


def test_liger_kernels_are_refused_where_they_cannot_run():
    from colocate_grpo.validation import liger_problems

    liger = load_config({"trl": {"use_liger_kernel": True, "vllm_bitwise_logprobs": True}})
    assert liger_problems(load_config({}), "cpu") == []
    (on_cpu,) = liger_problems(liger, "cpu")
    assert "need a CUDA GPU" in on_cpu and "remove it" in on_cpu
    on_gpu = liger_problems(liger, "cuda")
    assert any("batch-invariant" in problem for problem in on_gpu)
    installed = importlib.util.find_spec("liger_kernel") is not None
    assert any("pip install liger-kernel" in problem for problem in on_gpu) is (not installed)
