"""TLS for the HTTP server, as vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs and
--ssl-ciphers set it: uvicorn's options of the same names (vLLM 0.34.0, vllm/entrypoints/common/cli_args.py and
launchers/api_server/entry.py). A key needs its certificate and the other way round."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tls:
    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)  # CERT_REQUIRED (2): clients must present a certificate ca_certs signed
    ciphers: str | None = None

    def __post_init__(self) -> None:
        if bool(self.keyfile) != bool(self.certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile: give both or neither")
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
