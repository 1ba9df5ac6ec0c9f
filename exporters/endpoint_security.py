"""What the metrics endpoint enforces: TLS, client certificates and basic auth.

Read from a web configuration file in the Prometheus exporter-toolkit format (``HPAR_WEB_CONFIG``,
the file Prometheus itself takes with ``--web.config.file`` and ``promtool check web-config``
validates), or from the ``HPAR_TLS_CERT``/``HPAR_TLS_KEY`` shorthand. Security fails closed: anything
asked for but not fully and validly configured raises ``WebConfigError`` naming the problem, and the
endpoint then serves nothing, never plain HTTP in its place. Where the toolkit would quietly serve
less than the file suggests, this is stricter (docs/configuration.md, "Securing the endpoint").
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpar_agent.config import AgentConfig, near_misses, valid_host
from hpar_agent.safefiles import NotRegularError, open_regular, read_regular

#: The settings that secure the endpoint (field -> variable): set but empty, or misspelt, they close it.
SECURITY_ENV = {"web_config": "HPAR_WEB_CONFIG", "tls_cert": "HPAR_TLS_CERT", "tls_key": "HPAR_TLS_KEY"}
#: Names an unknown ``HPAR_*`` variable must not be a misspelling of (the address too: a misspelt
#: HPAR_METRICS_ADDR=127.0.0.1 would serve every interface).
NEAR_MISS_ENV = (*SECURITY_ENV.values(), "HPAR_METRICS_ADDR")
#: The exporter-toolkit keys this endpoint implements.
TOP_KEYS = ("tls_server_config", "basic_auth_users")
TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")
#: Toolkit keys it does not implement: refused by name rather than ignored.
UNSUPPORTED_KEYS = {
    "http_server_config",
    "rate_limit",
    "cert",
    "key",
    "client_ca",
    "cipher_suites",
    "curve_preferences",
    "prefer_server_cipher_suites",
    "client_allowed_sans",
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: client_auth_type -> (verify mode, whether a client CA is needed). RequestClientCert asks for a
#: certificate and checks none: for access it is NoClientCert.
CLIENT_AUTH = {
    "NoClientCert": (ssl.CERT_NONE, False),
    "RequestClientCert": (ssl.CERT_NONE, False),
    "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
    "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True),
}
#: Any certificate accepted unverified: Python's ssl cannot ask for one without verifying it, and it
#: authenticates no one.
UNVERIFIED_CLIENT_AUTH = ("RequireAnyClientCert", "RequireClientCert")
_BCRYPT = re.compile(r"^\$2[abxy]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
_MAX_FILE_BYTES = 1 << 20


class WebConfigError(ValueError):
    """TLS or authentication asked for but not fully and validly configured: serve nothing."""


@dataclass(frozen=True)
class Security:
    """What the endpoint enforces; the default is plain HTTP with no authentication."""

    tls: ssl.SSLContext | None = None
    client_certs: str = ""
    """``required``, ``optional`` (verified when given) or empty (not asked for)."""
    users: Mapping[str, bytes] = field(default_factory=dict)
    """Basic-auth user -> bcrypt hash."""

    @property
    def authenticates(self) -> bool:
        """Whether every client must prove who it is (a password or a verified certificate)."""
        return bool(self.users) or self.client_certs == "required"

    def describe(self) -> str:
        parts = ["TLS" if self.tls is not None else "plain HTTP"]
        if self.client_certs:
            parts.append(
                f"client certificates {'required' if self.client_certs == 'required' else 'verified if given'}"
            )
        if self.users:
            parts.append(f"basic auth ({len(self.users)} user{'s' if len(self.users) > 1 else ''})")
        if not self.authenticates:
            parts.append("no authentication")
        return ", ".join(parts)


def load_security(config: AgentConfig, environ: Mapping[str, str] | None = None) -> Security:
    """The endpoint's security from ``config``; raises ``WebConfigError`` naming what is wrong: a
    setting set but empty, or an unknown ``HPAR_*`` name in ``environ`` (default ``os.environ``) that
    reads as a misspelt security setting, closes the endpoint rather than leaving it open."""
    env = os.environ if environ is None else environ
    misses = near_misses(env, NEAR_MISS_ENV)
    if misses:
        raise WebConfigError(
            "; ".join(f"{name} is not a setting: did you mean {meant}?" for name, meant in misses)
            + " (the endpoint serves nothing until it is renamed or unset)"
        )
    addr = env.get("HPAR_METRICS_ADDR")
    if addr is not None and not valid_host(addr):  # the loader would fall back to every interface
        raise WebConfigError(
            f"HPAR_METRICS_ADDR={addr!r} is not an IP address or a host name (the endpoint serves nothing "
            "rather than on every interface)"
        )
    for field_name, env_name in SECURITY_ENV.items():
        value = getattr(config, field_name)
        if value is not None and not value.strip():
            raise WebConfigError(
                f"{env_name} is set but empty (name a file, or unset {env_name} to serve without it)"
            )
    web, cert, key = config.web_config, config.tls_cert, config.tls_key
    if web and (cert or key):
        raise WebConfigError("set HPAR_WEB_CONFIG or HPAR_TLS_CERT/HPAR_TLS_KEY, not both")
    if web:
        return _from_file(web)
    if cert or key:
        if not (cert and key):
            given, missing = ("HPAR_TLS_CERT", "HPAR_TLS_KEY") if cert else ("HPAR_TLS_KEY", "HPAR_TLS_CERT")
            raise WebConfigError(f"{given} is set without {missing}: TLS needs both")
        return Security(tls=_context(cert, key, "HPAR_TLS_CERT", "HPAR_TLS_KEY"))
    return Security()


def exposure(host: str, port: int, security: Security) -> str | None:
    """What anyone on the network gets from an endpoint bound to ``host`` (an IP address), or None when
    the endpoint is loopback-only, or authenticated and encrypted."""
    ip = ipaddress.ip_address(host.strip("[]"))
    if ip.is_loopback:
        return None
    where = "all interfaces" if ip.is_unspecified else str(ip)
    shown = f"[{ip}]" if ip.version == 6 else str(ip)
    if not security.authenticates:
        how = "over TLS" if security.tls is not None else "in clear text"
        return (
            f"the metrics endpoint {shown}:{port} ({where}) serves this rank's metrics to anyone who can "
            f"reach it, {how} and without authentication"
        )
    if security.tls is None:
        return (
            f"the metrics endpoint {shown}:{port} ({where}) takes basic-auth passwords in clear text (no TLS)"
        )
    return None


# --------------------------------------------------------------------------------- the web config
def _duplicate_key(node: Any) -> str | None:
    """The first key that appears twice in one mapping of a composed YAML document: the toolkit's
    strict decoding refuses them, and a second ``basic_auth_users`` must not silently replace the first."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        keys = [str(k.value) for k, _ in node.value]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        children = [v for _, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        dup, children = None, node.value
    else:
        return None
    return dup or next((d for c in children if (d := _duplicate_key(c))), None)


def _from_file(path: str) -> Security:
    import yaml

    text = _read(path, "HPAR_WEB_CONFIG")
    where = f"HPAR_WEB_CONFIG {path!r}"
    try:
        dup = _duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WebConfigError(f"{where} is not valid YAML: {exc}") from None
    if dup is not None:
        raise WebConfigError(f"{where}: key {dup!r} appears twice")
    if doc is None or doc == {}:
        raise WebConfigError(
            f"{where} is empty: it configures neither TLS nor authentication "
            "(unset HPAR_WEB_CONFIG to serve plain HTTP)"
        )
    if not isinstance(doc, dict):
        raise WebConfigError(f"{where} must be a mapping of {', '.join(TOP_KEYS)}")
    _known_keys(doc, TOP_KEYS, where, "")
    base = os.path.dirname(os.path.abspath(path))  # relative paths are the file's, as in the toolkit
    tls, client_certs = None, ""
    if "tls_server_config" in doc:
        tls, client_certs = _tls_section(doc["tls_server_config"], base, where)
    users = _users(doc["basic_auth_users"], where) if "basic_auth_users" in doc else {}
    return Security(tls=tls, client_certs=client_certs, users=users)


def _known_keys(section: Mapping[Any, Any], known: tuple[str, ...], where: str, prefix: str) -> None:
    for key in section:
        if key in known:
            continue
        if key in UNSUPPORTED_KEYS:
            raise WebConfigError(
                f"{where}: {prefix}{key} is not supported by hpar-agent (supported: "
                f"{', '.join(prefix + k for k in known)})"
            )
        raise WebConfigError(
            f"{where}: unknown key {prefix}{key!s} (known: {', '.join(prefix + k for k in known)})"
        )


def _tls_section(sec: Any, base: str, where: str) -> tuple[ssl.SSLContext, str]:
    if not sec:
        raise WebConfigError(
            f"{where}: tls_server_config is empty (give cert_file and key_file, or remove it)"
        )
    if not isinstance(sec, dict):
        raise WebConfigError(f"{where}: tls_server_config must be a mapping")
    _known_keys(sec, TLS_KEYS, where, "tls_server_config.")
    text = {k: _string(sec, k, where) for k in TLS_KEYS if k in sec}
    for k in ("cert_file", "key_file"):
        if not text.get(k):
            raise WebConfigError(f"{where}: tls_server_config.{k} is missing")
    auth = text.get("client_auth_type") or "NoClientCert"
    if auth in UNVERIFIED_CLIENT_AUTH:
        raise WebConfigError(
            f"{where}: client_auth_type {auth} accepts any certificate without verifying it, "
            "which authenticates no one: use RequireAndVerifyClientCert with client_ca_file"
        )
    if auth not in CLIENT_AUTH:
        raise WebConfigError(f"{where}: unknown client_auth_type {auth!r} (one of {', '.join(CLIENT_AUTH)})")
    mode, needs_ca = CLIENT_AUTH[auth]
    ca = text.get("client_ca_file")
    if ca and not needs_ca:
        raise WebConfigError(
            f"{where}: client_ca_file is set but client_auth_type is {auth}, which checks no "
            "client certificate (use RequireAndVerifyClientCert)"
        )
    if needs_ca and not ca:
        raise WebConfigError(
            f"{where}: client_auth_type {auth} needs client_ca_file (the CA that signs the "
            "scrapers' certificates)"
        )
    versions = []
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        name = text.get(k) or default
        if name not in TLS_VERSIONS:
            raise WebConfigError(f"{where}: unknown {k} {name!r} (one of {', '.join(TLS_VERSIONS)})")
        versions.append(TLS_VERSIONS[name])
    if versions[0] > versions[1]:
        raise WebConfigError(f"{where}: min_version is above max_version")
    cert, key = (os.path.join(base, text[k]) for k in ("cert_file", "key_file"))
    ctx = _context(cert, key, "tls_server_config.cert_file", "tls_server_config.key_file", *versions)
    if ca:
        ca = os.path.join(base, ca)
        pem = _read(ca, "tls_server_config.client_ca_file")
        try:
            ctx.load_verify_locations(cadata=pem.decode("ascii"))
        except (ssl.SSLError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise WebConfigError(
                f"tls_server_config.client_ca_file {ca!r} does not load as PEM certificates ({exc})"
            ) from None
        if not ctx.cert_store_stats().get("x509_ca"):
            raise WebConfigError(f"tls_server_config.client_ca_file {ca!r} holds no CA certificate")
        ctx.verify_mode = mode
    return ctx, {ssl.CERT_REQUIRED: "required", ssl.CERT_OPTIONAL: "optional"}.get(mode, "")


def _string(sec: Mapping[str, Any], key: str, where: str) -> str:
    value = sec[key]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebConfigError(f"{where}: tls_server_config.{key} must be a string, got {value!r}")
    return value


def _users(users: Any, where: str) -> dict[str, bytes]:
    if not users:
        raise WebConfigError(
            f"{where}: basic_auth_users is empty, which would let every client in (add users or remove it)"
        )
    if not isinstance(users, dict):
        raise WebConfigError(f"{where}: basic_auth_users must map user names to bcrypt hashes")
    out = {}
    for name, hashed in users.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise WebConfigError(
                f"{where}: basic_auth_users: user name {name!r} must be a non-empty string without ':'"
            )
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(
                f"{where}: basic_auth_users.{name} is not a bcrypt hash ($2b$<cost>$ and 53 "
                "characters, e.g. from python -c 'import bcrypt; "
                'print(bcrypt.hashpw(b"PASSWORD", bcrypt.gensalt()).decode())\')'
            )
        out[name] = hashed.encode()
    return out


# --------------------------------------------------------------------------------------- TLS context
def _read(path: str, what: str) -> bytes:
    """The bytes of one of the endpoint's files; never blocks on a FIFO or a device."""
    try:
        return read_regular(path, _MAX_FILE_BYTES)
    except NotRegularError as exc:
        raise WebConfigError(f"{what} {path!r} is {exc.kind}, not a regular file") from None
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise WebConfigError(f"{what} {path!r} is larger than {_MAX_FILE_BYTES} bytes") from None
        raise WebConfigError(f"{what} {path!r} cannot be read: {exc.strerror}") from None


@contextlib.contextmanager
def _checked(path: str, what: str) -> Iterator[str]:
    """A path for ``ssl`` to open that is the regular file just checked: ``/proc/self/fd/N`` of an fd
    opened without blocking (the same file, whatever replaces ``path`` meanwhile), or ``path`` itself
    where there is no /proc."""
    try:
        fd = open_regular(path)
    except NotRegularError as exc:
        raise WebConfigError(f"{what} {path!r} is {exc.kind}, not a regular file") from None
    except OSError as exc:
        raise WebConfigError(f"{what} {path!r} cannot be read: {exc.strerror}") from None
    try:
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else path
    finally:
        os.close(fd)


def _no_password() -> bytes:
    raise WebConfigError("the private key is encrypted; give an unencrypted PEM key")


def _context(
    cert: str,
    key: str,
    cert_what: str,
    key_what: str,
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2,
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3,
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version, ctx.maximum_version = min_version, max_version
    try:
        with _checked(cert, cert_what) as cert_path, _checked(key, key_what) as key_path:
            ctx.load_cert_chain(cert_path, key_path, password=_no_password)  # never a terminal prompt
    except WebConfigError as exc:
        raise WebConfigError(f"{key_what} {key!r}: {exc}") from None
    except ssl.SSLError as exc:
        raise WebConfigError(
            f"{cert_what} {cert!r} and {key_what} {key!r} do not load as a PEM certificate "
            f"and its private key ({exc.reason or exc})"
        ) from None
    return ctx
