"""/v1/responses as the steps that the HTTP handler and the batch runner share, as completions.py is
for chat and completions: a body checked and planned (`plan_responses_body`), its grammar compiled
off the engine's thread, and a whole response kept in the response store as `store` asks. One path,
so that a batch line is served, or refused, exactly as the same body POSTed would be. No jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxcb.errors import InvalidRequestError
from jaxcb.server.completions import check_model, compile_grammar
from jaxcb.server.requests import PlannedRequest
from jaxcb.server.responses import ResponsePlan, ResponsesRequest, parse_responses_request, plan_response, responses_field
from jaxcb.server.responses_output import reply_messages

if TYPE_CHECKING:
    from jaxcb.server.app import ServerState

RESPONSES = "/v1/responses"


@dataclass
class PlannedResponse:
    """A Responses body as the engine will serve it: the parsed body and its plan."""

    req: ResponsesRequest
    plan: ResponsePlan

    @property
    def planned(self) -> PlannedRequest:
        return self.plan.planned


def plan_responses_body(state: "ServerState", body: Any) -> PlannedResponse:
    """`body` (decoded JSON), checked and planned; InvalidRequestError / APIError naming the Responses field."""
    srv = state.cfg.server
    req = parse_responses_request(body)
    check_model(state, req.model)
    plan = plan_response(req, state.responses, state.client.tokenizer, state.tool_parser(), state.client.max_model_len,
                         srv.tool_prompt_fallback, state.reasoning_parser, srv.structured_outputs_in_reasoning,
                         state.client.sampling_defaults)
    return PlannedResponse(req, plan)


async def compile_response_grammar(state: "ServerState", planned: PlannedResponse) -> None:
    """compile_grammar, a refusal named by the Responses field it came from (text.format, not response_format)."""
    try:
        await compile_grammar(state, planned.planned)
    except InvalidRequestError as e:
        raise responses_field(e) from None


def store_response(state: "ServerState", planned: PlannedResponse, response: dict[str, Any]) -> None:
    """Keep `response` for previous_response_id and GET when its body asked (`store`); its `store` field then
    says whether it was kept (not with server.responses_store_size=0)."""
    response["store"] = planned.req.store and state.responses.put(
        response, planned.plan.history + reply_messages(response["output"]))
