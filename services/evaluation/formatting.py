"""Plan text → day dicts, through a pinned formatter whose config is hashed into the run.

The formatter is the formatter service's own code (`services.formatter.core.Formatter`), so an
eval formats exactly as the reward scorer does:
- `parser` (default): the exact parser of the structured day-by-day form, no model;
- `llm` / `auto`: the LLM backend over an OpenAI-compatible API (STAR_FORMATTER_LLM_URL / _MODEL),
  `auto` trying the parser first.
The config records the backend, the LLM model and the source hashes of the parser and the
extraction prompt, so a different formatter, model or prompt changes the run's config hash.
Any other formatter plugs in as `module:factory` returning an object with `config: dict` and
`format(query, text) -> (days | None, status)`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from typing import Any, Protocol

from services.common.schemas import TravelQuery


class PlanFormatter(Protocol):
    config: dict[str, Any]

    def format(self, query: TravelQuery, text: str) -> tuple[list[dict[str, Any]] | None, str]: ...


class FormatterUnavailable(RuntimeError):
    pass


def _source_sha256(module_name: str) -> str:
    module = importlib.import_module(module_name)
    return hashlib.sha256(inspect.getsource(module).encode("utf-8")).hexdigest()


class ServiceFormatter:
    """The formatter service's `Formatter`, in-process, with one fixed backend."""

    def __init__(self, backend: str = "structured", settings: Any = None) -> None:
        try:
            from services.formatter.core import Formatter
        except ImportError as exc:
            raise FormatterUnavailable(f"the formatter service is not available: {exc}") from None
        self.backend = backend
        if backend == "structured":
            self._formatter = Formatter(None)
        else:
            from services.common.settings import get_settings

            settings = settings or get_settings()
            if not settings.formatter_llm_url:
                raise FormatterUnavailable(
                    f"--formatter {backend} needs an LLM: set STAR_FORMATTER_LLM_URL and STAR_FORMATTER_LLM_MODEL"
                )
            self._formatter = Formatter.from_settings(settings, remote=False)
        self.config: dict[str, Any] = {
            "kind": "structured-parser" if backend == "structured" else "formatter-llm",
            "backend": backend,
            "parser_sha256": _source_sha256("services.formatter.structured"),
        }
        if backend != "structured":
            from services.formatter.prompt import PROMPT_VERSION

            llm = self._formatter.llm
            self.config |= {
                "llm_model": llm.model if llm is not None else None,
                "prompt_version": PROMPT_VERSION,
                "prompt_sha256": _source_sha256("services.formatter.prompt"),
            }

    def format(self, query: TravelQuery, text: str) -> tuple[list[dict[str, Any]] | None, str]:
        result = self._formatter.format(text, query, self.backend)  # type: ignore[arg-type]
        if not result.ok or result.plan is None:
            return None, result.status + (f": {result.error[:300]}" if result.error else "")
        return [day.model_dump() for day in result.plan.days], "ok"

    def close(self) -> None:
        self._formatter.close()


def StructuredParser() -> ServiceFormatter:  # noqa: N802 - the default formatter, named for what it is
    return ServiceFormatter("structured")


def load_formatter(spec: str | None) -> PlanFormatter:
    """parser (default) | llm | auto | module:factory."""
    if spec in (None, "", "parser", "structured"):
        return ServiceFormatter("structured")
    if spec in ("llm", "auto"):
        return ServiceFormatter(spec)
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise FormatterUnavailable(f"cannot load formatter {spec!r}: {exc}") from None
    try:
        formatter = factory()
    except Exception as exc:  # noqa: BLE001 - a plug-in's own failure, reported as a config problem
        raise FormatterUnavailable(f"formatter {spec!r} failed to start: {type(exc).__name__}: {exc}") from None
    if not isinstance(getattr(formatter, "config", None), dict) or not callable(getattr(formatter, "format", None)):
        raise FormatterUnavailable(f"{spec!r} did not return a formatter (needs .config dict and .format())")
    return formatter
