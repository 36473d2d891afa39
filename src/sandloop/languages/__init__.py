"""Languages: how to run a snippet of each (file name, command, image).

Adding one is a single ``register(Language(...))`` call; built-ins are registered the same way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sandloop.contract.errors import UnknownLanguage


@dataclass(frozen=True)
class Language:
    """How to run code of one language inside the sandbox.

    The code is written to ``/tmp/sandloop/<file_name>`` and run as ``command + [that path]``.
    ``image`` None means the default runtime image, which serves every built-in language, so a
    pooled sandbox can serve any of them. ``inproc`` (Python only) runs the program inside the
    launcher's already-started interpreter instead of exec'ing a new one: same semantics, no
    interpreter start-up on the critical path.
    """

    name: str
    file_name: str
    command: tuple[str, ...]
    image: str | None = None
    aliases: tuple[str, ...] = field(default=())
    inproc: bool = False


_lock = threading.Lock()
_registry: dict[str, Language] = {}
_aliases: dict[str, str] = {}


def register(language: Language, *, replace: bool = False) -> Language:
    """Register a language (and its aliases). Refuses to shadow one unless ``replace=True``."""
    with _lock:
        names = (language.name, *language.aliases)
        if not replace:
            for n in names:
                if n in _registry or n in _aliases:
                    raise ValueError(f"language {n!r} is already registered; pass replace=True")
        _registry[language.name] = language
        for alias in language.aliases:
            _aliases[alias] = language.name
    return language


def get(name: str) -> Language:
    """The language called ``name`` (or one of its aliases), else ``UnknownLanguage``."""
    key = name.strip().lower() if isinstance(name, str) else name
    with _lock:
        lang = _registry.get(key) or _registry.get(_aliases.get(key, ""))
    if lang is None:
        raise UnknownLanguage(
            f"unknown language {name!r}; known languages: {', '.join(names())}. "
            "Register another with sandloop.languages.register(Language(...))."
        )
    return lang


def names() -> list[str]:
    with _lock:
        return sorted(_registry)


PYTHON = register(Language("python", "main.py", ("python3",), aliases=("py", "python3"), inproc=True))
NODE = register(Language("node", "main.js", ("node",), aliases=("javascript", "js", "nodejs")))
BASH = register(Language("bash", "main.sh", ("bash",), aliases=("sh", "shell")))

__all__ = ["BASH", "NODE", "PYTHON", "Language", "get", "names", "register"]
