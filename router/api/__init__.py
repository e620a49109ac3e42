"""beamserve.router.api: the router's client-facing API formats, pure (no I/O).

OpenAI `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models` and Anthropic
`/v1/messages` in; OpenAI chat/completions to the workers; answers, streams and errors back in
the client's own format. Modules: `errors` (error shapes), `models` (request validation:
`parse_request`), `convert` (`to_upstream`, answers back), `sse` (stream decoding and
translation), `session` (session identity and turn position).
"""

from beamserve.router.api.convert import (
    UpstreamCall,
    model_list,
    to_anthropic_message,
    to_responses_object,
    to_upstream,
    with_model,
)
from beamserve.router.api.errors import (
    APIError,
    invalid_request,
    not_found,
    overloaded,
    rate_limited,
    too_large,
    unauthorized,
    upstream_failed,
)
from beamserve.router.api.models import API_PATHS, ApiName, ParsedRequest, parse_request
from beamserve.router.api.session import is_continuing_turn, session_id_from, turn_index
from beamserve.router.api.sse import (
    AnthropicStream,
    OpenAIPassthrough,
    ResponsesStream,
    StreamTranslator,
    UpstreamSSEDecoder,
    UpstreamStreamError,
    error_event,
    translator_for,
)

__all__ = [
    "API_PATHS",
    "APIError",
    "AnthropicStream",
    "ApiName",
    "OpenAIPassthrough",
    "ParsedRequest",
    "ResponsesStream",
    "StreamTranslator",
    "UpstreamCall",
    "UpstreamSSEDecoder",
    "UpstreamStreamError",
    "error_event",
    "invalid_request",
    "is_continuing_turn",
    "model_list",
    "not_found",
    "overloaded",
    "parse_request",
    "rate_limited",
    "session_id_from",
    "to_anthropic_message",
    "to_responses_object",
    "to_upstream",
    "too_large",
    "translator_for",
    "turn_index",
    "unauthorized",
    "upstream_failed",
    "with_model",
]
