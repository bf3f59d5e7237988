"""Start and stop baton-router for integration tests (on top of harness.baton_procs).

    from harness.router_procs import start_router
    with start_router(etcd_server, default_model, api_key="k") as r:
        r.base_url        # "http://127.0.0.1:PORT/v1" for the openai client
        r.grpc_addr       # "127.0.0.1:PORT"

Flags given as keyword arguments become command-line flags (max_migrations=3 -> `--max-migrations 3`);
api_key may be a string or a list of strings. Only the standard library is used.
"""
from __future__ import annotations

from typing import Optional, Sequence

from harness.baton_procs import Proc, flag_args, start_proc

__all__ = ["start_router", "router_base_url"]


def router_base_url(proc: Proc) -> str:
    return f"http://{proc.http_addr}/v1"


def start_router(etcd, model, *, api_key=None, extra_args: Sequence[str] = (), env: Optional[dict] = None,
                 timeout: float = 60.0, wait: bool = True, **flags) -> Proc:
    """baton-router on 127.0.0.1 free ports, reading the cluster view from `etcd` (EtcdServer or endpoint)."""
    flags = dict(flags)
    flags.setdefault("grpc_listen", "127.0.0.1:0")
    flags.setdefault("http_listen", "127.0.0.1:0")
    endpoint = etcd if isinstance(etcd, str) else etcd.endpoint
    args = ["--model", str(model), "--etcd", endpoint, *flag_args(flags)]
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    for k in keys:
        args += ["--api-key", k]
    args += list(extra_args)
    p = start_proc("baton-router", args, name="router", env=env, timeout=timeout, wait=wait)
    p.base_url = router_base_url(p)
    return p
