"""Live rich display of an agent run: each model turn, the code, the result and its notes."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from sandloop.agent import AgentEvent, AgentResult, AssistantTurn, ToolCall, ToolResult

_LEXERS = {"python": "python", "node": "javascript", "bash": "bash"}
MAX_LINES = 40


def _clip(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= MAX_LINES:
        return text
    return "\n".join(lines[:MAX_LINES]) + f"\n... ({len(lines) - MAX_LINES} more lines)"


class AgentView:
    def __init__(self, console: Console) -> None:
        self.console = console

    def on_event(self, event: AgentEvent) -> None:
        turn = event.turn
        if isinstance(turn, AssistantTurn):
            title = f"model · turn {event.iteration}"
            if turn.text:
                self.console.print(Panel(Text(_clip(turn.text)), title=title, border_style="cyan", title_align="left"))
            else:
                self.console.print(Text(title, style="cyan"))
        elif isinstance(turn, ToolCall):
            code = turn.arguments.get("code") if isinstance(turn.arguments.get("code"), str) else None
            lang = str(turn.arguments.get("language") or "python")
            body: Syntax | Text
            if code is not None and turn.name == "execute_code":
                body = Syntax(_clip(code), _LEXERS.get(lang, "text"), line_numbers=False, word_wrap=True)
            else:
                body = Text(repr(turn.arguments))
            self.console.print(
                Panel(body, title=f"{turn.name} · {lang} · {turn.id}", border_style="magenta", title_align="left")
            )
        elif isinstance(turn, ToolResult):
            style = "red" if turn.is_error else "green"
            parts = []
            for line in _clip(turn.content).splitlines():
                parts.append(Text(line, style="yellow" if line.startswith("note:") else ""))
            self.console.print(
                Panel(Group(*parts), title=f"result · {turn.call_id}", border_style=style, title_align="left")
            )

    def finish(self, result: AgentResult) -> None:
        usage = f" · tokens in {result.usage.input_tokens} out {result.usage.output_tokens}" if result.usage else ""
        self.console.print(
            Text(f"stopped: {result.stop_reason} after {result.turns} model turn(s){usage}", style="bold")
        )
        # the answer itself goes to stdout, so it can be piped
        print(result.answer)
