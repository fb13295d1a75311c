"""`/v1/responses`: create (whole, streamed or in the background), get, delete, cancel; a stored response's
conversation goes on under `previous_response_id`. The request runs as its chat completion (request.py) through the
router's own path, so tenancy, quotas, fairness and tool calling apply as they do to chat.

A background response (`background: true`) is answered at once, `queued`, and stored; its generation goes on in
the router, which stores the finished (or failed) response for GET to find. Cancel stops it: the task's end closes
the choice, which aborts its request on the replica, and the response is stored `cancelled`."""

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.router.chat_choices import ChatChoices
from kvloom.router.errors import APIError
from kvloom.router.openai_responses.output import (EventStream, as_messages, new_id, output_items, response_object,
                                                   response_usage)
from kvloom.router.openai_responses.request import ResponsesRequest
from kvloom.router.responses import Choice, close, merged, usage

# a chat field's name in an error, as the Responses request names it
FIELD_NAMES = [(re.compile(r"^messages"), "input"), (re.compile(r"^max_tokens"), "max_output_tokens"),
               (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
               (re.compile(r"^tools\.(\d+)\.function"), r"tools.\1")]


def as_responses_error(exc: APIError) -> APIError:
    """A chat request's error named as the Responses request's fields."""
    param = exc.param
    for chat, ours in FIELD_NAMES:
        param = chat.sub(ours, param) if param else param
    message = exc.message if param == exc.param else exc.message.replace(exc.param, param, 1)
    return APIError(exc.status, message, param, exc.code)


def not_found(response_id: str, field: str | None = None) -> APIError:
    return APIError(404, f"{field + ': ' if field else ''}no response {response_id!r}", field, "not_found")


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class ResponsesEndpoint:
    def __init__(self, store) -> None:
        self.store = store  # store.py's actor
        self.store.fail_unfinished.remote("the router restarted before the response was finished")
        self._background: dict[str, asyncio.Task] = {}  # response id -> its generation

    async def history(self, body: ResponsesRequest, tenant: str) -> list[dict]:
        """The messages of the conversation `previous_response_id` ends (none without one)."""
        if body.previous_response_id is None:
            return []
        record = await self.store.get.remote(body.previous_response_id, tenant)
        if record is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        if (status := record["response"]["status"]) != "completed":
            raise APIError(400, f"previous_response_id: response {body.previous_response_id!r} is {status}, not "
                                "completed", "previous_response_id", "invalid_value")
        return record["messages"]

    async def answer(self, action: str, response_id: str, tenant: Callable[[], str]) -> JSONResponse:
        """GET, DELETE or cancel (`action`) a stored response for the caller's tenant (`tenant()`, which may refuse
        the caller)."""
        try:
            return await getattr(self, action)(response_id, tenant())
        except APIError as exc:
            return exc.response()

    async def get(self, response_id: str, tenant: str) -> JSONResponse:
        record = await self.store.get.remote(response_id, tenant)
        return JSONResponse(record["response"]) if record else not_found(response_id).response()

    async def delete(self, response_id: str, tenant: str) -> JSONResponse:
        if not await self.store.delete.remote(response_id, tenant):
            return not_found(response_id).response()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str, tenant: str) -> JSONResponse:
        """Stop a background response; one already finished is returned as it is."""
        record = await self.store.get.remote(response_id, tenant)
        if record is None:
            return not_found(response_id).response()
        if not record["response"].get("background"):
            return APIError(400, f"response {response_id!r} was not created in the background: only those can be "
                                 "cancelled", None, "invalid_request").response()
        if (task := self._background.get(response_id)) is not None:
            task.cancel()
            await asyncio.wait([task])
            record = await self.store.get.remote(response_id, tenant)
        return JSONResponse(record["response"])

    async def respond(self, body: ResponsesRequest, tenant: str, messages: list[dict], choice: Choice,
                      written: ChatChoices):
        """The response to a started chat choice, whole or as events; stored (with `messages` and its output, the
        conversation so far) when the request asks."""
        response_id, created = new_id("resp"), time.time()
        if body.stream:
            return StreamingResponse(self._events(response_id, body, tenant, messages, choice, written),
                                     media_type="text/event-stream")
        if body.background:
            queued = response_object(response_id, body, created, "queued", [], None)
            await self.store.put.remote(response_id, tenant, {"response": queued, "messages": messages})
            self._background[response_id] = asyncio.create_task(
                self._in_background(response_id, created, body, tenant, messages, choice, written))
            return JSONResponse(queued)
        try:
            response = await self._collect(response_id, created, body, choice, written)
        except APIError as exc:
            return exc.response()
        await self._keep(body, tenant, response, messages)
        return JSONResponse(response)

    async def _collect(self, response_id: str, created: float, body: ResponsesRequest, choice: Choice,
                       written: ChatChoices) -> dict:
        """The finished response of a whole (not streamed) choice."""
        try:
            async for _, chunk in merged([choice]):
                choice.chunks.append(chunk)
        finally:
            await close([choice])
        output = output_items(written.message(choice, choice.chunks)["message"])
        return response_object(response_id, body, created, "completed", output,
                               response_usage(usage([(choice, choice.chunks[-1])])))

    async def _in_background(self, response_id: str, created: float, body: ResponsesRequest, tenant: str,
                             messages: list[dict], choice: Choice, written: ChatChoices) -> None:
        try:
            try:
                response = await self._collect(response_id, created, body, choice, written)
            except asyncio.CancelledError:
                response = response_object(response_id, body, created, "cancelled", [], None)
            except APIError as exc:
                response = response_object(response_id, body, created, "failed", [], None)
                response["error"] = {"code": exc.code or "server_error", "message": exc.message}
            await self._keep(body, tenant, response, messages)
        finally:
            self._background.pop(response_id, None)

    async def _events(self, response_id: str, body: ResponsesRequest, tenant: str, messages: list[dict],
                      choice: Choice, written: ChatChoices) -> AsyncIterator[str]:
        stream = EventStream(response_id, body)
        for event in stream.start():
            yield sse(event)
        latest = choice.first
        try:
            async for _, chunk in merged([choice]):
                latest = chunk
                for event in stream.delta(written.delta(choice, chunk)["delta"]):
                    yield sse(event)
        except APIError as exc:
            yield sse(stream.event("error", code=exc.code, message=exc.message, param=exc.param))
            return
        finally:
            await close([choice])
        events, response = stream.finish(response_usage(usage([(choice, latest)])))
        for event in events:
            yield sse(event)
        await self._keep(body, tenant, response, messages)

    async def _keep(self, body: ResponsesRequest, tenant: str, response: dict, messages: list[dict]) -> None:
        if body.store:
            output = as_messages(response["output"]) if response["status"] == "completed" else []
            await self.store.put.remote(response["id"], tenant, {"response": response, "messages": messages + output})
