"""Receivers: Prometheus Alertmanager (``POST /api/v2/alerts``) and webhooks (the notification
as JSON, signed with HMAC-SHA256). Each keeps one HTTP connection and a timeout; a failure
raises, and its delivery thread (service.py) backs off and tries again, in order."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import time
from urllib.parse import urlsplit

from collector.config import ReceiverConfig
from collector.daemon.alerts.store import iso

SIGNATURE = "X-Flowsieve-Signature"  # sha256=<hex HMAC of the body>
IDEMPOTENCY = "X-Flowsieve-Idempotency-Key"
USER_AGENT = "flowsieve-alerts"


class DeliveryError(Exception):
    pass


class Receiver:
    """One configured receiver: how many notifications one request carries, and how a
    request is made of them."""

    batch = 1

    def __init__(self, name: str, config: ReceiverConfig):
        self.name = name
        self.config = config
        u = urlsplit(config.url)
        self._https = u.scheme == "https"
        self._host = u.hostname or ""
        self._port = u.port
        self._base = u.path.rstrip("/")
        self._query = f"?{u.query}" if u.query else ""
        self._conn: http.client.HTTPConnection | None = None

    def _post(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        """POST with one kept connection (made again after a failure); a status other than
        2xx is a failure."""
        for attempt in (0, 1):  # a kept connection the server closed: once more, fresh
            if self._conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = cls(self._host, self._port, timeout=self.config.timeout_s)
            try:
                self._conn.request("POST", path, body, {
                    "Content-Type": "application/json", "User-Agent": USER_AGENT, **headers})
                resp = self._conn.getresponse()
                text = resp.read(4096)
            except (http.client.RemoteDisconnected, ConnectionResetError,
                    BrokenPipeError) as e:
                self.close()
                if attempt:
                    raise DeliveryError(f"{self.name}: {e!r}") from e
                continue
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise DeliveryError(f"{self.name}: {e!r}") from e
            if not 200 <= resp.status < 300:
                raise DeliveryError(f"{self.name}: HTTP {resp.status}: "
                                    f"{text.decode(errors='replace')[:200]}")
            return

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def send(self, events: list[dict]) -> None:
        raise NotImplementedError


class Webhook(Receiver):
    """The notification as it is (``lifecycle.event``), one per request, signed: the header
    ``X-Flowsieve-Signature: sha256=<hex>`` is the HMAC-SHA256 of the body with the
    receiver's secret; ``X-Flowsieve-Idempotency-Key`` names the notification (a repeat after
    a lost answer carries the same)."""

    def send(self, events: list[dict]) -> None:
        for e in events:
            body = json.dumps(e, separators=(",", ":")).encode()
            headers = {IDEMPOTENCY: e["idempotency_key"]}
            if self.config.secret is not None:
                headers[SIGNATURE] = "sha256=" + sign(self.config.secret.get_secret_value(),
                                                      body)
            self._post(self._base + self._query, body, headers)


def sign(secret: str, body: bytes) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class Alertmanager(Receiver):
    """Alertmanager's v2 API: alerts by labels (it deduplicates and groups them itself), a
    firing one with ``endsAt`` a few resends ahead (as Prometheus does: an alert flowsieve
    stops sending resolves by itself), a resolved one with its end."""

    batch = 500

    def send(self, events: list[dict]) -> None:
        now = time.time()
        alerts = [to_alertmanager(e, now, self.config.resend_s) for e in events]
        self._post(self._base + "/api/v2/alerts", json.dumps(alerts).encode(), {})


def to_alertmanager(e: dict, now: float, resend_s: float) -> dict:
    ends = e["ends_at"] or iso(round(now + 4 * resend_s))
    return {"labels": e["labels"],
            "annotations": {"summary": e["summary"], "window_start": e["window_start"],
                            "window_end": e["window_end"],
                            "row": json.dumps(e["row"], separators=(",", ":"), default=str)},
            "startsAt": e["starts_at"], "endsAt": ends, "generatorURL": e["generator_url"]}


def make_receiver(name: str, config: ReceiverConfig) -> Receiver:
    return (Alertmanager if config.type == "alertmanager" else Webhook)(name, config)
