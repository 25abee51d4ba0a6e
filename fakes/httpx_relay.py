"""The data path's upstream client for in-process replicas, which only httpx can reach (tests'
``httpx.MockTransport`` replicas, the simulation's ``SimTransport``): the proxy's shared
``httpx.AsyncClient`` over the injected transport, in the lean pool's place
(``create_app(settings, transport, make_relay=HttpxRelay)``). Failures are classified by
proxy/upstream.py's ``translate``, as for every other httpx call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx

from proxy.upstream import Upstream, translate


class HttpxReply:
    __slots__ = ("_response", "body", "headers", "status")
    released = False

    def __init__(self, response: httpx.Response, body: bytes) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: Mapping[str, str] = response.headers
        self.body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_raw():
            yield chunk

    async def close(self) -> None:
        await self._response.aclose()


class HttpxRelay:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None  # the shared client belongs to Upstream

    async def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> HttpxReply:
        if not stream:
            response = await self.upstream.call(
                replica, base_url, "POST", path, content=content, headers=headers
            )
            return HttpxReply(response, response.content)
        # Returns as soon as the headers arrive; the data plane streams the body and closes it.
        client = self.upstream.client
        request = client.build_request("POST", base_url + path, content=content, headers=headers)
        try:
            return HttpxReply(await client.send(request, stream=True), b"")
        except httpx.HTTPError as exc:
            raise translate(exc, replica, f"POST {path}") from exc
