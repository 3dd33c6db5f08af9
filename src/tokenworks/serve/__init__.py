"""The HTTP server: OpenAI- and Anthropic-compatible endpoints over the async engine."""
