"""twistd plugins: `twistd mqd` (the broker), `twistd mqlookupd` (its discovery service), `twistd mqadmin` (the web admin).

No __init__.py lives in twisted/ or twisted/plugins/: on install this file
joins Twisted's own plugin package, which is how twistd finds it.
"""

from twisted.application.service import ServiceMaker

mqd = ServiceMaker(
    "mqd",
    "mqd.nsqd.tap",
    "A message broker that speaks NSQ's protocols (a drop-in nsqd).",
    "mqd",
)

mqlookupd = ServiceMaker(
    "mqlookupd",
    "mqd.lookup.tap",
    "The discovery service brokers register with (a drop-in nsqlookupd).",
    "mqlookupd",
)

mqadmin = ServiceMaker(
    "mqadmin",
    "mqd.admin.tap",
    "The cluster's web admin: pages, charts and nsqadmin's API (a drop-in nsqadmin).",
    "mqadmin",
)
