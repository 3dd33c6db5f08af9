"""The HTTP server: OpenAI- and Anthropic-compatible endpoints over the engine's front
(front/core_client.py)."""
