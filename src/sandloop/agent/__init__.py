"""The agent loop (provider-agnostic) and its neutral types. Adapters live in agent/providers/."""

from sandloop.agent.loop import AgentEvent, run_agent
from sandloop.agent.tools import Tool, Toolbox, execute_code_tool, format_execution
from sandloop.agent.types import (
    AgentResult,
    AssistantTurn,
    LLMClient,
    ProviderConfigError,
    ProviderError,
    ToolCall,
    ToolResult,
    ToolSpec,
    Turn,
    Usage,
    UserTurn,
)

__all__ = [
    "AgentEvent",
    "AgentResult",
    "AssistantTurn",
    "LLMClient",
    "ProviderConfigError",
    "ProviderError",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "Toolbox",
    "Turn",
    "Usage",
    "UserTurn",
    "execute_code_tool",
    "format_execution",
    "run_agent",
]
