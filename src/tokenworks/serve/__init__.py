"""The HTTP server: OpenAI- and Anthropic-compatible endpoints over the engine's front
(engine/core_client.py)."""
