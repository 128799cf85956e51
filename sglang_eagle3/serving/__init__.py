"""Serving: the OpenAI-compatible HTTP server on our engine (server.py, openai_protocol.py), `eagle3 serve`
(launcher.py: our engine, or SGLang's server with the tuned tree) and the SGLang plugin (sglang_plugin/)."""
