"""A2A request models: camelCase and proto names, errors that name the field, and the two
error formats."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentic_sandbox.broker.a2a import errors as e
from agentic_sandbox.broker.a2a.card import clean_empty
from agentic_sandbox.broker.a2a.models import ListTasksRequest, SendMessageRequest, error_fields
from agentic_sandbox.broker.a2a.signing import SigningKey, sign_detached, verify_detached
from agentic_sandbox.broker.tasks import TaskState


def test_camel_and_snake_names_are_both_accepted() -> None:
    a = SendMessageRequest.model_validate(
        {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}}
    )
    b = SendMessageRequest.model_validate(
        {"message": {"message_id": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}}
    )
    assert a == b
    assert a.message.dump() == {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "ROLE_USER", "parts": [{"text": "x"}]}, "message.messageId"),
        ({"messageId": "m", "role": "ROLE_BOSS", "parts": [{"text": "x"}]}, "message.role"),
        ({"messageId": "m", "role": "ROLE_USER", "parts": []}, "message.parts"),
        (
            {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "a", "url": "b"}]},
            "message.parts[0]",
        ),
        ({"messageId": "m", "role": "ROLE_USER", "parts": [{"raw": "!!"}]}, "message.parts[0].raw"),
    ],
)
def test_errors_name_the_field(message: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        SendMessageRequest.model_validate({"message": message})
    assert error_fields(err.value)[0]["field"] == field


def test_list_request_parses_query_strings() -> None:
    req = ListTasksRequest.model_validate(
        {
            "status": "TASK_STATE_INPUT_REQUIRED",
            "pageSize": "5",
            "includeArtifacts": "true",
            "statusTimestampAfter": "2025-01-02T03:04:05.678Z",
        }
    )
    assert req.status is TaskState.input_required and req.page_size == 5 and req.include_artifacts
    assert req.status_timestamp_after is not None and req.status_timestamp_after.year == 2025
    assert ListTasksRequest.model_validate({"status": "TASK_STATE_UNSPECIFIED"}).status is None
    with pytest.raises(ValidationError):
        ListTasksRequest.model_validate({"pageSize": 0})


def test_error_formats_carry_error_info() -> None:
    err = e.InvalidParamsError("bad", fields=[{"field": "message.parts", "description": "empty"}])
    rpc = err.jsonrpc(5)
    assert rpc["id"] == 5 and rpc["error"]["code"] == -32602
    assert rpc["error"]["data"][0]["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    assert rpc["error"]["data"][0]["domain"] == "a2a-protocol.org"
    assert rpc["error"]["data"][1]["fieldViolations"][0]["field"] == "message.parts"
    rest = e.TaskNotFoundError().rest()["error"]
    assert rest["code"] == 404 and rest["status"] == "NOT_FOUND"
    assert rest["details"][0]["reason"] == "TASK_NOT_FOUND"
    assert e.TaskNotCancelableError.code == -32002 and e.VersionNotSupportedError.code == -32009


def test_clean_empty_matches_the_a2a_canonical_form() -> None:
    assert clean_empty({"a": "", "b": [], "c": {}, "d": [{"x": ""}], "e": 0, "f": False}) == {
        "e": 0,
        "f": False,
    }


def test_detached_signature_round_trip() -> None:
    from joserfc.jwk import OKPKey

    key = OKPKey.generate_key("Ed25519")
    sk = SigningKey(key.thumbprint(), key, key.as_dict(private=False))
    payload = {"name": "ünïcode", "n": 1.0, "list": [3, 2, 1]}
    sig = sign_detached(payload, sk)
    assert verify_detached(payload, sig, sk.public_jwk)
    assert not verify_detached({**payload, "n": 2}, sig, sk.public_jwk)
