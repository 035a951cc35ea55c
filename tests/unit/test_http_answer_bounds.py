"""Answers mqd reads from other HTTP servers are read up to a bound, never whole.

An auth server, a lookupd or a broker answering without end (or with a
huge body) costs the reader a bounded amount of memory: past the bound the
answer is an error, as a failed request is, and the connection is dropped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import pytest_twisted
from twisted.internet import task
from twisted.web import resource, server

from mqd.clusterinfo import upstream as upstream_module
from mqd.http import auth
from tests.support.admin_fakes import real_upstream


class _Endless(resource.Resource):
    """Answers with chunks of JSON-looking bytes for as long as it is read (no Content-Length)."""

    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"Content-Type", b"application/json")
        loop = task.LoopingCall(request.write, b"x" * 4096)
        loop.start(0.001)
        request.notifyFinish().addBoth(lambda _: loop.stop())
        return server.NOT_DONE_YET


@pytest.fixture
def endless():
    from twisted.internet import reactor

    port = reactor.listenTCP(0, server.Site(_Endless()), interface="127.0.0.1")
    yield f"127.0.0.1:{port.getHost().port}"
    port.stopListening()


@pytest_twisted.inlineCallbacks
def test_an_auth_server_answering_without_end_fails_the_auth_at_the_bound(monkeypatch, endless):
    monkeypatch.setattr(auth, "AUTH_ANSWER_MAX", 64 * 1024)
    options = SimpleNamespace(auth_http_address=[endless], auth_http_request_method="get",
                              http_client_connect_timeout=2.0, http_client_request_timeout=5.0)
    client = auth.AuthClient(options, clock=None)
    with pytest.raises(auth.AuthError, match="answer larger than 65536 bytes"):
        yield client.fetch(f"http://{endless}/auth", "get", {"secret": "s"})


@pytest_twisted.inlineCallbacks
def test_a_broker_answering_without_end_is_an_upstream_error_at_the_bound(monkeypatch, endless):
    monkeypatch.setattr(upstream_module, "UPSTREAM_ANSWER_MAX", 64 * 1024)
    upstream = real_upstream()
    try:
        with pytest.raises(upstream_module.UpstreamError, match="answer larger than 65536 bytes"):
            yield upstream.get_json(f"http://{endless}/stats?format=json")
    finally:
        yield upstream.close()
