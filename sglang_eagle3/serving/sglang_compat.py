"""SGLang's own model classes, built, loaded and run on one CPU rank.

The compatibility tests use this to put our checkpoints through SGLang's real code instead of a
re-implementation of it: its config loader (`ModelConfig`), its weight loader (`get_model` ->
`load_weights`), its aux-hidden-state wiring (`configure_aux_hidden_state_capture`) and its forward
with the pure-PyTorch attention backend (`TorchNativeAttnBackend`). Nothing here is needed to serve.

Two things SGLang wants before a model can be built, even at tensor-parallel size 1:
  * a torch.distributed world and SGLang's model-parallel groups (we use gloo, world size 1);
  * a published `ServerArgs` in SGLang's runtime context (layers read their settings from it).
`init_cpu_runtime()` sets both up once per process.

One CPU detail: on a machine that is neither CUDA nor SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`,
which needs the CPU build of sgl-kernel), SGLang's `RotaryEmbedding.__init__` imports a vLLM kernel it
never calls on CPU. `cpu_model_build()` declares the CPU platform to that one module while a model is
constructed, so its forward takes `forward_native`.
"""
from __future__ import annotations

import contextlib
import socket
from typing import Optional

import torch

SGLANG_VERSION = "0.5.23"   # the version this toolkit is tested against (requirements-sglang.txt)

_runtime_ready = False


def sglang_version() -> Optional[str]:
    """Installed SGLang version, or None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("sglang")
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def undo_import_side_effects():
    """Importing SGLang sets cache-dir environment variables and adds a root logging handler; undo both
    on exit so code that runs later in the same process (other tests) sees the environment it had."""
    import logging
    import os
    env, root = dict(os.environ), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        root.handlers[:] = handlers
        root.setLevel(level)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_cpu_runtime() -> None:
    """One gloo rank plus SGLang's parallel groups and a published CPU `ServerArgs` (idempotent)."""
    global _runtime_ready
    if _runtime_ready:
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    else:   # someone else's world: SGLang adopts it
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        publish(ServerArgs(model_path="dummy", device="cpu", dtype="float32"), role="test",
                ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    _runtime_ready = True


def shutdown_cpu_runtime() -> None:
    """Undo `init_cpu_runtime` (groups, process group, published config) so other code starts clean."""
    global _runtime_ready
    if not _runtime_ready:
        return
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    from sglang.srt.runtime_context import reset_context
    destroy_model_parallel()
    destroy_distributed_environment()
    reset_context()
    _runtime_ready = False


@contextlib.contextmanager
def cpu_model_build():
    """While SGLang models are constructed: CPU rotary embeddings, float32 parameters."""
    import sglang.srt.layers.rotary_embedding.base as rope_base
    saved_flag, saved_dtype = rope_base._is_cpu, torch.get_default_dtype()
    rope_base._is_cpu = True
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        rope_base._is_cpu = saved_flag
        torch.set_default_dtype(saved_dtype)


def load_model(path: str, is_draft: bool = False) -> torch.nn.Module:
    """Build and load an HF folder exactly as an SGLang server would: `ModelConfig` -> `get_model`.

    The class comes from SGLang's `ModelRegistry` (so plugin registrations apply) and the weights go
    through the class's own `load_weights`.
    """
    init_cpu_runtime()
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    config = ModelConfig(path, is_draft_model=is_draft, dtype="float32",
                         speculative_algorithm="EAGLE3" if is_draft else None)
    with cpu_model_build():
        model = get_model(model_config=config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    return model.eval()


def draft_aux_layer_ids(target_path: str, draft_path: str) -> Optional[list[int]]:
    """The ids SGLang's target runner hands to `set_eagle3_layers_to_capture` for this draft."""
    init_cpu_runtime()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    with get_context().override_server_args(model_path=target_path, device="cpu", dtype="float32",
                                            speculative_algorithm="EAGLE3",
                                            speculative_draft_model_path=draft_path) as server_args:
        target_config = ModelConfig(target_path, dtype="float32")
        aux = resolve_spec_aux_hidden_state_config(server_args=server_args, model_config=target_config,
                                                   spec_algorithm=SpeculativeAlgorithm.EAGLE3,
                                                   is_draft_worker=False)
    return aux.eagle_aux_hidden_state_layer_ids if aux.eagle_use_aux_hidden_state else None


def enable_aux_capture(model: torch.nn.Module, layer_ids: Optional[list[int]]) -> None:
    """SGLang's own start-up step that turns on EAGLE-3 capture in a target model."""
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    configure_aux_hidden_state_capture(model=model, eagle_use_aux_hidden_state=True,
                                       eagle_aux_hidden_state_layer_ids=layer_ids,
                                       dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None,
                                       is_dspark=False)


def _attention_layers(model):
    from sglang.srt.layers.radix_attention import RadixAttention
    layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no RadixAttention layer")
    return layers


@torch.no_grad()
def forward_extend(model: torch.nn.Module, input_ids: torch.Tensor,
                   spec_hidden_states: Optional[torch.Tensor] = None):
    """Prefill one sequence (positions 0..T-1) through `model.forward` on CPU.

    input_ids [T]; spec_hidden_states [T, n_aux*H or H] for a draft (SGLang feeds it through
    `forward_batch.spec_info.hidden_states`). Returns SGLang's `LogitsProcessorOutput`, captured with
    `CaptureHiddenMode.FULL`: `next_token_logits` [1, vocab_padded] for the last position and
    `hidden_states` [T, .] (the concatenated aux hidden states when the model captures them).
    """
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    T = int(input_ids.shape[0])
    attn = _attention_layers(model)
    req_to_token = ReqToTokenPool(size=1, max_context_len=T + 1, device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=T + 1, page_size=1, dtype=torch.float32, head_num=attn[0].tp_k_head_num,
                               head_dim=attn[0].head_dim, layer_num=max(a.layer_id for a in attn) + 1,
                               device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    slots = torch.arange(1, T + 1)                       # slot 0 is the pool's padding slot
    req_to_token.req_to_token[0, :T] = slots
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_to_token,
                                                     token_to_kv_pool=kv_pool))
    lens = torch.tensor([T], dtype=torch.int32)
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=input_ids.long(),
                         req_pool_indices=torch.zeros(1, dtype=torch.int64), seq_lens=lens,
                         seq_lens_cpu=lens.clone(), out_cache_loc=slots, seq_lens_sum=T,
                         positions=torch.arange(T))
    batch.extend_prefix_lens = torch.zeros(1, dtype=torch.int32)
    batch.extend_prefix_lens_cpu = [0]
    batch.extend_seq_lens = lens.clone()
    batch.extend_seq_lens_cpu = [T]
    batch.extend_num_tokens = T
    batch.extend_start_loc = torch.zeros(1, dtype=torch.int32)
    batch.capture_hidden_mode = CaptureHiddenMode.FULL
    batch.attn_backend = backend
    if spec_hidden_states is not None:
        batch.spec_info = SimpleNamespace(hidden_states=spec_hidden_states.float())
    with forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(batch)
        return model.forward(batch.input_ids, batch.positions, batch)
