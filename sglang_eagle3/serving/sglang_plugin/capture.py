"""EAGLE-3 target capture for SGLang model classes that do not implement it.

SGLang's target runner switches EAGLE-3 on with `model.set_eagle3_layers_to_capture(ids)` and refuses
to start ("does not implement set_eagle3_layers_to_capture") when the target class lacks it. A class
that has it (Llama, Qwen2/3, ...) then passes the residual stream at the *input* of layers id+1 to its
logits processor as `aux_hidden_states`; the logits processor stores their concatenation
[tokens, n_aux * H] in `LogitsProcessorOutput.hidden_states`, which is what the draft reads.

For the classes below we add the same behaviour without touching their forward code:
  * a forward pre-hook on each captured decoder layer records that layer's input stream
    (`hidden_states`, plus `residual` for layers that carry the residual separately);
  * a forward pre-hook on `logits_processor` hands the records over as `aux_hidden_states`.
Hooks are installed by `set_eagle3_layers_to_capture`, so a target served without EAGLE-3 runs the
original code path. Classes whose inner model already collects aux states (GLM-4) only get the setter.

The subclasses keep the original class name and are registered in SGLang's `ModelRegistry` under the
original architecture name, so `isinstance` checks and name-based switches in SGLang still hold.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

from torch import nn

logger = logging.getLogger(__name__)

# Decoder layers called as layer(positions, hidden_states, forward_batch[, residual]); each was checked
# on CPU against transformers' output_hidden_states (tests/serving/test_sglang_plugin.py). Not every class
# lacking the setter qualifies: those whose layers keep the residual in SGLang's batch-level residual
# stream (Mixtral, ...) do not see the full stream in their arguments, and that check fails for them.
HOOKED_ARCHITECTURES = (
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "OlmoForCausalLM",
    "Olmo2ForCausalLM",
    "OlmoeForCausalLM",
    "StableLmForCausalLM",
    "Starcoder2ForCausalLM",
)
# Inner model already collects aux hidden states into `layers_to_capture`; only the setter is missing.
SETTER_ONLY_ARCHITECTURES = ("Glm4ForCausalLM",)
SUPPORTED_ARCHITECTURES = HOOKED_ARCHITECTURES + SETTER_ONLY_ARCHITECTURES


def _layer_input_stream(args: tuple, kwargs: dict):
    """Residual stream entering a decoder layer -> (tensor, owned).

    Layers that keep the residual apart get (hidden_states, residual) where the stream is their sum
    (residual is None at the first layer); the others get the stream itself.
    """
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    residual = kwargs["residual"] if "residual" in kwargs else (args[3] if len(args) > 3 else None)
    if residual is None:
        return hidden, False          # borrowed: the layer may reuse its storage
    return hidden + residual, True    # a fresh tensor


def _capture_hook(model, first: bool, module, args, kwargs):
    if not model.capture_aux_hidden_states:
        return None
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList
    if first or model._eagle3_aux is None:
        model._eagle3_aux = AuxHiddenStateList()
    stream, owned = _layer_input_stream(args, kwargs)
    model._eagle3_aux.capture(stream, owned=owned)
    return None


def _inject_hook(model, module, args, kwargs):
    aux, model._eagle3_aux = model._eagle3_aux, None
    if not model.capture_aux_hidden_states or aux is None:
        return None
    if kwargs.get("aux_hidden_states") is not None or (len(args) > 4 and args[4] is not None):
        return None
    return args, {**kwargs, "aux_hidden_states": aux}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layer list at .model.layers")
    return layers


class AuxCaptureMixin:
    """Adds `set_eagle3_layers_to_capture` (SGLang's EAGLE-3 target API) to a target class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._eagle3_native = hasattr(getattr(self, "model", None), "layers_to_capture")
        if not hasattr(self, "capture_aux_hidden_states"):
            self.capture_aux_hidden_states = False
        self._eagle3_aux = None
        self._eagle3_hooks = []

    def set_eagle3_layers_to_capture(self, layer_ids: Optional[list[int]] = None) -> None:
        """layer_ids in SGLang's convention (id i = output of layer i); None = SGLang's default."""
        config = getattr(self.config, "text_config", self.config)
        num_layers = config.num_hidden_layers
        if layer_ids is None:
            capture = [2, num_layers // 2, num_layers - 3]
        else:
            capture = [int(i) + 1 for i in layer_ids]
        bad = [c - 1 for c in capture if not 0 <= c < num_layers]
        if bad:
            raise ValueError(f"{type(self).__name__}: eagle_aux_hidden_state_layer_ids {list(layer_ids)} has ids "
                             f"{bad} outside [0, {num_layers - 2}] for this {num_layers}-layer target")
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = capture
        if self._eagle3_native:
            return
        for handle in self._eagle3_hooks:
            handle.remove()
        layers = decoder_layers(self)
        order = sorted(set(capture))
        self._eagle3_hooks = [
            layers[i].register_forward_pre_hook(functools.partial(_capture_hook, self, i == order[0]),
                                                with_kwargs=True)
            for i in order
        ]
        self._eagle3_hooks.append(self.logits_processor.register_forward_pre_hook(
            functools.partial(_inject_hook, self), with_kwargs=True))


def with_aux_capture(cls: type) -> type:
    """A subclass of an SGLang target class that supports EAGLE-3 capture (same class name)."""
    return type(cls.__name__, (AuxCaptureMixin, cls), {
        "__module__": __name__, "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__name__} with EAGLE-3 aux hidden-state capture (sglang_eagle3 plugin).",
        "_eagle3_base": cls,
    })


def register_capture(architectures=SUPPORTED_ARCHITECTURES) -> list[str]:
    """Replace each listed architecture that lacks the setter in SGLang's ModelRegistry; returns those."""
    from sglang.srt.models.registry import ModelRegistry
    done = []
    for arch in architectures:
        cls = ModelRegistry.models.get(arch)
        if not isinstance(cls, type) or hasattr(cls, "set_eagle3_layers_to_capture"):
            continue                    # absent from this SGLang, or SGLang implements it itself
        ModelRegistry.models[arch] = with_aux_capture(cls)
        done.append(arch)
    if done:
        logger.info("sglang_eagle3: EAGLE-3 target capture added for %s", ", ".join(done))
    return done
