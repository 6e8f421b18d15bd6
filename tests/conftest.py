"""Shared test set-up: caches kept out of the user's home, the Triton interpreter on machines
without CUDA, and the fixtures several files use (the default model loaded once per run, the
live servers over the default model and over the agent replay script).

Caches: tallow's cache (CPU kernels, converted GGUF weights; TALLOW_CACHE_DIR), XDG_CACHE_HOME,
HF_HOME and Triton's cache all point into one temporary folder for the session, so nothing
writes to ~/.cache. The folder starts with symbolic links to what the user's tallow cache already
holds (the kernels of this source, the converted default model): reading those is free, building
them again would cost every session about 7 s per kernel build and 6 s for the GGUF conversion.
Both caches replace files atomically (os.replace), so a write there replaces the link in the
temporary folder and never reaches the user's file. Subprocesses inherit the environment.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import pytest

def _user_tallow_cache() -> str:
    from tallow.config import _default_cache_dir

    return _default_cache_dir()


def _private_caches() -> str:
    """Point every cache the tests could fill at a fresh temporary folder; returns it."""
    user_cache = _user_tallow_cache()
    root = tempfile.mkdtemp(prefix="tallow-tests-")
    tallow_cache = os.path.join(root, "tallow")
    for sub, prefix, suffix in (("kernels", "tallow_cpu_", ".so"), ("gguf", "", ".safetensors")):
        os.makedirs(os.path.join(tallow_cache, sub))
        source = os.path.join(user_cache, sub)
        if os.path.isdir(source):  # finished files only, not another process's build in progress
            for name in os.listdir(source):
                if name.startswith(prefix) and name.endswith(suffix):
                    os.symlink(os.path.join(source, name), os.path.join(tallow_cache, sub, name))
    os.environ["TALLOW_CACHE_DIR"] = tallow_cache
    os.environ["XDG_CACHE_HOME"] = os.path.join(root, "xdg")
    os.environ["HF_HOME"] = os.path.join(root, "huggingface")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    os.environ["TRITON_HOME"] = os.path.join(root, "triton-home")
    return root


def _interpret_triton_without_cuda() -> None:
    """Without CUDA, Triton's kernels can only run interpreted: set TRITON_INTERPRET=1 before
    anything imports triton, so the triton_interp tier (pytest -m triton_interp) runs them."""
    import importlib.util

    import torch

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() \
            and importlib.util.find_spec("triton") is not None:
        os.environ["TRITON_INTERPRET"] = "1"


_CACHE_ROOT = _private_caches()
_interpret_triton_without_cuda()


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


# ---- models and servers shared across files ------------------------------------------------


@pytest.fixture(scope="session")
def default_model():
    """The default model in float32 on the CPU, dense, loaded once per run (from the converted-weights
    cache). Engine cores built on it must use quantization="none": quantizing replaces its layers
    in place."""
    import torch

    from tallow.config import EngineConfig
    from tallow.models.loader import load_model

    return load_model("default", dtype=torch.float32, device=torch.device("cpu"), cache_dir=EngineConfig().cache_dir)


def _serve(engine):
    from serve_utils import LiveServer

    with LiveServer(engine) as live:
        yield live
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="session")
def real_server():
    """A live server over the default model on dense weights (greedy text is then the same for any
    batch shape), shared by the OpenAI, Anthropic, Responses and tools files."""
    from serve_utils import start_real_engine

    yield from _serve(start_real_engine())


@pytest.fixture(scope="session")
def agent_replay_server():
    """A live server over the replay model of tests/data/replay_agents.json, which renders with
    Qwen3's template (tools section, <think>) and says scripted replies."""
    from serve_utils import AGENT_REPLAY_SCRIPT, replay_engine

    yield from _serve(replay_engine(AGENT_REPLAY_SCRIPT))
