"""A collective that failed because another rank died or stalled, told apart from other
errors by the words gloo, NCCL and the TCP store use, and named as one line
(:func:`peer_failure`). The launched rank (``parallel/worker.py``) records it for the
launcher; the CLI's error vocabulary (``errors.py``) words it for the user."""

from __future__ import annotations

from hybridtrain.parallel.mesh import stalled_ranks

_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe",
              "connectFullMesh failed")
"""Words of gloo/NCCL/TCPStore errors that mean another rank is gone."""
_TIMED_OUT = ("Timed out waiting", "timed out", "Timeout", "watchdog")


class PeerFailure(RuntimeError):
    """A collective failed because another rank died or stalled; the message names them."""


def peer_failure(exc: BaseException, timeout_s: float | None = None) -> PeerFailure | None:
    """``exc`` as a :class:`PeerFailure` when a collective failed because another rank died
    (connection reset/refused) or stalled (timed out after ``timeout_s``); else None."""
    if not isinstance(exc, RuntimeError):
        return None
    text = " ".join(str(exc).split())
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    lost = any(word in text for word in _PEER_LOST)
    timed_out = any(word in text for word in _TIMED_OUT)
    if not (lost or timed_out or kinds & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}):
        return None
    if "DistStoreError" in kinds:  # the ranks never met (rendezvous), no collective involved
        return PeerFailure(f"the ranks could not meet in the rendezvous store ({text[:200]}); check that every "
                           "rank was started and can reach MASTER_ADDR:MASTER_PORT")
    if timed_out and not lost:
        stalled = stalled_ranks()
        who = (f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))} never reached it"
               if stalled else "every rank was waiting (collectives called in a different order?)")
        within = f" within distributed.timeout_s = {timeout_s:g} s" if timeout_s is not None else ""
        return PeerFailure(f"a collective did not finish{within}: {who}; raise distributed.timeout_s "
                           "if that rank is only slow")
    return PeerFailure(f"lost contact with another rank in a collective ({text[:160]}); the launcher "
                       "names the rank that failed first")
