"""A small auth server for the tests, on twisted.web, speaking nsqd's auth protocol.

Run as its own process (the test process's reactor belongs to
pytest-twisted): `python authd_server.py STATE QUERIES` answers `GET /auth`
from the JSON in STATE (`{"answers": {secret: answer}, "slow": [secrets]}`,
read on every request so a test can change it between queries), appends
each query's parameters as a JSON line to QUERIES, and prints its port.
`tests.support.authd.AuthServer` starts and stops it.
"""

from __future__ import annotations

import json
import sys

from twisted.internet import reactor
from twisted.web import resource, server


class Auth(resource.Resource):
    isLeaf = True

    def __init__(self, state: str, queries: str) -> None:
        super().__init__()
        self.state, self.queries = state, queries

    def render_GET(self, request):
        params = {k.decode(): v[0].decode() for k, v in request.args.items()}
        with open(self.queries, "a") as f:
            f.write(json.dumps(params) + "\n")
        with open(self.state) as f:
            state = json.load(f)
        secret = params.get("secret", "")

        def answer():
            found = state["answers"].get(secret)
            if found is None:
                request.setResponseCode(403)
            else:
                request.setHeader(b"Content-Type", b"application/json")
                request.write(json.dumps(found).encode())
            request.finish()

        if secret in state.get("slow", []):
            reactor.callLater(3, answer)
        else:
            answer()
        return server.NOT_DONE_YET


def main(argv: list[str]) -> None:
    state, queries = argv
    site = server.Site(Auth(state, queries))
    site.noisy = False
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    print(port.getHost().port, flush=True)
    reactor.run()


if __name__ == "__main__":
    main(sys.argv[1:])
