"""SGLang plugin of sglang-eagle3 (entry point `sglang_eagle3` in the `sglang.srt.plugins` group).

SGLang's `load_plugins()` runs `register()` in every SGLang process (launcher, scheduler, detokenizer)
once this package is pip-installed. It registers two things:

1. EAGLE-3 target capture for architectures whose SGLang class lacks `set_eagle3_layers_to_capture`
   (in SGLang 0.5.23: Gemma, Gemma2, Granite, Granite-MoE, OLMo, OLMo2, OLMoE, StableLM, StarCoder2 and
   GLM-4). Without it SGLang refuses to start EAGLE-3 on them. The classes are replaced in SGLang's
   `ModelRegistry` by subclasses with the same name (see `capture.py`); architectures that SGLang supports
   itself are left alone.
2. A start-up check of the draft against the target: an AFTER hook on
   `ServerArgs.check_server_args` refuses a draft whose vocabulary, hidden size or aux layer ids do not
   match the target, instead of serving at an acceptance length of about 1.0 (see `validate.py`).

Switching it off:
  * `SGLANG_EAGLE3_PLUGIN=0`       the plugin does nothing;
  * `SGLANG_EAGLE3_DRAFT_CHECK=0`  keep the capture, skip the draft check;
  * `SGLANG_PLUGINS=a,b`           SGLang's own allow-list; a list without `sglang_eagle3` skips it.

Cost: each SGLang process imports SGLang's model registry (all its model modules) when the plugin loads,
a few seconds of start-up in the launcher and detokenizer processes, which otherwise may not import it.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

PLUGIN_NAME = "sglang_eagle3"
ENABLE_ENV = "SGLANG_EAGLE3_PLUGIN"


def register() -> None:
    """Entry point called by `sglang.srt.plugins.load_plugins()`."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        logger.info("sglang_eagle3 plugin disabled by %s=0", ENABLE_ENV)
        return
    from sglang_eagle3.serving.sglang_plugin.capture import register_capture
    from sglang_eagle3.serving.sglang_plugin.validate import register_draft_check
    register_capture()
    register_draft_check()
