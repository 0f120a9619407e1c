"""optuna-dashboard, served by ``hpo serve`` next to the REST API on the same port.

The dashboard is a WSGI app whose routes (``/dashboard``, ``/api/…``, ``/static/…``) do
not collide with ours (``/v1/…``), so it is mounted at the root behind the token guard.
Open ``http://HOST:PORT/dashboard?token=TOKEN`` once in a browser to log in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridtrain.server.auth import ASGIApp, TokenGuard

if TYPE_CHECKING:
    import optuna


def dashboard_app(storage: optuna.storages.BaseStorage, token: str) -> ASGIApp:
    """The token-protected dashboard as an ASGI app.

    Args:
        storage: the experiments' Optuna storage (studies appear live).
        token: the bearer token requests must carry.

    Returns:
        An ASGI application to mount at ``/``.
    """
    import warnings

    import optuna_dashboard

    with warnings.catch_warnings():
        # Starlette deprecates its WSGI bridge in favour of a2wsgi; it still works, and
        # one fewer dependency is worth more here.
        warnings.simplefilter("ignore")
        from starlette.middleware.wsgi import WSGIMiddleware

        wsgi = WSGIMiddleware(optuna_dashboard.wsgi(storage))
    return TokenGuard(wsgi, token)
