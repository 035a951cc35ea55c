"""The transport a stream protocol writes to, as the type checker sees it.

Twisted types `Protocol.transport` as an ITransport, which has neither
abortConnection (ITCPTransport) nor the producer and consumer calls that
a connection's flow control uses; its TCP and TLS transports provide all
of them. A protocol declares `transport: IStreamTransport` to say so.
"""

from __future__ import annotations

from twisted.internet.interfaces import IConsumer, IPushProducer, ITCPTransport

__all__ = ["IStreamTransport"]


class IStreamTransport(ITCPTransport, IConsumer, IPushProducer):
    """A TCP connection's transport, plain or TLS: writes, closes, and flow control.

    For annotations only: nothing declares that it provides it.
    """
