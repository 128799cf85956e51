"""The models: the one EAGLE-3 draft definition (draft.py, its config.json in config.py, its checkpoint I/O in
draft_checkpoint.py) used by the trainer, the engine and the exporters; the target runtime (target.py: a Hugging Face
causal LM run as the verifier, over the fixed-row KV pool in kvcache.py); and the embedded default target
(testbed.py)."""
