"""The HTTP gateway: OpenAI- and Anthropic-compatible APIs over the daemon's engine loops."""
