"""mqlookupd (the discovery service brokers register with) and the broker's client of it.

registry.py holds who produces what, protocol.py is the TCP protocol
brokers speak to it ("V1"), http.py the HTTP API consumers and admins
query, tap.py the `twistd mqlookupd` plugin.
"""
