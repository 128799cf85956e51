"""Draft folders on disk and what other engines read: our layout (SGLang's), the released EAGLE-3 one, vLLM's
speculators layout and llama.cpp's GGUF (convert.py, eagle.py, speculators.py, gguf.py), and `eagle3 check-draft`,
which says whether a folder will load and run correctly next to its target (check_draft.py, check_target.py)."""
