"""UI: the live dashboard (micro service ``sja-ui``), served over HTTP on ``SJA_UI_PORT``.

It reads NATS only, like every other service: the slices (KV ``sja-slices``) and the jobs (KV
``sja-jobs``), re-read at most every ``SJA_UI_REFRESH_S`` while a page asks; the round records
(stream ``SJA_ROUNDS``, followed live by an ordered consumer from ``SJA_UI_ROUNDS_LOOKBACK_S``
back); and, for a job's page, the gateway's requests (``explain``, ``rounds``, ``logs``: what the
subjobs' programs wrote last). It writes nothing
and decides nothing: the page shows what ``sja.core.explain`` and the clearer's ledger say
(``services.ui.views``). Replicas are independent (each reads for itself): scale them freely.

HTTP (a small asyncio server, GET only): ``/`` the dashboard and ``/job/<id>`` a job's page (one
HTML page, ``services.ui.page``), which poll ``/api/overview`` and ``/api/job/<id>`` (JSON);
``/healthz``.

Every path but ``/healthz`` needs a token (``sja.dashauth``): in the query (``?token=``, then kept in
a cookie and taken out of the address), in the cookie, or as ``Authorization: Bearer``. No valid
token: 401. The operator's token shows every job; a tenant's shows that tenant's jobs only (another
tenant's job is 404, as if there were none), its own tenant's share, and the rounds it bid in with
the other tenants' bids anonymized, as the gateway's tenant subjects answer. Jobs leave redacted
(``sja.redaction``): no value of ``params.env`` is shown to anyone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import http.cookies
import logging
import re
import time
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from services.ui import page, views
from sja import dashauth
from sja.bus.rounds import decode_rounds
from sja.bus.service import Service
from sja.bus.settings import BaseSettings, TenantShares
from sja.client import ApiError, SjaClient
from sja.core import explain as E
from sja.protocol import subjects
from sja.protocol.messages import Explanation, JobState, LogsView, RoundRecord, SliceState
from sja.redaction import redacted

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 1024
"""A request line and headers longer than this are refused (the dashboard only takes GETs)."""
GATEWAY_TIMEOUT_S = 5.0
COOKIE = "sja_dashboard"
"""The cookie that keeps a token after its first use (``HttpOnly``, ``SameSite=Strict``)."""
COOKIE_MAX_AGE_S = 30 * 86400
SECRET_NAME = "dashboard.secret"  # the same name as ``sja dashboard-token`` looks for
"""The secret's file under ``<SJA_OUT_DIR>/ui/`` when ``SJA_UI_TOKEN_FILE`` names none."""
UNAUTHORIZED_HTML = """<!doctype html><meta charset="utf-8"><title>SJA dashboard</title>
<p>This dashboard needs a token. Open the address <code>sja up</code> printed
(<code>http://HOST:PORT/?token=...</code>), or ask the operator for your tenant's
(<code>sja dashboard-token --tenant NAME</code>).</p>
"""
JOB_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")
"""What a job id in a URL may be (a KV key); anything else is no such job."""


class UiSettings(BaseSettings, frozen=True, kw_only=True):
    ui_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    """Port of the dashboard's HTTP server; 0: any free port (logged)."""
    ui_host: str = "127.0.0.1"
    """Address the dashboard binds: this machine only unless told otherwise (``0.0.0.0``: every
    interface, e.g. in a container whose port is published)."""
    ui_token_file: str = ""
    """File holding the dashboard's secret, from which every token is derived (``sja.dashauth``;
    ``sja up`` writes one). Empty: ``<SJA_OUT_DIR>/ui/dashboard.secret``. A missing file is created
    with a new secret at start, readable by the service's user only."""
    ui_refresh_s: float = 1.0
    """The slices and jobs are read again at most this often (while pages ask)."""
    ui_rounds_kept: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 500
    """Newest round records kept in memory for the dashboard's list of rounds."""
    ui_rounds_lookback_s: float = 60.0
    """At start, the rounds stored this long back are read; then every new one as it is stored."""
    jaeger_url: str = ""
    """Base URL of a Jaeger UI (e.g. ``http://localhost:16686``): a job's page links each round to
    its trace there. Empty: no links."""
    tenant_shares: TenantShares = msgspec.field(default_factory=dict)
    """``tenant=weight,...``: the tenants' target shares, as the clearer's ``SJA_TENANT_SHARES``."""


class UiService(Service):
    name = "ui"

    def __init__(self, settings: UiSettings) -> None:
        super().__init__(settings)
        self.ui: UiSettings = settings
        self.targets = dict(settings.tenant_shares)
        self.records: collections.deque[RoundRecord] = collections.deque(maxlen=settings.ui_rounds_kept)
        self.http_port = 0
        """The port the dashboard listens on once started (``ui_port``, or the one picked for 0)."""
        self._server: asyncio.Server | None = None
        self._rounds_sub: Any = None
        self._read_at = -1e9
        self._read_lock = asyncio.Lock()
        self._states: list[JobState] = []
        self._slices: list[SliceState] = []
        self.token_file = Path(settings.ui_token_file or Path(settings.out_dir) / "ui" / SECRET_NAME)
        self._secret = ""

    async def on_start(self) -> None:
        try:
            self._secret = await asyncio.to_thread(dashauth.ensure_secret, self.token_file)
        except (dashauth.SecretError, OSError) as e:
            raise ValueError(f"SJA_UI_TOKEN_FILE: {e}") from None
        log.info("%s: dashboard tokens derive from the secret in %s", self.instance, self.token_file)
        await self._follow_rounds()
        self._server = await asyncio.start_server(
            self._serve, self.ui.ui_host, self.ui.ui_port, limit=MAX_REQUEST_BYTES
        )
        self.http_port = self._server.sockets[0].getsockname()[1]
        log.info("%s: dashboard on http://%s:%d/", self.instance, self.ui.ui_host, self.http_port)

    async def on_stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        if self._rounds_sub is not None:
            with contextlib.suppress(Exception):
                await self._rounds_sub.unsubscribe()

    # --- reading the bus -------------------------------------------------------------------------

    async def _follow_rounds(self) -> None:
        """Every round record stored from ``ui_rounds_lookback_s`` ago on, as it is stored."""
        since = datetime.datetime.fromtimestamp(time.time() - self.ui.ui_rounds_lookback_s, tz=datetime.UTC)

        async def on_record(msg: Msg) -> None:
            try:
                self.records.extend(decode_rounds(msg.data))
            except ValueError as e:
                self.metrics.rejected(subjects.round_cleared("*"), e)

        self._rounds_sub = await self.jetstream.subscribe(
            f"{subjects.PREFIX}.round.cleared.>",
            stream=subjects.STREAM_ROUNDS.name,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            config=ConsumerConfig(opt_start_time=since),
            cb=on_record,
            pending_msgs_limit=1_000_000,
        )

    async def _read(self) -> tuple[list[JobState], list[SliceState]]:
        """The jobs and slices, read again when the last read is older than ``ui_refresh_s``."""
        async with self._read_lock:
            if time.monotonic() - self._read_at >= self.ui.ui_refresh_s:
                assert self.jobs is not None and self.slices is not None
                jobs, slices = await asyncio.gather(self.jobs.all(), self.slices.all())
                self._states = [redacted(s) for s, _ in jobs]
                self._slices = [s for s, _ in slices]
                self._read_at = time.monotonic()
            return self._states, self._slices

    async def overview(self, viewer: dashauth.Viewer | None = None) -> dict[str, Any]:
        """The main page's data, for the operator (every job) or a tenant (``viewer.tenant``)."""
        states, slices = await self._read()
        records = list(self.records)
        if viewer is None or viewer.tenant is None:
            out = views.overview(states, slices, records, self.targets, time.time())
            out["viewer"] = {"operator": True, "tenant": ""}
            return out
        tenant = viewer.tenant
        out = views.tenant_overview(tenant, states, slices, records, self.targets, time.time())
        out["viewer"] = {"operator": False, "tenant": tenant}
        return out

    async def job(self, job_id: str, viewer: dashauth.Viewer | None = None) -> dict[str, Any] | None:
        """A job's page, or ``None`` if there is no such job (or it is another tenant's, for a
        tenant's ``viewer``). The explanation and the rounds are the gateway's (``explain``,
        ``rounds``, on the tenant's subjects for a tenant: other tenants' bids anonymized); without a
        gateway, the job's state in a sentence."""
        assert self.jobs is not None
        got = await self.jobs.get(job_id)
        tenant = viewer.tenant if viewer is not None else None
        if got is None or (tenant is not None and got[0].spec.tenant != tenant):
            return None
        state = redacted(got[0])
        now = time.time()
        client = SjaClient(self.bus, timeout_s=GATEWAY_TIMEOUT_S, tenant=tenant or "")
        explained_by = "gateway"
        rounds: list[RoundRecord] = []
        logs: LogsView | None = None
        logs_note = ""
        explained, logged = await asyncio.gather(
            asyncio.gather(client.explain(job_id), client.rounds(job_id)),
            client.logs(job_id),
            return_exceptions=True,
        )
        if isinstance(explained, BaseException):
            if not isinstance(explained, ApiError | TimeoutError | nats.errors.Error):
                raise explained
            e = explained
            log.warning("%s: the gateway did not explain %s: %s", self.instance, job_id, e)
            explained_by = "dashboard"
            explanation = Explanation(
                job_id=job_id,
                status=state.status,
                summary=E.summary(state, now),
                notes=[f"the gateway did not answer ({type(e).__name__}: {e}): no reasons per window"],
            )
        else:
            explanation, rounds = explained
        if isinstance(logged, BaseException):
            if not isinstance(logged, ApiError | TimeoutError | nats.errors.Error):
                raise logged
            logs_note = f"the gateway did not give the subjobs' output ({type(logged).__name__}: {logged})"
        else:
            logs = logged
        # The job's colour among the jobs this viewer sees, as the main page gives it.
        states, _ = await self._read()
        shown = [s for s in states if tenant is None or s.spec.tenant == tenant]
        colour = views.job_colours(shown if any(s.job_id == job_id for s in shown) else [*shown, state])
        return views.job_page(
            state,
            explanation,
            rounds,
            now,
            self.ui.jaeger_url,
            explained_by,
            colour=colour[job_id],
            logs=logs,
            logs_note=logs_note,
        )

    # --- HTTP ------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, ctype, body, extra = await self._answer(reader)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            status, ctype, body, extra = 400, "text/plain; charset=utf-8", b"bad request\n", ""
        except Exception:
            log.exception("%s: dashboard request failed", self.instance)
            status, ctype, body, extra = 500, "text/plain; charset=utf-8", b"internal error\n", ""
        reason = {
            200: "OK",
            303: "See Other",
            400: "Bad Request",
            401: "Unauthorized",
            404: "Not Found",
            405: "Method Not Allowed",
        }.get(status, "Internal Server Error")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Cache-Control: no-store\r\nReferrer-Policy: no-referrer\r\n{extra}Connection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    def _viewer(self, headers: dict[str, str], query_token: str) -> tuple[dashauth.Viewer | None, str]:
        """Who asks, from the query's token, else the cookie's, else ``Authorization: Bearer``; and
        the token to keep in the cookie (the query's, once valid)."""
        if query_token:
            viewer = dashauth.viewer_of(query_token, self._secret)
            return viewer, query_token if viewer is not None else ""
        cookie = http.cookies.SimpleCookie()
        with contextlib.suppress(http.cookies.CookieError):
            cookie.load(headers.get("cookie", ""))
        if COOKIE in cookie:
            viewer = dashauth.viewer_of(cookie[COOKIE].value, self._secret)
            if viewer is not None:
                return viewer, ""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return dashauth.viewer_of(token.strip(), self._secret), ""
        return None, ""

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, str]:
        """The status, content type, body and extra header lines (each ending ``\\r\\n``)."""
        status, ctype, body, *extra = await self._route(reader)
        return status, ctype, body, extra[0] if extra else ""

    async def _route(self, reader: asyncio.StreamReader) -> tuple[Any, ...]:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, _, header_block = head.decode("latin-1").partition("\r\n")
        method, target, _version = request_line.split(" ", 2)
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"GET only\n"
        headers: dict[str, str] = {}
        for line in header_block.split("\r\n"):
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        parts = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(parts.path)
        query = urllib.parse.parse_qs(parts.query)
        json_type = "application/json"
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        viewer, keep = self._viewer(headers, (query.get("token") or [""])[0])
        if viewer is None:
            if path.startswith("/api/"):
                return 401, json_type, msgspec.json.encode({"error": "a dashboard token is needed"})
            return 401, "text/html; charset=utf-8", UNAUTHORIZED_HTML.encode()
        if keep:
            cookie = (
                f"Set-Cookie: {COOKIE}={keep}; Path=/; Max-Age={COOKIE_MAX_AGE_S}; HttpOnly; "
                "SameSite=Strict\r\n"
            )
            if not path.startswith("/api/"):
                # The token goes into the cookie and out of the address bar (and the history).
                rest = urllib.parse.urlencode([(k, v) for k, vs in query.items() if k != "token" for v in vs])
                location = urllib.parse.quote(path) + (f"?{rest}" if rest else "")
                return 303, "text/plain; charset=utf-8", b"", f"{cookie}Location: {location}\r\n"
        if path == "/" or path.startswith("/job/"):
            return 200, "text/html; charset=utf-8", page.HTML.encode()
        if path == "/api/overview":
            return 200, json_type, msgspec.json.encode(await self.overview(viewer))
        if path.startswith("/api/job/"):
            job_id = path.removeprefix("/api/job/")
            found = await self.job(job_id, viewer) if JOB_ID.fullmatch(job_id) else None
            if found is None:
                return 404, json_type, msgspec.json.encode({"error": "no such job"})
            return 200, json_type, msgspec.json.encode(found)
        return 404, "text/plain; charset=utf-8", b"not found\n"
