"""mqadmin and the mq-* tools as processes, against a lookupd and broker with `--http-auth-required`.

The lookupd and broker are tests/support/guarded_http.py's `GuardedNode`
(one port; only the secret `good` is let in, `limited` is 403), so what
is checked is the callers' side: the secret each sends, and how a 401 or
403 is shown (mqadmin: its status and a message naming the node; a tool:
one line, exit 1). The last test runs mqadmin with its own secret against
a real broker whose peek asks an auth server, end to end.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.support.admin import AdminProcess
from tests.support.cli_tools import TIMEOUT, tool
from tests.support.guarded_http import GuardedNode
from tests.support.processes import NO_PROXY, child_env

pytestmark = pytest.mark.slow


@pytest.fixture
def guarded():
    node = GuardedNode()
    yield node
    node.close()


def get(admin: AdminProcess, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET to mqadmin."""
    request = urllib.request.Request(admin.url(path), headers=headers or {})
    try:
        with NO_PROXY.open(request, timeout=15) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


# -- mqadmin ----------------------------------------------------------------------------------------


def test_mqadmin_without_a_secret_shows_the_refusal_naming_the_lookupd(guarded, start_admin):
    admin = start_admin(f"--lookupd-http-address={guarded.address}")
    status, body, headers = get(admin, "api/topics")
    assert status == 401, body
    assert body["message"] == ("UPSTREAM_ERROR: failed to query any nsqlookupd: "
                               f"nsqlookupd {guarded.address}: got response 401 Unauthorized "
                               '"{\\"message\\":\\"AUTH_REQUIRED\\"}"')
    assert headers.get("WWW-Authenticate") == "Bearer"


@pytest.mark.parametrize("how", ["flag", "file"])
def test_mqadmin_sends_its_secret_to_lookupds_and_brokers(guarded, start_admin, tmp_path, how):
    if how == "flag":
        option = "--http-client-auth-secret=good"
    else:
        (tmp_path / "secret").write_text("good\n")
        option = f"--http-client-auth-secret-file={tmp_path / 'secret'}"
    admin = start_admin(f"--lookupd-http-address={guarded.address}", option)
    status, body, _ = get(admin, "api/topics/t/c")
    assert status == 200, body
    assert body["depth"] == 3 and body["message"] == ""
    assert set(guarded.authorizations("/lookup")) == {"Bearer good"}
    assert set(guarded.authorizations("/stats")) == {"Bearer good"}
    assert "good" not in admin.log()


def test_a_users_bearer_from_the_proxy_replaces_mqadmins_secret(guarded, start_admin):
    admin = start_admin(f"--lookupd-http-address={guarded.address}", "--http-client-auth-secret=good")
    status, body, headers = get(admin, "api/nodes", {"Authorization": "Bearer limited"})
    assert status == 403, body
    assert f"nsqlookupd {guarded.address}: got response 403 Forbidden" in body["message"]
    assert "WWW-Authenticate" not in headers
    assert guarded.authorizations("/nodes")[-1] == "Bearer limited"
    # Without the user's header, mqadmin's own.
    status, body, _ = get(admin, "api/nodes")
    assert status == 200 and body["nodes"][0]["http_port"] == guarded.port


# -- the tools --------------------------------------------------------------------------------------


def run(name: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
    environment = {**child_env(), **(env or {})}
    if env is None:
        environment.pop("MQ_HTTP_AUTH_SECRET", None)
    proc = subprocess.run(tool(name, *args), capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                          env=environment)
    err = proc.stderr.decode()
    assert "Traceback" not in err and "Unhandled" not in err, err
    return proc.returncode, proc.stdout.decode(), err.splitlines()


def fatal(lines: list[str]) -> str:
    """The tool's one error line (its log's info lines, stopping the consumers, may follow it)."""
    [line] = [line for line in lines if line.startswith("ERROR: ")]
    return line


@pytest.mark.parametrize(("secret", "env", "last"), [
    ((), None, "401 Unauthorized (AUTH_REQUIRED): it requires a secret (--http-auth-secret)"),
    (("--http-auth-secret=wrong",), None, "401 Unauthorized (AUTH_FAILED): the auth server refused the secret"),
    ((), {"MQ_HTTP_AUTH_SECRET": "limited"}, "403 Forbidden (UNAUTHORIZED): the secret has no grant for this request"),
])
def test_mq_stat_ends_with_one_line_on_a_refusal(guarded, secret, env, last):
    code, out, lines = run("stat", "--topic=t", "--channel=c", f"--lookupd-http-address={guarded.address}",
                           *secret, env=env)
    assert code == 1 and out == ""
    assert lines == [f"ERROR: nsqlookupd {guarded.address} answered {last}"]


def test_mq_stat_sends_its_secret_to_the_lookupd_and_the_brokers(guarded):
    code, out, lines = run("stat", "--topic=t", "--channel=c", f"--lookupd-http-address={guarded.address}",
                           "--http-auth-secret=good", "--count=1", "--interval=50ms")
    assert code == 0, lines
    assert out.splitlines()[-1].split()[3] == "3"  # the depth, summed (after "ingress egress |")
    assert set(guarded.authorizations("/lookup")) == {"Bearer good"}
    assert set(guarded.authorizations("/stats")) == {"Bearer good"}


def test_mq_tail_ends_with_one_line_when_lookupd_refuses(guarded):
    code, _, lines = run("tail", "--topic=t", f"--lookupd-http-address={guarded.address}",
                         "--http-auth-secret=wrong")
    assert code == 1
    assert fatal(lines) == (f"ERROR: nsqlookupd {guarded.address} answered 401 Unauthorized (AUTH_FAILED): "
                            "the auth server refused the secret")
    assert guarded.authorizations("/lookup")[0] == "Bearer wrong"


@pytest.mark.parametrize("topics", [("--topic-pattern=.",), ("--topic=t",)])
def test_mq_to_file_ends_with_one_line_when_lookupd_refuses(guarded, tmp_path, topics):
    code, _, lines = run("to_file", *topics, f"--lookupd-http-address={guarded.address}",
                         f"--output-dir={tmp_path}", env={"MQ_HTTP_AUTH_SECRET": "limited"})
    assert code == 1
    assert fatal(lines) == (f"ERROR: nsqlookupd {guarded.address} answered 403 Forbidden (UNAUTHORIZED): "
                            "the secret has no grant for this request")
    assert {auth for path, auth in guarded.seen if path in ("/topics", "/lookup")} == {"Bearer limited"}


# -- end to end: a real broker's peek asks the auth server ------------------------------------------


def test_mqadmin_peeks_with_its_own_secret_at_a_broker_with_auth(tmp_path, start_broker, start_admin):
    from tests.support.authd import SUBSCRIBE, AuthServer, grant

    authd = AuthServer(tmp_path)
    authd.answers["good"] = grant(SUBSCRIBE)
    try:
        broker = start_broker(f"--auth-http-address={authd.address}", "--broadcast-address=127.0.0.1")
        http = broker.http_address
        assert broker.post("/topic/create?topic=t") == 200
        assert broker.post("/channel/create?topic=t&channel=c") == 200
        request = urllib.request.Request(f"http://{http}/pub?topic=t", data=b"hello", method="POST")
        NO_PROXY.open(request, timeout=5).close()
        plain = start_admin(f"--nsqd-http-address={http}")
        status, body, _ = get(plain, "api/peek/t/c")
        assert status == 401 and body == {"message": "AUTH_REQUIRED"}
        admin = start_admin(f"--nsqd-http-address={http}", "--http-client-auth-secret=good")
        status, body, _ = get(admin, "api/peek/t/c")
        assert status == 200, body
        assert [m["body_text"] for n in body["nodes"] for m in n["messages"]] == ["hello"]
    finally:
        authd.close()
