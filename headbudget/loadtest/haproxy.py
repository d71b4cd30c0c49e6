"""haproxy in front of headbudget replicas on this host, as the replica tests and the hostile soak run it.

Round robin over the replicas, /readyz as the health check, and a refused connection retried at once on the other
replica (`option redispatch 1`: every retry may change server). `X-Replica` names the replica that answered. A
request already sent to a replica that dies is not retried by haproxy (a POST may have run): the client sees 502 and
decides.
"""

from __future__ import annotations

from collections.abc import Sequence

TEMPLATE = """\
global
    maxconn 1024
defaults
    mode http
    timeout connect 200ms
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch 1
frontend api
    bind {host}:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 300ms fall 2 rise 2
    http-response set-header X-Replica %[srv_name]
{servers}
"""


def haproxy_config(host: str, port: int, replicas: Sequence[tuple[str, int]]) -> str:
    """The configuration of a front end on ``host:port`` over ``replicas`` (name, port), all on ``host``."""
    servers = "\n".join(f"    server {name} {host}:{p} check" for name, p in replicas)
    return TEMPLATE.format(host=host, port=port, servers=servers)
