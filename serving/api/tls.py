"""TLS for the HTTP server, as vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs and
--ssl-ciphers set it: uvicorn's options of the same names (vLLM 0.34.0, vllm/entrypoints/common/cli_args.py and
launchers/api_server/entry.py). A key needs its certificate and the other way round.

--enable-ssl-refresh (vLLM's, launchers/utils/ssl.py there): the live context reloads the key and certificate, or
the CA certificates, when their files change (`CertRefresher`, polling their size and modification time), so that
a rotated certificate serves new connections without a restart. A change that does not load (a rotation half
written) keeps the context as it was and is tried again at the next change."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
CERT_POLL_S = 1.0  # how often --enable-ssl-refresh looks at the files


@dataclass(frozen=True)
class Tls:
    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)  # CERT_REQUIRED (2): clients must present a certificate ca_certs signed
    ciphers: str | None = None
    refresh: bool = False  # --enable-ssl-refresh

    def __post_init__(self) -> None:
        if bool(self.keyfile) != bool(self.certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile: give both or neither")
        if self.refresh and not self.keyfile:
            raise ValueError("--enable-ssl-refresh: needs --ssl-keyfile and --ssl-certfile (nothing to refresh "
                             "without them)")
        if self.cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs: expected 0, 1 or 2 (ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED), got "
                             f"{self.cert_reqs}")

    def check_files(self) -> None:
        """Load the key, its certificate and the CA certificates once, so that a bad file fails the start before the
        ranks load the model, not when the server binds (ValueError naming the flag)."""
        if not self.keyfile:
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-keyfile / --ssl-certfile: cannot load {self.keyfile!r} with {self.certfile!r}: "
                             f"{e}") from None
        if self.ca_certs:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--ssl-ca-certs: cannot load {self.ca_certs!r}: {e}") from None

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's keyword arguments for this (none without a key)."""
        if not self.keyfile:
            return {}
        options: dict[str, Any] = {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile,
                                   "ssl_ca_certs": self.ca_certs, "ssl_cert_reqs": self.cert_reqs}
        if self.ciphers:
            options["ssl_ciphers"] = self.ciphers
        return options


class CertRefresher:
    """Reloads `context` (the server's, live) from tls's files when they change: load_cert_chain for the key and
    certificate, load_verify_locations for the CA certificates. Run `watch` as a task of the server's event loop,
    the thread that makes connections from the context."""

    def __init__(self, tls: Tls, context: ssl.SSLContext) -> None:
        self.tls, self.context = tls, context
        self._chain = _stamp(tls.keyfile, tls.certfile)
        self._ca = _stamp(tls.ca_certs)

    async def watch(self) -> None:
        """Poll until cancelled; an unexpected error is logged and polling goes on (the task never ends early)."""
        while True:
            await asyncio.sleep(CERT_POLL_S)
            try:
                self.poll()
            except Exception:
                log.exception("--enable-ssl-refresh: looking at the certificate files failed; trying again")

    def poll(self) -> None:
        """Reload what changed since the last load (or the last failed try)."""
        chain = _stamp(self.tls.keyfile, self.tls.certfile)
        if chain != self._chain:
            self._chain = chain
            self._load("--ssl-keyfile / --ssl-certfile", self.context.load_cert_chain, self.tls.certfile,
                       self.tls.keyfile)
        if self.tls.ca_certs:
            ca = _stamp(self.tls.ca_certs)
            if ca != self._ca:
                self._ca = ca
                self._load("--ssl-ca-certs", self.context.load_verify_locations, self.tls.ca_certs)

    @staticmethod
    def _load(flags: str, load: Any, *paths: str | None) -> None:
        try:
            load(*paths)
        except (OSError, ssl.SSLError) as e:
            log.warning("%s changed but does not load (%s); serving the previous one until they change again", flags,
                        e)
        else:
            log.info("%s reloaded", flags)


def _stamp(*paths: str | None) -> tuple:
    """What tells a change of these files: each one's size and modification time (None: missing)."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        stamps.append(None if st is None else (st.st_size, st.st_mtime_ns))
    return tuple(stamps)
