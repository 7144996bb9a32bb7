"""The server's ASGI guard (API key on /v1/, request body bound), driven as uvicorn drives it."""

import asyncio
import json

from edgellm.serve.app import _Guard


async def _downstream(scope, receive, send):
    """Reads the whole body, answers 200 with its length."""
    n = 0
    while True:
        msg = await receive()
        n += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(n).encode()})


def _call(guard, path, headers, chunks):
    sent = []

    async def run():
        q = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return q.pop(0) if q else {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        try:
            await guard(scope, receive, send)
        except Exception as e:  # an HTTPException from the body bound: FastAPI's handler makes the 413
            return e
        return None

    err = asyncio.run(run())
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, err


def test_api_key_is_required_on_v1_only():
    g = _Guard(_downstream, limit=1000, api_key="s3cret")
    status, body, _ = _call(g, "/v1/completions", [], [b"{}"])
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, _ = _call(g, "/v1/completions", [(b"authorization", b"Bearer wrong")], [b"{}"])
    assert status == 401
    status, body, _ = _call(g, "/v1/completions", [(b"authorization", b"Bearer s3cret")], [b"{}"])
    assert status == 200 and body == b"2"
    status, _, _ = _call(g, "/health", [], [b""])
    assert status == 200


def test_body_bound_by_length_header_and_while_reading():
    g = _Guard(_downstream, limit=1000, api_key=None)
    status, body, _ = _call(g, "/v1/completions", [(b"content-length", b"5000")], [b"x" * 5000])
    assert status == 413 and "1000" in json.loads(body)["error"]["message"]
    # no length header (chunked): refused once more than the bound has arrived
    status, _, err = _call(g, "/v1/completions", [], [b"x" * 600, b"x" * 600])
    assert status is None and getattr(err, "status_code", None) == 413
    status, body, _ = _call(g, "/v1/completions", [], [b"x" * 600, b"x" * 300])
    assert status == 200 and body == b"900"
