"""The service's users: named bearer tokens, who is an administrator, and device quotas.

The service's own token (``serve`` prints where it is kept) is the administrator's. With
it, ``hybridtrain serve users add NAME`` issues a user a token of their own (shown once;
only its SHA-256 is stored), ``revoke`` takes it back at once. A user's jobs are theirs: a
user lists, reads, cancels and resubmits only their own jobs; an administrator sees all.
A user may have a device quota: their running jobs together hold at most that many devices
(:class:`~hybridtrain.service.devices.Shares`).

Tokens are random 256-bit strings, so a plain hash is as good as a slow one here: nothing
short enough to guess is ever hashed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

import sqlalchemy as sa

from hybridtrain.server.storage import open_with_tables, resolve_url
from hybridtrain.service.errors import JobNotFoundError, JobSpecError
from hybridtrain.service.store import STORAGE_ENVS

METADATA = sa.MetaData()

USERS = sa.Table(
    "hybridtrain_service_users",
    METADATA,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
    sa.Column("admin", sa.Boolean, nullable=False, default=False),
    sa.Column("devices", sa.Integer, nullable=True),  # the quota; NULL: none
    sa.Column("created_at", sa.Float, nullable=False),
)

#: The name jobs submitted with the service's own token are recorded under.
ADMIN_NAME = "admin"
_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class User:
    """Who sent a request.

    Attributes:
        name: the user's name (:data:`ADMIN_NAME` for the service's own token).
        admin: sees and moves every job, issues and revokes tokens.
        devices: the most devices their running jobs may hold together (``None``: no quota).
    """

    name: str
    admin: bool = False
    devices: int | None = None

    def may_see(self, submitter: str | None) -> bool:
        """Whether this user may read and move a job submitted by ``submitter`` (jobs from
        before users existed, with none, are the administrator's)."""
        return self.admin or submitter == self.name


#: The holder of the service's own token.
ADMIN = User(ADMIN_NAME, admin=True)


def check_user_fields(name: str, devices: int | None) -> None:
    """Refuse a bad user name or quota in one line, before anything is written.

    Raises:
        JobSpecError: the name is not lowercase letters, digits, ``_.-`` (a letter first,
            at most 64), or is the administrator's; the quota is not a positive integer.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == ADMIN_NAME:
        raise JobSpecError(f"user name {str(name)[:80]!r}: use lowercase letters, digits and _.- "
                           f"(a letter first, at most 64), not {ADMIN_NAME!r}")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise JobSpecError(f"user field devices = {devices!r}: a quota is a whole number of devices "
                           "of at least 1 (leave it out for no quota)")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class UserStore:
    """Issue, revoke, list and recognise users' tokens in the service's database.

    Args:
        storage: storage URL (the jobs' database; default as :class:`~.store.JobStore`).

    Raises:
        StorageError: the storage cannot be opened.
    """

    def __init__(self, storage: str | None = None) -> None:
        self.url = resolve_url(storage, STORAGE_ENVS)
        self.engine = open_with_tables(self.url, METADATA, "the users table")

    def issue(self, name: str, *, admin: bool = False, devices: int | None = None) -> str:
        """A new token for ``name`` (a new user, or a new token replacing the old one, whose
        requests fail from now on). The token is returned once and never stored.

        Raises:
            JobSpecError: a bad name or quota (see :func:`check_user_fields`).
        """
        check_user_fields(name, devices)
        token = secrets.token_urlsafe(32)
        row = {"token_sha256": _digest(token), "admin": admin, "devices": devices}
        with self.engine.begin() as conn:
            done = conn.execute(USERS.update().where(USERS.c.name == name).values(**row))
            if done.rowcount == 0:
                conn.execute(USERS.insert().values(name=name, created_at=time.time(), **row))
        return token

    def revoke(self, name: str) -> None:
        """Remove ``name`` and their token (their jobs stay, and an administrator sees them).

        Raises:
            JobNotFoundError: no such user.
        """
        with self.engine.begin() as conn:
            if conn.execute(USERS.delete().where(USERS.c.name == name)).rowcount == 0:
                raise JobNotFoundError(f"user {name[:80]!r} not found; `hybridtrain serve users list` "
                                       "shows the users")

    def users(self) -> list[User]:
        """Every user, by name."""
        with self.engine.connect() as conn:
            rows = conn.execute(USERS.select().order_by(USERS.c.name)).all()
        return [User(r.name, bool(r.admin), r.devices) for r in rows]

    def find(self, token: str | None) -> User | None:
        """The user holding ``token``, or ``None``."""
        if not token:
            return None
        with self.engine.connect() as conn:
            row = conn.execute(USERS.select().where(USERS.c.token_sha256 == _digest(token))).first()
        return None if row is None else User(row.name, bool(row.admin), row.devices)

    def quotas(self) -> dict[str, int]:
        """``{user: devices}`` for every user with a quota."""
        return {u.name: u.devices for u in self.users() if u.devices is not None}


#: Paths a user's token opens (everything else, the HPO routes and ``/metrics`` included,
#: takes the administrator's).
USER_PATHS = ("/v1/jobs", "/v1/service", "/jobs")


class Authenticator:
    """Who holds a token: the administrator (the service's own token) or a user.

    Args:
        admin_token: the service's own token.
        users: the users' tokens (``None``: the administrator's token only).
    """

    def __init__(self, admin_token: str, users: UserStore | None = None) -> None:
        self.admin_token, self.users = admin_token, users

    def user(self, token: str | None) -> User | None:
        """The holder of ``token``, or ``None`` for no or an unknown token."""
        if token is not None and hmac.compare_digest(self.admin_token.encode(), token.encode()):
            return ADMIN
        return self.users.find(token) if self.users is not None else None

    def admits(self, path: str, token: str | None) -> bool:
        """Whether a user's ``token`` opens ``path`` (the guards ask this of a token that is
        not the administrator's)."""
        opens = any(path == p or path.startswith(p + "/") for p in USER_PATHS)
        return opens and self.users is not None and self.users.find(token) is not None
