"""Tenants from credentials: API keys map each request to a tenant, whose secret salt seeds its namespaces.

The keys file (``--api-keys FILE``, TOML, reloaded when it changes; ``tierkv keys add`` writes it):

    [tenants.acme]
    salt = "3f1c..."                    # the tenant's secret: part of every namespace of its blocks
    keys = ["sha256:9b74...", ...]      # SHA-256 of each API key: the keys themselves are never stored
    disk_quota = "20GiB"                # optional: what eviction leaves the tenant (tenancy.Quota)
    host_quota = "2GiB"                 # optional: the same in the host tier
    pin_quota = "1GiB"                  # optional: the most the tenant may pin

A request's ``Authorization: Bearer KEY`` names its tenant; its ``cache_salt`` only subdivides that
tenant's space (``namespace_salt``). Two tenants never share a block, so no hit, timing or usage field
tells one tenant what another sent. Without a keys file every client shares the space of its
``cache_salt`` (the default, ``""``, is shared by all), as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from tierkv.errors import ConfigError
from tierkv.tenancy import RESERVED, Quota, tenant_id
from tierkv.tenancy import namespace_salt as _namespace_salt
from tierkv.units import parse_size

__all__ = [
    "RESERVED",
    "Tenant",
    "Tenants",
    "add_key",
    "describe",
    "key_hash",
    "namespace_salt",
    "revoke_key",
    "set_quotas",
]

log = logging.getLogger("tierkv.server")

KEY_PREFIX = "tk-"  # keys tierkv makes: recognisable in logs and secret scanners


QUOTA_FIELDS = {"disk_quota": "disk_nbytes", "host_quota": "host_nbytes", "pin_quota": "pin_nbytes"}


@dataclass(frozen=True)
class Tenant:
    name: str
    salt: str
    quota: Quota | None = None  # None: no quota configured (eviction takes from it first)

    @property
    def id(self) -> bytes:
        """The id the store sees in its namespaces (``tenancy.tenant_id``)."""
        tid = tenant_id(namespace_salt(self, ""))
        assert tid is not None
        return tid


def key_hash(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def namespace_salt(tenant: Tenant | None, cache_salt: str) -> str:
    """The namespace salt of a request: derived from its tenant's secret, then its own ``cache_salt``
    (``tenancy.namespace_salt``)."""
    return _namespace_salt(None if tenant is None else tenant.salt, cache_salt)


def _quota(path: Path, name: str, t: dict[str, object]) -> Quota | None:
    sizes: dict[str, int] = {}
    for field, attr in QUOTA_FIELDS.items():
        if field in t:
            value = t[field]
            try:
                if not isinstance(value, (str, int)) or isinstance(value, bool):
                    raise ValueError(value)
                sizes[attr] = parse_size(value)
                if sizes[attr] < 0:
                    raise ValueError(value)
            except (ValueError, ConfigError):
                raise ConfigError(
                    f'api keys file {path}: tenant {name!r}: {field} must be a size such as "20GiB", '
                    f"got {value!r}"
                ) from None
    return Quota(name, **sizes) if sizes else None


def _load(path: Path) -> dict[str, Tenant]:
    """key hash -> tenant, from the keys file; ConfigError naming what is wrong."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"api keys file {path}: {exc}") from None
    tenants = data.get("tenants")
    if not isinstance(tenants, dict):
        raise ConfigError(f"api keys file {path}: no [tenants.NAME] tables")
    by_hash: dict[str, Tenant] = {}
    salts: set[str] = set()
    for name, t in tenants.items():
        salt, keys = (t.get("salt"), t.get("keys")) if isinstance(t, dict) else (None, None)
        if not isinstance(salt, str) or len(salt) < 16 or "\x1f" in salt:
            raise ConfigError(f"api keys file {path}: tenant {name!r} needs a salt of 16 characters or more")
        if not isinstance(keys, list) or not all(
            isinstance(k, str) and k.startswith("sha256:") for k in keys
        ):
            raise ConfigError(
                f"api keys file {path}: tenant {name!r}: keys must be a list of 'sha256:...' hashes"
            )
        if salt in salts:  # two tenants with one salt would share one cache space
            raise ConfigError(f"api keys file {path}: tenant {name!r} has another tenant's salt")
        salts.add(salt)
        for k in keys:
            if k in by_hash:
                raise ConfigError(f"api keys file {path}: one key hash is listed for two tenants")
            by_hash[k] = Tenant(name, salt, _quota(path, name, t))
    return by_hash


class Tenants:
    """The keys file, reloaded when it changes (its size or modification time); a file that no longer
    parses keeps the last good table, and says so once."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_quotas: Callable[[dict[bytes, Quota]], None] | None = None,
    ) -> None:
        """``on_quotas``: told the tenants' quotas now and after every reload (the store evicts by them)."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._telling_lock = threading.Lock()
        self._stamp = self._stat()
        self._by_hash = _load(self.path)  # at start: an error stops the server
        self._on_quotas = on_quotas
        self._telling = False  # a thread is telling on_quotas (under _lock)
        self._untold: dict[bytes, Quota] | None = None  # what it is to tell next (the latest wins)
        log.info("api keys: %d keys of %d tenants from %s", len(self._by_hash), len(self.names()), self.path)
        self._warn_mode()
        if on_quotas is not None:
            self._tell(self.quotas())  # at start, before the first request

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def _warn_mode(self) -> None:
        with contextlib.suppress(OSError):
            if self.path.stat().st_mode & 0o077:
                log.warning(
                    "api keys file %s can be read or written by other users (chmod 600 it)", self.path
                )

    def names(self) -> set[str]:
        return {t.name for t in self._by_hash.values()}

    def quotas(self) -> dict[bytes, Quota]:
        """Every tenant's quotas by the id the store sees (a tenant without any: a Quota of its name
        alone, so that stats and metrics can name it)."""
        return {t.id: t.quota or Quota(t.name) for t in self._by_hash.values()}

    def _tell(self, quotas: dict[bytes, Quota]) -> None:
        assert self._on_quotas is not None
        try:
            self._on_quotas(quotas)
        except Exception:  # a store that cannot take them now (a full disk, say): the keys still work
            log.exception("api keys: the tenants' quotas were not stored")

    def _tell_later(self) -> None:
        """Tell ``on_quotas`` on a thread of its own, one at a time, the latest quotas winning: a reload
        happens inside a request, and storing quotas waits for the index's write lock (never on the
        server's event loop)."""
        if self._on_quotas is None:
            return
        with self._telling_lock:
            self._untold = self.quotas()
            if self._telling:
                return
            self._telling = True
        threading.Thread(target=self._telling_loop, name="tierkv-quotas", daemon=True).start()

    def _telling_loop(self) -> None:
        while True:
            with self._telling_lock:
                quotas, self._untold = self._untold, None
                if quotas is None:
                    self._telling = False
                    return
            self._tell(quotas)

    def refresh(self) -> None:
        """Reload the file if it changed (a request does this too; a server also looks every few s)."""
        self._reload()

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization`` header's bearer key; None for none or an unknown one."""
        self._reload()
        if not authorization or not authorization.startswith("Bearer "):
            return None
        wanted = key_hash(authorization[len("Bearer ") :].strip())
        found = None
        for h, t in self._by_hash.items():  # constant time per entry: no early exit on a match
            if hmac.compare_digest(h, wanted):
                found = t
        return found

    def _reload(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp
            if stamp is None:  # removed: no key is valid (a revocation must not leave the old ones working)
                self._by_hash = {}
                log.error("api keys: %s is gone: every request is refused until it is back", self.path)
                return
            try:
                self._by_hash = _load(self.path)
                log.info(
                    "api keys: reloaded %s (%d keys of %d tenants; quotas: %s)",
                    self.path,
                    len(self._by_hash),
                    len(self.names()),
                    _describe_quotas(self.quotas()),
                )
                self._warn_mode()
                self._tell_later()
            except ConfigError as exc:
                log.error("%s; the previous keys stay in use", exc)


def add_key(path: str | os.PathLike[str], tenant: str) -> str:
    """Make a new API key for ``tenant`` (the tenant too, with a new secret salt, if it is new) and store
    its hash in the keys file (``_rewrite``). Returns the key: shown once, never stored."""
    key = KEY_PREFIX + secrets.token_hex(24)

    def change(tenants: dict[str, Any]) -> None:
        entry = tenants.setdefault(tenant, {"salt": secrets.token_hex(32), "keys": []})
        entry["keys"] = [*entry.get("keys", []), key_hash(key)]

    _rewrite(Path(path), tenant, change)
    return key


def _describe_quotas(quotas: dict[bytes, Quota]) -> str:
    from tierkv.units import format_size

    parts = []
    for q in sorted(quotas.values(), key=lambda q: q.name):
        sizes = [
            f"{what} {format_size(n)}"
            for what, n in (("disk", q.disk_nbytes), ("host", q.host_nbytes), ("pin", q.pin_nbytes))
            if n is not None
        ]
        if sizes:
            parts.append(f"{q.name} {', '.join(sizes)}")
    return "; ".join(parts) or "none"


def revoke_key(path: str | os.PathLike[str], key: str) -> str:
    """Remove an API key from the keys file (a running server refuses it within seconds); returns its
    tenant's name. ConfigError if no tenant has it."""
    wanted = key_hash(key.strip())
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{path} does not exist")
    owner = next((t.name for h, t in _load(p).items() if hmac.compare_digest(h, wanted)), None)
    if owner is None:
        raise ConfigError(f"no tenant in {path} has this key")

    def change(tenants: dict[str, Any]) -> None:
        tenants[owner]["keys"] = [k for k in tenants[owner]["keys"] if k != wanted]

    _rewrite(p, owner, change)
    return owner


def describe(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Each tenant of the keys file: its name, how many keys, its quotas (never a salt or a hash)."""
    data = tomllib.loads(Path(path).read_text())
    _load(Path(path))
    return [
        {"tenant": name, "keys": len(t.get("keys", [])), **{f: t.get(f) for f in QUOTA_FIELDS}}
        for name, t in data.get("tenants", {}).items()
    ]


def set_quotas(path: str | os.PathLike[str], tenant: str, quotas: dict[str, str | None]) -> None:
    """Set (a size) or remove (None) an existing tenant's ``disk_quota``, ``host_quota``, ``pin_quota``."""
    unknown = set(quotas) - set(QUOTA_FIELDS)
    if unknown:
        raise ConfigError(f"unknown quotas {sorted(unknown)}: expected {sorted(QUOTA_FIELDS)}")
    for field, size in quotas.items():
        if size is not None:
            try:
                if parse_size(size) < 0:
                    raise ConfigError(size)
            except ConfigError:
                raise ConfigError(
                    f"--{field.split('_')[0]}: {size!r} is not a size such as 20GiB (or none)"
                ) from None
    if not Path(path).exists():
        raise ConfigError(f"{path} does not exist: `tierkv keys add {tenant} --file {path}` creates it")

    def change(tenants: dict[str, Any]) -> None:
        if tenant not in tenants:
            raise ConfigError(
                f"no tenant {tenant!r} in {path}: `tierkv keys add {tenant} --file {path}` makes it"
            )
        for field, size in quotas.items():
            if size is None:
                tenants[tenant].pop(field, None)
            else:
                tenants[tenant][field] = size

    _rewrite(Path(path), tenant, change)


def _rewrite(p: Path, tenant: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the keys file's tenants: under a lock (concurrent runs lose nothing), written
    whole to a new private temporary file, checked, then renamed over the file (which keeps its mode;
    0600 when new) and the directory synced."""
    if not tenant or not all(c.isascii() and (c.isalnum() or c in "-_") for c in tenant):
        raise ConfigError(f"tenant names are letters, digits, '-' and '_': got {tenant!r}")
    if not p.parent.is_dir():
        raise ConfigError(f"{p.parent} is not a directory (for the keys file {p})")
    lock_fd = os.open(p.with_name(p.name + ".lock"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(lock_fd, "a") as lock:  # (beside the file: it serialises writers of the file)
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = tomllib.loads(p.read_text()) if p.exists() else {}
        if p.exists():
            _load(p)  # a file that does not parse is not rewritten
        tenants = data.setdefault("tenants", {})
        change(tenants)
        lines = []
        for name, t in tenants.items():  # every string a TOML basic string: JSON's quoting is valid TOML
            lines.append(f"[tenants.{json.dumps(name)}]")
            lines.append(f"salt = {json.dumps(t['salt'])}")
            lines.append("keys = [" + ", ".join(json.dumps(k) for k in t["keys"]) + "]")
            lines.extend(f"{field} = {json.dumps(t[field])}" for field in QUOTA_FIELDS if field in t)
            lines.append("")
        mode = stat.S_IMODE(p.stat().st_mode) if p.exists() else 0o600
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(lines))
                f.flush()
                os.fsync(f.fileno())
            try:
                _load(Path(tmp))  # what was written parses, before it replaces anything
            except ConfigError as exc:  # named after the file the user gave, not the temporary one
                raise ConfigError(str(exc).replace(tmp, str(p))) from None
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
