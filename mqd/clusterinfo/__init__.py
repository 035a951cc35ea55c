"""What mqadmin and mq-stat know of a cluster: lookupds' producers and brokers' stats over HTTP.

Shared by the web admin and the tools, as NSQ's clusterinfo package is by nsqadmin and nsq_stat.
"""
