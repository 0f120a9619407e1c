"""``hybridtrain hpo serve``: the REST API and the dashboard in one uvicorn server."""

from __future__ import annotations

import sys
from pathlib import Path

from hybridtrain.server.auth import TOKEN_ENV, resolve_token
from hybridtrain.server.listen import check_host, check_port, is_loopback


def serve(host: str = "127.0.0.1", port: int = 8080, storage: str | None = None,
          token_file: Path | None = None, metrics_public: bool = False) -> int:
    """Serve until interrupted.

    Args:
        host: bind address; loopback unless told otherwise.
        port: TCP port.
        storage: storage URL of the experiments.
        token_file: where the bearer token lives (see :mod:`hybridtrain.server.auth`).
        metrics_public: serve ``/metrics`` without the token.

    Returns:
        The exit code (0).

    Raises:
        ServerError: bad token, storage or port.
    """
    import uvicorn

    from hybridtrain.hpo.api import create_app
    from hybridtrain.server.slow_clients import guarded_protocol

    check_port(port)
    check_host(host)
    from hybridtrain.hpo.experiments import ExperimentStore

    token, created = resolve_token(token_file)
    store = ExperimentStore(storage)
    app = create_app(store, token, metrics_public=metrics_public)
    if created:
        print(f"generated API token (saved; set ${TOKEN_ENV} to override): {token}", flush=True)
    if not is_loopback(host):
        print(f"warning: binding {host}: trial commands run on this machine; anyone who "
              "has the token can start them", file=sys.stderr)
    base = f"http://{host}:{port}"
    print(f"REST API:  {base}/v1/experiments  (schema: {base}/openapi.json)\n"
          f"dashboard: {base}/dashboard?token=<token>\n"
          f"metrics:   {base}/metrics  "
          f"({'no token needed' if metrics_public else 'bearer token needed'})", flush=True)
    # Slow or greedy clients are cut off (hybridtrain.server.slow_clients): no unauthenticated
    # client can hold the server's connections.
    uvicorn.run(app, host=host, port=port, log_level="warning", http=guarded_protocol())
    return 0
