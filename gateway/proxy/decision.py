"""The decision listener: forward-auth answers for proxies that proxy themselves (nginx
`auth_request`, Traefik ForwardAuth, Envoy ext_authz in HTTP mode). A request here is a
question about another request, the original; the answer is allow (2xx) or deny, with
the RateLimit fields. Nothing is proxied.

Trust model: the original request is read from headers the proxy writes, so it is
believed only when the TCP peer is in `trusted_proxies`; anyone else gets 400 and is
charged nothing. The client address is then read through the trusted proxies exactly
as on the public listener (gateway.identity.sources), from the X-Forwarded-For (or the
header `client_ip` names) the proxy sends. Which proxy asks, and so which headers name
the original request and which statuses it understands, is the path asked:

- `/decide/traefik`: X-Forwarded-Method, -Host and -Uri (Traefik ForwardAuth);
- `/decide/nginx`: X-Original-Method and X-Original-URI, with the original Host
  (`proxy_set_header Host $host`); nginx takes only 401 and 403 as a denial from an
  auth_request, so a refusal is 403 and a store failure (503 elsewhere) is 401;
- `/decide/envoy/<original path>`: the original method, path and headers as Envoy's
  ext_authz HTTP service sends them, behind its `path_prefix`.

Missing, empty or repeated headers make a question that is not one (400). What they say is
the client's: its method and target are read as the public listener reads them, and
refused (400, nginx's 403) where it would refuse them, or where the proxy, which forwards
the target as sent, would forward another request than the one decided on
(gateway.proxy.forwarded_target).

Routing, identities, tiers, costs, shadow mode and failure policies are the proxy's own
(the decision core, gateway.decision); only concurrency limits are not taken, since a decision never sees
the end of the request it admits: they are skipped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web
from multidict import CIMultiDict

from gateway.decision.core import Decider
from gateway.decision.problems import PROBLEM_CONTENT_TYPE
from gateway.identity.values import IdentityRejected
from gateway.metrics import Metrics
from gateway.proxy.access_log import AccessRecord, request_id
from gateway.proxy.asked_identities import rate_identities
from gateway.proxy.forwarded_target import TargetRefused, forwarded_target
from gateway.proxy.paths import NormalPath
from gateway.proxy.problem import Answer, problem
from gateway.proxy.protocol import checked_host
from gateway.proxy.rejections import refused
from gateway.proxy.route_plan import Plans
from gateway.proxy.routing import ConditionRejected

NGINX, TRAEFIK, ENVOY = "nginx", "traefik", "envoy"
MODES = (NGINX, TRAEFIK, ENVOY)
DECIDE_PREFIX = "/decide/"
ENVOY_PREFIX = "/decide/envoy"  # Envoy's http_service.path_prefix: the original path follows it
# nginx turns any other auth_request status into a 500; its snippet maps these back.
NGINX_DENIED = 403
NGINX_UNDECIDED = 401
# Envoy's ext_authz counts every 5xx from its authorization service as the service failing,
# which `failure_mode_allow: true` lets through: a fail-closed refusal must reach it as a 4xx.
ENVOY_UNDECIDED = 429
# The gateway's answers about a client's request (allowed, denied, not decided), counted
# for every mode from the start so that dashboards and alerts read 0, not nothing.
ANSWERS = ("200", "429", "503")
# The status the gateway would have answered, for a proxy that needs another one (nginx).
GATEWAY_STATUS = "X-Gateway-Status"


class Malformed(Exception):
    """The original request's headers are missing, empty or repeated: not what a proxy writes."""


@dataclass(frozen=True, slots=True)
class Original:
    method: str
    target: str  # origin-form: path, and query if any, as the client sent them
    host: str | None  # None: the Host of the question is the original's (nginx, Envoy)


def _one(request: web.BaseRequest, name: str) -> str:
    values = request.headers.getall(name, ())
    if len(values) != 1:
        raise Malformed(f"{name} must be given once, got {len(values)}.")
    if not values[0]:
        raise Malformed(f"{name} is empty.")
    return values[0]


def original_request(mode: str, request: web.BaseRequest) -> Original:
    """What the proxy says the original request was, for the decision path `mode`."""
    if mode == TRAEFIK:
        original = Original(
            _one(request, "X-Forwarded-Method"), _one(request, "X-Forwarded-Uri"), _one(request, "X-Forwarded-Host")
        )
    elif mode == NGINX:
        original = Original(_one(request, "X-Original-Method"), _one(request, "X-Original-URI"), None)
    else:
        rest = request.raw_path[len(ENVOY_PREFIX) :]
        original = Original(request.method, rest or "/", None)
    return original


def decision_mode(raw_path: str) -> str | None:
    """The proxy a decision path is for, or None for a path that is none of them."""
    if raw_path.startswith(ENVOY_PREFIX) and raw_path[len(ENVOY_PREFIX) : len(ENVOY_PREFIX) + 1] in ("", "/", "?"):
        return ENVOY
    path = raw_path.partition("?")[0]
    if path in (DECIDE_PREFIX + NGINX, DECIDE_PREFIX + TRAEFIK):
        return path[len(DECIDE_PREFIX) :]
    return None


def for_nginx(refusal: web.StreamResponse) -> web.StreamResponse:
    """A refusal of the original request (over a limit; its method, target, Host or identity
    refused; the store failed) as nginx takes it from an auth_request: 403, or 401 for a
    store failure, the gateway's own status in X-Gateway-Status. The 400s for a question
    that is not one (an untrusted peer, headers the snippet should have set) stay 400,
    which nginx turns into a 500: they are the proxy's misconfiguration, not the client's doing."""
    refusal.headers[GATEWAY_STATUS] = str(refusal.status)
    refusal.set_status(NGINX_UNDECIDED if refusal.status == 503 else NGINX_DENIED)
    return refusal


def for_envoy(refusal: web.StreamResponse) -> web.StreamResponse:
    """A 5xx answer about the original request (a fail-closed limit's store failed) as Envoy
    passes it to the client instead of treating it as the gateway failing: 429 with the
    same headers, the gateway's status in X-Gateway-Status, and a problem body that says 429
    (RFC 9457: the member repeats the response's status) with the same type and detail."""
    status = refusal.status
    refusal.headers[GATEWAY_STATUS] = str(status)
    refusal.set_status(ENVOY_UNDECIDED)
    if isinstance(refusal, web.Response) and isinstance(refusal.body, bytes) and refusal.content_type == PROBLEM_CONTENT_TYPE:
        problem_doc = json.loads(refusal.body)
        problem_doc["status"] = ENVOY_UNDECIDED
        refusal.body = rewritten = json.dumps(problem_doc).encode()
        refusal.headers[hdrs.CONTENT_LENGTH] = str(len(rewritten))
    return refusal


class DecisionService:
    """The decision listener's one handler, on the proxy handler's plans (so a reload
    reaches it) and its limiter check."""

    def __init__(self, plans: Callable[[], Plans], decider: Decider, metrics: Metrics) -> None:
        """`plans`: those the proxy serves now, so that a reload reaches this listener too."""
        self._plans = plans
        self._decider = decider
        self._metrics = metrics
        self._in_flight = 0
        # The counter of each (mode, status), bound once: both come from bounded sets (the
        # modes, and the statuses the config and this module answer with).
        self._answered: dict[tuple[str, str], Any] = {}
        for mode in MODES:
            for status in ANSWERS:
                self._answered[mode, status] = metrics.decision_requests.labels(mode=mode, status=status)

    @property
    def in_flight(self) -> int:
        """Questions being answered now: a drain waits for this to reach 0."""
        return self._in_flight

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self._in_flight += 1
        mode = decision_mode(request.raw_path)
        try:
            response = await self._answer(request, mode)
        finally:
            self._in_flight -= 1
        # Counted as the gateway decided it: nginx's 403 and 401 are its 429 and 503.
        key = (mode or "none", response.headers.get(GATEWAY_STATUS) or str(response.status))
        counter = self._answered.get(key)
        if counter is None:
            counter = self._answered[key] = self._metrics.decision_requests.labels(mode=key[0], status=key[1])
        counter.inc()
        return response

    async def _answer(self, request: web.BaseRequest, mode: str | None) -> web.StreamResponse:
        if mode is None:
            return problem(404, "Not Found", "Decisions are asked at /decide/nginx, /decide/traefik or /decide/envoy/<path>.")
        plans = self._plans()
        if not plans.identity.address(request.remote or "")[1]:
            return problem(400, "Bad Request", "Only a peer in trusted_proxies may ask for decisions.")
        try:
            original = original_request(mode, request)
        except Malformed as exc:
            return problem(400, "Bad Request", str(exc))
        # What follows the question's own checks is about the client's request: nginx must
        # hear a refusal as a denial.
        try:
            target = forwarded_target(original.method, original.target, plans.path_rule)
        except TargetRefused as exc:
            answer: web.StreamResponse = problem(400, "Bad Request", exc.detail)
        else:
            headers = CIMultiDict(request.headers)
            if original.host is not None:
                headers[hdrs.HOST] = original.host
            asked = request.clone(method=original.method, rel_url=target.url, headers=headers)
            answer = await self._decide(asked, target.path, plans)
        if mode == NGINX and answer.status >= 400:
            return for_nginx(answer)
        if mode == ENVOY and answer.status >= 500:
            return for_envoy(answer)
        return answer

    async def _decide(self, asked: web.BaseRequest, path: NormalPath, plans: Plans) -> web.StreamResponse:
        """The answer to the original request `asked`, its path `path`, as the proxy handler
        would refuse it or, allowed, with the fields it would send, on the plans the
        question began on."""
        host = checked_host(asked)
        if not isinstance(host, str):
            return host
        try:
            plan = plans.router.find(asked.method, host, path.match, asked.headers, asked.rel_url)
        except ConditionRejected as exc:
            return problem(400, "Bad Request", str(exc))
        if plan is None:
            # No route, no limit: the proxy asking routes the request itself.
            return web.Response(status=200)
        if path.parameters and not plan.allow_path_parameters:
            return problem(400, "Bad Request", "This route does not accept ';' parameters in the path.")
        record = AccessRecord(request_id(asked.headers.get("X-Request-ID")), plans.identity, plans.log_secret)
        try:
            identities, held = rate_identities(asked, plan, plans.identity, record)
        except IdentityRejected as exc:
            return problem(exc.status, exc.title, exc.detail, headers=exc.headers)
        # No concurrency leases: this listener never sees the end of the request it admits.
        verdict = await self._decider.decide(plan.decision, identities, held=held, max_delayed=plans.max_delayed)
        if verdict.refusal is not None:
            return refused(verdict.refusal)
        # Prebuilt, as a refusal is: aiohttp's Response would copy and check the fields again.
        return Answer(200, b"", CIMultiDict(verdict.fields))
