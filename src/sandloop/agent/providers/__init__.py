"""Provider adapters. Each module imports its own SDK (an optional extra) and nothing else does."""

from __future__ import annotations

from typing import Any

from sandloop.agent.types import LLMClient

PROVIDERS = ("anthropic", "openai")
#: The model used when none is named (CLI, HTTP API).
DEFAULT_MODELS = {"anthropic": "claude-sonnet-5-5", "openai": "gpt-4o"}
#: The system prompt every adapter sends unless given another.
DEFAULT_SYSTEM = (
    "You solve tasks by writing and running code with the execute_code tool. Run code to check "
    "facts and compute results instead of guessing; read the tool's notes when a run fails and "
    "change your approach. When you are done, answer plainly without calling a tool."
)


def make_client(provider: str, model: str, **options: Any) -> LLMClient:
    """``make_client("openai", "gpt-4o", base_url=...)``: the adapter for a provider by name."""
    if provider == "anthropic":
        from sandloop.agent.providers.anthropic import AnthropicClient

        return AnthropicClient(model, **options)
    if provider == "openai":
        from sandloop.agent.providers.openai import OpenAIClient

        return OpenAIClient(model, **options)
    raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
