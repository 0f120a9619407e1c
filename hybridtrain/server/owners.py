"""Who holds a lease: an id unique to one process of one machine.

The HPO controllers' slot leases (:mod:`hybridtrain.hpo.leases`) and the training
service's leader lease (:mod:`hybridtrain.service.store`) record their holder under it, so
a process recognises its own leases and everyone else sees where the holder runs.
"""

from __future__ import annotations

import os
import socket
import uuid


def new_owner_id() -> str:
    """A unique id for one process (a controller, a scheduler): ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
