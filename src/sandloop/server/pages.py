"""Routes that are not the API proper: the playground, /docs (served locally), health, metrics."""

from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

from sandloop.contract import SandboxError
from sandloop.server.context import Api
from sandloop.server.errors import ApiError, error_for


def add_pages(app: FastAPI, api: Api, metrics_access: Literal["open", "token", "off"]) -> None:
    root, metrics = api.root, api.metrics
    # -- pages ----------------------------------------------------------------------------------
    static = resources.files("sandloop.server").joinpath("static")
    page = static.joinpath("index.html").read_text()
    try:
        # Swagger UI 5 (fastapi-offline's copy, no CDN): FastAPI's schema is OpenAPI 3.1, which
        # Swagger UI 4 cannot read ("does not specify a valid version field").
        swagger_ui = resources.files("fastapi_offline").joinpath("static")

        # Before /static, which would otherwise match these paths first.
        app.mount("/static/swagger", StaticFiles(directory=str(swagger_ui)), name="swagger")
        docs_page = static.joinpath("docs.html").read_text()
    except ModuleNotFoundError:  # pragma: no cover - the server extra installs it
        docs_page = "<p>Swagger UI is not installed (pip install 'sandloop[server]'); the spec is at /openapi.json</p>"
    app.mount("/static", StaticFiles(packages=[("sandloop.server", "static")]), name="static")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def playground() -> str:
        """The web playground: plain HTML and JavaScript over this same API."""
        return page

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> str:
        """Swagger UI, served from this server (no CDN)."""
        return docs_page

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        try:
            root.info()
            return {"status": "ok"}
        except SandboxError as exc:
            raise error_for(exc) from None

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=metrics_access != "off")
    def prometheus(request: Request) -> str:
        if metrics_access == "off":
            raise ApiError(404, "not_found", "metrics are off on this server (sandloop serve --metrics)")
        stats = root.dispatcher.stats()
        lines = ["# TYPE sandloop_runs_total counter"]
        lines += [f'sandloop_runs_total{{outcome="{k}"}} {v}' for k, v in sorted(metrics.runs.items())]
        lines += ["# TYPE sandloop_run_seconds_sum counter", f"sandloop_run_seconds_sum {metrics.seconds_sum:.6f}"]
        lines += ["# TYPE sandloop_runs_by_backend_total counter"]
        lines += [f'sandloop_runs_by_backend_total{{backend="{k}"}} {v}' for k, v in sorted(metrics.backends.items())]
        lines += ["# TYPE sandloop_rejections_total counter"]
        lines += [f'sandloop_rejections_total{{code="{k}"}} {v}' for k, v in sorted(metrics.rejections.items())]
        lines += ["# TYPE sandloop_warm_runs_total counter", f"sandloop_warm_runs_total {stats['warm_runs']}"]
        lines += ["# TYPE sandloop_cold_runs_total counter", f"sandloop_cold_runs_total {stats['cold_runs']}"]
        lines += ["# TYPE sandloop_pool_ready gauge"]
        lines += [f'sandloop_pool_ready{{pool="{k}"}} {v["ready"]}' for k, v in stats["pools"].items()]
        lines += ["# TYPE sandloop_in_flight gauge", f"sandloop_in_flight {stats['in_flight']}"]
        return "\n".join(lines) + "\n"
