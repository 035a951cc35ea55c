"""mqadmin: the cluster's web admin (nsqadmin's role) over mqlookupd / mqd, or nsqlookupd / nsqd.

`twistd mqadmin` serves nsqadmin's JSON API (same paths and field names,
so scripts written against nsqadmin keep working), the pages built on it
(static files, no build step), live charts from its own polling of the
brokers' /stats (no graphite), and what nsqadmin cannot do: peek at
messages, take snapshots, show durable mode and store health.

Modules: tap (options, service tree), web (site, routing, base path,
static pages), endpoint (the API's base class and the shared context),
upstream (HTTP to lookupds and brokers, treq), cluster (who produces what,
whose /stats), aggregate (sums across producers, nsqadmin's shapes), api
(GET endpoints), actions (POST/DELETE, fan-out, notifications),
history (polling, bounded series, rates) and static/ (the pages).
"""
