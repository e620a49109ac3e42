"""Client-facing error shapes: exact bodies, retry headers, and the official SDKs' parsing."""

from __future__ import annotations

import anthropic
import httpx2
import openai
import pytest
from anthropic.types.shared.error_response import ErrorResponse as AnthropicErrorResponse
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


def _respond(err: APIError) -> httpx2.Response:
    return httpx2.Response(err.status, headers=err.headers(), json=err.body())


def _openai(err: APIError) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="k",
        base_url="http://r/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(lambda _: _respond(err))),
    )


def _anthropic(err: APIError) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="k",
        base_url="http://r",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(lambda _: _respond(err))),
    )


def test_openai_body_is_exactly_the_openai_error_shape() -> None:
    err = invalid_request("messages.0.role", "Input should be 'user'")
    assert err.body() == {
        "error": {
            "message": "messages.0.role: Input should be 'user'",
            "type": "invalid_request_error",
            "param": "messages.0.role",
            "code": None,
        }
    }
    assert err.status == 400


def test_anthropic_body_is_exactly_the_anthropic_error_shape() -> None:
    err = invalid_request("max_tokens", "Field required", api="anthropic")
    assert err.body() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }


@pytest.mark.parametrize(
    ("make", "status", "kind", "openai_type", "code"),
    [
        (
            lambda api: invalid_request("x", "fix it", api),
            400,
            "invalid_request_error",
            "invalid_request_error",
            None,
        ),
        (
            lambda api: unauthorized(api=api),
            401,
            "authentication_error",
            "invalid_request_error",
            "invalid_api_key",
        ),
        (
            lambda api: not_found("model 'm'", "use 'beam'", api),
            404,
            "not_found_error",
            "invalid_request_error",
            "not_found",
        ),
        (
            lambda api: too_large(10, 20, api),
            413,
            "request_too_large",
            "invalid_request_error",
            "request_too_large",
        ),
        (
            lambda api: rate_limited(2.5, api),
            429,
            "rate_limit_error",
            "requests",
            "rate_limit_exceeded",
        ),
        (lambda api: upstream_failed("reset", api), 502, "api_error", "server_error", None),
    ],
)
def test_each_helper_renders_in_both_dialects(make, status, kind, openai_type, code) -> None:  # type: ignore[no-untyped-def]
    o, a = make("openai"), make("anthropic")
    assert o.status == a.status == status
    assert o.body()["error"]["type"] == openai_type
    assert o.body()["error"]["code"] == code
    assert a.body() == {"type": "error", "error": {"type": kind, "message": a.message}}
    assert o.message == a.message and o.message


def test_overloaded_is_503_for_openai_and_529_for_anthropic_and_converts() -> None:
    o = overloaded(3, "openai")
    assert (o.status, o.body()["error"]["type"]) == (503, "server_error")
    a = o.for_api("anthropic")
    assert (a.status, a.body()["error"]["type"]) == (529, "overloaded_error")
    assert a.for_api("openai").status == 503
    assert overloaded(None, "anthropic").status == 529


def test_retry_headers_round_up_and_name_retryable_errors() -> None:
    h = rate_limited(2.2).headers()
    assert h == {"x-should-retry": "true", "retry-after": "3", "retry-after-ms": "2200"}
    assert "retry-after" not in overloaded(None).headers()
    assert invalid_request("a", "b").headers() == {}


def test_openai_sdk_raises_the_matching_exception_with_our_fields() -> None:
    client = _openai(invalid_request("temperature", "Input should be a valid number"))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.param == "temperature"
    assert info.value.type == "invalid_request_error"
    assert info.value.status_code == 400
    with pytest.raises(openai.RateLimitError) as rl:
        _openai(rate_limited(1)).chat.completions.create(model="m", messages=[])
    assert rl.value.code == "rate_limit_exceeded"
    assert rl.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError):
        _openai(overloaded(1)).completions.create(model="m", prompt="x")


def test_anthropic_sdk_parses_our_error_bodies() -> None:
    cases = [
        (
            invalid_request("max_tokens", "Field required", api="anthropic"),
            anthropic.BadRequestError,
        ),
        (unauthorized(api="anthropic"), anthropic.AuthenticationError),
        (not_found("model 'x'", api="anthropic"), anthropic.NotFoundError),
        (rate_limited(1, "anthropic"), anthropic.RateLimitError),
        (overloaded(1, "anthropic"), anthropic.InternalServerError),
        (upstream_failed("boom", "anthropic"), anthropic.InternalServerError),
    ]
    for err, exc_type in cases:
        # the body validates against the SDK's own error-response model
        AnthropicErrorResponse.model_validate(err.body())
        with pytest.raises(exc_type) as info:
            _anthropic(err).messages.create(
                model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.status_code == err.status
        assert info.value.type == err.type
        assert info.value.api_message == err.message


def test_anthropic_sdk_maps_request_too_large_to_its_413_class() -> None:
    err = too_large(100, 200, api="anthropic")
    with pytest.raises(anthropic.APIStatusError) as info:
        _anthropic(err).messages.create(model="m", max_tokens=1, messages=[])
    assert info.value.status_code == 413
    assert info.value.body == err.body()


def test_api_error_is_an_exception_with_a_readable_str() -> None:
    err = not_found("model 'gpt'", "this deployment serves 'beam'")
    assert isinstance(err, Exception)
    assert str(err) == "404 not_found_error: model 'gpt' not found: this deployment serves 'beam'"
    assert err.args == (err.message,)
