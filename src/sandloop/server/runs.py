"""Routes: one-shot runs (optionally streamed), agent runs (server-sent events), usage."""

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from sandloop.requests import check_secrets
from sandloop.server.context import Api, Auth
from sandloop.server.errors import ApiError
from sandloop.server.models import AgentRunIn, RunIn, secrets_of
from sandloop.server.providers import EndpointConfigError, EndpointRefused
from sandloop.server.quota import check_agent_budget


def runs_routes(api: Api) -> APIRouter:
    router = APIRouter()
    root, store, rates, endpoints = api.root, api.tokens, api.rates, api.endpoints
    run_code = root.run_code
    limits_for, clamp_timeout, count, sse_from_thread = (
        api.limits_for,
        api.clamp_timeout,
        api.count,
        api.sse_from_thread,
    )

    @router.post("/v1/runs", response_model=None)
    async def create_run(body: RunIn, token: Auth) -> dict[str, Any] | StreamingResponse:
        """Run code once in a fresh sandbox. With ``stream: true`` the answer is server-sent
        events: output as it arrives, then the result."""
        limits = limits_for(token, body.limits)
        timeout = clamp_timeout(token, body.timeout_seconds)
        secrets = secrets_of(body.secrets)
        template = body.template
        if template is not None:  # one this token may see (its own, or the operator's)
            await run_in_threadpool(root.templates.image_for, template, token.id)

        def run(on_output: Any = None) -> Any:
            return run_code(
                body.code,
                body.language,
                timeout,
                limits=limits,
                stdin=body.stdin,
                on_output=on_output,
                secrets=secrets,
                template=template,
            )

        if body.stream:  # a run ends by its own timeout: the cancel is not needed
            return api.sse_output(token, lambda on_output, _cancel: run(on_output))
        with rates.use(token):  # 429s are decided here, before any thread is taken
            result = await run_in_threadpool(run)
        return count(result)

    @router.get("/v1/usage")
    def usage(token: Auth) -> dict[str, Any]:
        """This token's agent usage today (UTC) and its ceilings."""
        used = store.usage(token.id)
        return {
            "day": used.day,
            "agent_runs": used.agent_runs,
            "agent_iterations": used.agent_iterations,
            "input_tokens": used.input_tokens,
            "output_tokens": used.output_tokens,
            "limits": {
                "agent_runs_per_day": token.agent_runs_per_day,
                "agent_tokens_per_day": token.agent_tokens_per_day,
                "agent_max_iterations": token.agent_max_iterations,
            },
        }

    @router.post("/v1/agent/runs", response_class=StreamingResponse)
    async def agent_run(body: AgentRunIn, token: Auth) -> StreamingResponse:
        """Run the agent loop; its transcript streams as server-sent events (assistant,
        tool_call, tool_result, then done with the answer, or error). The model endpoint is one
        the operator listed (``base_url`` picks among them; any other is refused, 403)."""
        import dataclasses

        from sandloop.agent import run_agent
        from sandloop.agent.providers import DEFAULT_MODELS, make_client
        from sandloop.agent.tools import execute_code_tool
        from sandloop.agent.types import ProviderError

        limits = limits_for(token, body.limits)
        timeout = clamp_timeout(token, body.timeout_seconds)
        secrets = check_secrets(secrets_of(body.secrets), limits)  # checked before the model is called
        try:
            endpoint = endpoints.resolve(body.provider, body.base_url, token.provider_urls)
            key = endpoint.api_key()
        except EndpointRefused as exc:
            raise ApiError(403, "provider_url_refused", str(exc)) from None
        except EndpointConfigError as exc:
            raise ApiError(503, "provider_config", str(exc)) from None
        iterations = body.max_iterations or min(10, token.agent_max_iterations)
        check_agent_budget(store, token, iterations)
        try:
            client = make_client(
                body.provider, body.model or DEFAULT_MODELS[body.provider], base_url=endpoint.base_url, api_key=key
            )
        except ProviderError as exc:
            raise ApiError(400, "provider_config", str(exc)) from None
        rates.enter(token)
        store.record_usage(token.id, agent_runs=1)

        class BudgetSpent(Exception):
            pass

        def work(emit: Any) -> None:
            def on_event(event: Any) -> None:
                emit(event.kind, dataclasses.asdict(event.turn))
                if event.kind == "assistant":
                    spent = event.turn.usage
                    used = store.record_usage(
                        token.id,
                        iterations=1,
                        input_tokens=spent.input_tokens if spent else 0,
                        output_tokens=spent.output_tokens if spent else 0,
                    )
                    if used.model_tokens >= token.agent_tokens_per_day and event.turn.tool_calls:
                        raise BudgetSpent(
                            f"this token's {token.agent_tokens_per_day} model tokens for {used.day} (UTC) are "
                            "used; the run stopped before its next tool call"
                        )

            try:
                tools = [
                    execute_code_tool(limits=limits, default_timeout=timeout, runner=root.run_code, secrets=secrets)
                ]
                result = run_agent(body.task, client, iterations, tools=tools, on_event=on_event)
            except BudgetSpent as exc:
                emit("error", {"code": "over_daily_budget", "message": str(exc)})
                return
            except ProviderError as exc:
                emit("error", {"code": "provider_error", "message": str(exc)})
                return
            emit(
                "done",
                {
                    "answer": result.answer,
                    "stop_reason": result.stop_reason,
                    "turns": result.turns,
                    "usage": None if result.usage is None else dataclasses.asdict(result.usage),
                },
            )

        return sse_from_thread(work, lambda: rates.leave(token))

    return router
