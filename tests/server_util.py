"""Server-test helpers shared by the in-process and the real-process suites."""
from __future__ import annotations


def assert_error(status: int, body: dict, expected_status: int, param: str | None = "any") -> dict:
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error
