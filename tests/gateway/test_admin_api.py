"""The admin API on the admin listener: inspect and reset a client's bucket (on the
in-process store, one Redis and a Redis Cluster), the top limited clients, the
effective config with its secrets redacted, the pool targets' figures in /stats,
the bearer token, and none of it on the public listener."""

from __future__ import annotations

import json

import pytest

from gateway.config import load_config
from gateway.config.loader import parse_config
from gateway.testing import config_from_yaml, running_gateway
from tests.helpers import script_calls
from tests.processes import RedisCluster, RedisServer, free_port
from tests.upstream import running_upstream

ADMIN_TOKEN = "admin-token-0123456789abcdef"
API_KEY = "client-key-7d41"
PROBLEM = "application/problem+json"


def limits_config(upstream: str, store: str = "") -> str:
    return f"""
{store}
limits:
  per_key: {{rate: 1/hour, burst: 2, key: header:X-Api-Key}}
  per_user: {{rate: 1/hour, burst: 5, key: [header:X-User, query:user]}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
  - match: {{path: /users}}
    upstream: {upstream}
    limits: [per_user]
"""


async def call(client, method: str, url: str, *, expect: int, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with client.request(method, url, headers=headers) as response:
        body = await response.read()
        assert response.status == expect, body
        if expect >= 400:
            assert response.headers["Content-Type"].split(";")[0] == PROBLEM
        return json.loads(body)


async def statuses(client, url: str, key: str, count: int) -> list[int]:
    found = []
    for _ in range(count):
        async with client.get(url + "/api/x", headers={"X-Api-Key": key}) as response:
            await response.read()
            found.append(response.status)
    return found


async def inspect_and_reset(client, gw) -> tuple[dict, dict, dict]:
    """Spend API_KEY's burst of 2 and get denied, inspect, reset, and pass again;
    returns the bucket as inspected before the reset, the reset's answer, and after."""
    assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]
    bucket = f"{gw.admin_url}/buckets/per_key?value={API_KEY}"
    before = await call(client, "GET", bucket, expect=200)
    assert before["limit"] == "per_key" and before["source"] == "header:x-api-key"
    assert before["held"] is True and before["tokens"] < 0.01 and before["capacity"] == 2
    assert 3599 < before["full_in_seconds"] <= 3600 * 2
    untouched = await call(client, "GET", f"{gw.admin_url}/buckets/per_key?value=someone-else", expect=200)
    assert untouched["held"] is False and untouched["tokens"] == 2 and untouched["full_in_seconds"] == 0

    reset = await call(client, "DELETE", bucket, expect=200)
    assert reset["reset"] is True and reset["held"] is True
    # The next request is decided afresh: no cached denial keeps the client out.
    assert await statuses(client, gw.url, API_KEY, 1) == [200]
    after = await call(client, "GET", bucket, expect=200)
    assert after["held"] is True and 0.99 < after["tokens"] < 1.01
    again = await call(client, "DELETE", f"{gw.admin_url}/buckets/per_key?value=never-seen", expect=200)
    assert again["held"] is False
    return before, reset, after


async def test_inspect_and_reset_a_bucket_on_the_in_process_store(upstream, client):
    async with running_gateway(limits_config(upstream)) as gw:
        before, _, _ = await inspect_and_reset(client, gw)
    assert before["store"] == "in-process"
    assert before["denied_here_for_seconds"] == 0  # no denial cache without a shared store
    assert API_KEY not in json.dumps(before)


async def test_inspect_and_reset_a_bucket_on_one_redis(upstream, client, dedicated_redis):
    redis_server = dedicated_redis  # at the default store.timeout, as users run it
    store = f"store: {{url: '{redis_server.url}', prefix: 'adm:'}}"
    async with running_gateway(limits_config(upstream, store)) as gw:
        before, _, after = await inspect_and_reset(client, gw)
    redis = redis_server.client()
    assert before["key"].startswith("adm:per_key:{") and API_KEY not in before["key"]
    assert after["key"] == before["key"]
    assert redis.hget(before["key"], "tokens") is not None  # recharged after the reset: the same key


async def test_a_reset_in_redis_deletes_the_key_and_clears_the_denial_cache(upstream, client, dedicated_redis):
    redis_server = dedicated_redis  # at the default store.timeout, as users run it
    store = f"store: {{url: '{redis_server.url}', prefix: 'adm:'}}"
    async with running_gateway(limits_config(upstream, store)) as gw:
        assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]
        assert len(gw.gateway.limiter.denials) == 1  # the third was answered here, not by Redis
        bucket = f"{gw.admin_url}/buckets/per_key?value={API_KEY}"
        before = await call(client, "GET", bucket, expect=200)
        assert 3500 < before["denied_here_for_seconds"] <= 3600
        assert redis_server.client().exists(before["key"]) == 1
        await call(client, "DELETE", bucket, expect=200)
        assert redis_server.client().exists(before["key"]) == 0
        assert len(gw.gateway.limiter.denials) == 0
        assert (await call(client, "GET", bucket, expect=200))["denied_here_for_seconds"] == 0
        assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]


async def test_denied_here_for_follows_a_reload_of_the_limit(upstream, client, dedicated_redis, tmp_path):
    """Reproduction: the admin API counted every cached denial by limit name, so after a
    reload raised per_key's burst from 2 to 3 it still said the denial was held here for
    ~3600 s, while the next request asked Redis (the cache drops a changed limit's denials).
    A reload that leaves the limit as it was keeps the hold, and says so."""
    store = f"store: {{url: '{dedicated_redis.url}', prefix: 'adm:'}}"
    path = tmp_path / "gateway.yaml"
    path.write_text(limits_config(upstream, store))
    redis = dedicated_redis.client()

    async with running_gateway(load_config(str(path))) as gw:
        bucket = f"{gw.admin_url}/buckets/per_key?value={API_KEY}"
        assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]
        path.write_text(limits_config(upstream, store).replace("/users", "/people"))  # per_key unchanged
        assert gw.gateway.reload()
        assert 3500 < (await call(client, "GET", bucket, expect=200))["denied_here_for_seconds"] <= 3600
        path.write_text(limits_config(upstream, store).replace("burst: 2,", "burst: 3,"))
        assert gw.gateway.reload()
        assert (await call(client, "GET", bucket, expect=200))["denied_here_for_seconds"] == 0
        calls = script_calls(redis)
        assert await statuses(client, gw.url, API_KEY, 1) == [429]
        assert script_calls(redis) == calls + 1  # as it said: Redis was asked, not this process's cache


async def test_inspect_and_reset_a_bucket_on_a_redis_cluster(upstream, client):
    with RedisCluster(dedicated=True) as cluster:  # at the default store.timeout, as users run it
        store = f"store: {{url: '{cluster.url}', prefix: 'adm:'}}"
        async with running_gateway(limits_config(upstream, store)) as gw:
            before, _, _ = await inspect_and_reset(client, gw)
            # Other identities land on other masters: each is read and reset where its slot lives.
            # Where an identity lands depends on the run's key secret, so identities are added until
            # every master owns one (12 would miss a master in about 2% of runs; 200 almost never do).
            masters = cluster.masters()
            redis = cluster.client()

            def owner(key):
                slot = redis.keyslot(key)
                return next(port for port, ranges in masters.items() if any(a <= slot <= b for a, b in ranges))

            keys, owners = [], set()
            for n in range(200):
                assert await statuses(client, gw.url, f"spread-{n}", 1) == [200]
                answer = await call(client, "GET", f"{gw.admin_url}/buckets/per_key?value=spread-{n}", expect=200)
                assert answer["held"] is True and 0.99 < answer["tokens"] < 1.01
                keys.append(answer["key"])
                owners.add(owner(answer["key"]))
                if len(owners) == 3 and n >= 11:
                    break
            assert len(owners) == 3
            await call(client, "DELETE", f"{gw.admin_url}/buckets/per_key?value=spread-0", expect=200)
            assert (await call(client, "GET", f"{gw.admin_url}/buckets/per_key?value=spread-0", expect=200))["held"] is False
        assert redis.exists(before["key"]) == 1 and redis.exists(keys[0]) == 0
        assert all(redis.exists(key) == 1 for key in keys[1:])


async def test_a_bucket_is_named_by_a_source_of_its_limit(upstream, client):
    async with running_gateway(limits_config(upstream)) as gw:
        async with client.get(gw.url + "/users/x?user=alice") as response:
            assert response.status == 200
        base = f"{gw.admin_url}/buckets/per_user"
        by_query = await call(client, "GET", base + "?source=query:user&value=alice", expect=200)
        assert by_query["held"] is True and by_query["tokens"] == pytest.approx(4, abs=0.01)
        by_header = await call(client, "GET", base + "?source=Header:X-User&value=alice", expect=200)
        assert by_header["held"] is False and by_header["source"] == "header:x-user"
        # A client with none of the sources is limited by address.
        by_ip = await call(client, "GET", base + "?source=ip&value=::ffff:127.0.0.1", expect=200)
        assert by_ip["source"] == "ip" and by_ip["held"] is False
        # An address is read as the gateway keys a client's: a zone id names no other client.
        with_zone = await call(client, "GET", base + "?source=ip&value=fe80::1%25eth0", expect=200)
        without = await call(client, "GET", base + "?source=ip&value=fe80::1", expect=200)
        assert with_zone["identity"] == without["identity"]

        several = await call(client, "GET", base + "?value=alice", expect=400)
        assert several["sources"] == ["header:x-user", "query:user", "ip"]
        assert (await call(client, "GET", base + "?source=cookie:user&value=alice", expect=400))["status"] == 400
        await call(client, "GET", base + "?source=ip&value=not-an-address", expect=400)
        await call(client, "GET", base + "?source=query:user", expect=400)
        await call(client, "DELETE", base + "?source=query:user&value=", expect=400)
        unknown = await call(client, "GET", f"{gw.admin_url}/buckets/nope?value=x", expect=404)
        assert unknown["title"] == "Not Found" and unknown["limits"] == ["per_key", "per_user"]
        await call(client, "DELETE", f"{gw.admin_url}/buckets/nope?value=x", expect=404)


async def test_top_limited_lists_the_most_denied_clients_hashed(upstream, client):
    async with running_gateway(limits_config(upstream)) as gw:
        assert await statuses(client, gw.url, "flooder", 12) == [200, 200] + [429] * 10
        assert await statuses(client, gw.url, "nibbler", 4) == [200, 200, 429, 429]
        assert await statuses(client, gw.url, "polite", 2) == [200, 200]
        top = await call(client, "GET", gw.admin_url + "/top-limited", expect=200)
        flooder = await call(client, "GET", gw.admin_url + "/buckets/per_key?value=flooder", expect=200)
        assert (await call(client, "GET", gw.admin_url + "/top-limited?n=1", expect=200))["clients"] == top["clients"][:1]
        for bad in ("0", "-1", "x", "100000", "%C2%B2", "9" * 5000, ""):
            await call(client, "GET", gw.admin_url + f"/top-limited?n={bad}", expect=400)
    assert top["identities"] == "hashed" and top["window_seconds"] == 60
    assert [(c["limit"], c["denials"], c["error"]) for c in top["clients"]] == [("per_key", 10, 0), ("per_key", 2, 0)]
    assert top["clients"][0]["identity"] == flooder["identity"]  # the same hash as inspect shows
    assert top["clients"][0]["identity"].startswith("header:x-api-key#")
    for raw in ("flooder", "nibbler", "polite"):
        assert raw not in json.dumps(top)


async def test_top_limited_shows_raw_identities_when_the_config_opts_in(upstream, client):
    async with running_gateway(limits_config(upstream) + "admin_raw_identities: true\n") as gw:
        assert await statuses(client, gw.url, "flooder", 5) == [200, 200, 429, 429, 429]
        top = await call(client, "GET", gw.admin_url + "/top-limited", expect=200)
    assert top["identities"] == "raw"
    assert top["clients"] == [{"limit": "per_key", "identity": "header:x-api-key=flooder", "denials": 3, "error": 0}]


SECRETS = {
    "ADMIN_TOKEN": ADMIN_TOKEN, "JWT_SECRET": "jwt-secret-5c9e0a7b1d3f5e7a9c1b3d5f7a9c1e3b", "HDR_SECRET": "hdr-secret-77c1",
}


def secret_config(upstream: str, store_url: str) -> str:
    return f"""
admin_token_env: ADMIN_TOKEN
store: {{url: "{store_url}", key_secret: "key-secret-88e1f2"}}
jwt: {{secret_env: JWT_SECRET}}
limits:
  per_sub: {{rate: 10/second, key: [jwt:sub, ip]}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_sub]
  - match: {{path: /basic}}
    upstream: {upstream.replace("http://", "http://svc:upstream-pass-9a04@")}
    request_headers: {{set: {{Authorization: "Bearer ${{HDR_SECRET}}"}}, add: {{X-Tag: "${{HDR_SECRET}}"}}}}
"""


async def test_the_effective_config_has_every_secret_redacted(upstream, client):
    redis_server = RedisServer(password="store-pass-61d0")  # nothing listens: the config is what matters
    config = config_from_yaml(secret_config(upstream, f"redis://gw:store-pass-61d0@127.0.0.1:{redis_server.port}/0"), environ=SECRETS)
    async with running_gateway(config) as gw:
        shown = await call(client, "GET", gw.admin_url + "/config", expect=200, token=ADMIN_TOKEN)
    text = json.dumps(shown)
    for secret in ("store-pass-61d0", "key-secret-88e1f2", SECRETS["JWT_SECRET"], ADMIN_TOKEN, "upstream-pass-9a04",
                   SECRETS["HDR_SECRET"]):
        assert secret not in text
    # As the YAML spells it: the admin token and the JWT secret by the variables they came from.
    document = shown["config"]
    assert document["store"]["url"] == f"redis://gw:***@127.0.0.1:{redis_server.port}/0"
    assert document["store"]["key_secret"] == "***" and document["admin_token_env"] == "ADMIN_TOKEN"
    assert document["jwt"] == {"secret_env": "JWT_SECRET", "on_invalid": "next"}
    assert document["limits"]["per_sub"] == {
        "rate": "10/second", "burst": 10, "key": ["jwt:sub", "ip"], "on_store_error": "open", "shadow": False,
        "mode": "reject", "response": {"status": 429, "headers": "ietf"},
    }
    # The body of its 429s is problem+json, which no key of the file says.
    assert shown["effective"] == {"limits.per_sub.response.content_type": PROBLEM}
    assert document["routes"][0]["match"]["path"] == "/api"
    assert document["routes"][1]["upstream"] == upstream.replace("http://", "http://svc:***@")
    # A header a route writes is named, its value never shown.
    assert document["routes"][1]["request_headers"] == {"set": {"Authorization": "***"}, "add": {"X-Tag": "***"}}
    assert sorted(shown["redacted"]) == [
        "routes[1].request_headers.add.X-Tag", "routes[1].request_headers.set.Authorization", "routes[1].upstream",
        "store.key_secret", "store.url",
    ]
    # Pasted into a file, the secrets put back, it is the config the gateway runs.
    document["store"]["url"], document["store"]["key_secret"] = config.store.url, config.store.key_secret
    document["routes"][1]["upstream"] = config.routes[1].upstream
    document["routes"][1]["request_headers"] = {"set": {"Authorization": f"Bearer {SECRETS['HDR_SECRET']}"}, "add": {"X-Tag": SECRETS["HDR_SECRET"]}}
    served = gw.gateway.config  # on free ports
    assert parse_config(json.dumps(document), source=config.source, environ=SECRETS) == served


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/buckets/per_key?value=x"), ("DELETE", "/buckets/per_key?value=x"), ("GET", "/top-limited"), ("GET", "/config"),
     ("GET", "/stats")],
)
async def test_the_admin_api_needs_the_token_when_one_is_configured(upstream, client, method, path):
    text = limits_config(upstream) + "admin_token_env: ADMIN_TOKEN\n"
    async with running_gateway(config_from_yaml(text, environ={"ADMIN_TOKEN": ADMIN_TOKEN})) as gw:
        refused = await call(client, method, gw.admin_url + path, expect=401)
        assert refused["status"] == 401
        await call(client, method, gw.admin_url + path, expect=401, token=ADMIN_TOKEN[:-1] + "X")
        await call(client, method, gw.admin_url + path, expect=200, token=ADMIN_TOKEN)


@pytest.mark.parametrize(
    "method, path",
    [("GET", "/buckets/per_key?value=x"), ("DELETE", "/buckets/per_key?value=x"), ("GET", "/top-limited"), ("GET", "/config"),
     ("GET", "/stats"), ("GET", "/")],
)
async def test_the_admin_api_is_404_on_the_public_listener(upstream, client, method, path):
    async with running_gateway(limits_config(upstream)) as gw:
        assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]
        answer = await call(client, method, gw.url + path, expect=404)
        # Nothing was reset: the public listener never reached the admin API.
        assert await statuses(client, gw.url, API_KEY, 1) == [429]
    assert answer["status"] == 404 and "per_key" not in json.dumps(answer)


async def test_inspect_and_reset_answer_503_while_the_store_is_down(upstream, client):
    redis_server = RedisServer()  # its port is chosen now; nothing listens there
    store = f"store: {{url: '{redis_server.url}'}}"
    async with running_gateway(limits_config(upstream, store)) as gw:
        for method in ("GET", "DELETE"):
            down = await call(client, method, f"{gw.admin_url}/buckets/per_key?value={API_KEY}", expect=503)
            assert down["title"] == "Service Unavailable" and "store" in down["detail"]


async def test_a_reset_while_the_store_is_down_frees_the_client_from_the_local_stand_in(upstream, client):
    redis_server = RedisServer()  # nothing listens: every check falls back to the local bucket
    config = f"""
store: {{url: '{redis_server.url}', local_divisor: 1}}
limits:
  per_key: {{rate: 1/hour, burst: 2, key: header:X-Api-Key, on_store_error: local}}
routes:
  - match: {{path: /api}}
    upstream: {upstream}
    limits: [per_key]
"""
    async with running_gateway(config) as gw:
        assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]
        await call(client, "DELETE", f"{gw.admin_url}/buckets/per_key?value={API_KEY}", expect=503)
        assert await statuses(client, gw.url, API_KEY, 3) == [200, 200, 429]
        top = await call(client, "GET", gw.admin_url + "/top-limited", expect=200)
    assert [(c["limit"], c["denials"]) for c in top["clients"]] == [("per_key", 2)]  # local denials count too


@pytest.mark.parametrize(("key", "source"), [("ip", ""), ("ip/24", ""), ("[header:X-User, ip]", "source=ip&")])
async def test_an_address_names_the_bucket_its_requests_spent_and_reset_frees_it(upstream, client, redis_server, key, source):
    # The default ip key holds a whole address as itself (not as its /32): inspecting and
    # resetting it by ?value=ADDRESS must reach that bucket, on Redis as in-process.
    text = f"""
store: {{url: '{redis_server.url}'}}
limits:
  per_ip: {{rate: 1/hour, burst: 2, key: {key}}}
routes:
  - match: {{path: /}}
    upstream: {upstream}
    limits: [per_ip]
"""
    async with running_gateway(config_from_yaml(text)) as gw:
        for expected in (200, 200, 429):
            async with client.get(gw.url + "/echo") as response:
                assert response.status == expected
        bucket = f"{gw.admin_url}/buckets/per_ip?{source}value=127.0.0.1"
        spent = await call(client, "GET", bucket, expect=200)
        assert spent["held"] is True and spent["tokens"] == pytest.approx(0, abs=0.01)
        assert redis_server.client().exists(spent["key"]) == 1
        assert (await call(client, "DELETE", bucket, expect=200))["held"] is True
        async with client.get(gw.url + "/echo") as response:
            assert response.status == 200
        if key == "ip/24":  # every client has an address: no bucket is ever keyed by the whole one
            refused = await call(client, "GET", f"{gw.admin_url}/buckets/per_ip?source=ip&value=127.0.0.1", expect=400)
            assert refused["sources"] == ["ip/24"]


async def test_stats_has_each_pool_targets_routes_health_and_exact_counters(upstream, client):
    """/a's pool tries `dead` (nothing listens) first: refused, ejected and retried on `live`;
    every later request goes to `live`. /c's only target is `dead`, out of rotation, so each of
    its requests is a 503 for want of a target. `checked` is the one target health-checked."""
    dead = f"http://127.0.0.1:{free_port()}"
    passive = "passive: {eject_after: 1, eject_for: 1h}"
    async with running_upstream() as checked:
        config = f"""
routes:
  - match: {{path: /a}}
    upstream: {{targets: [{{url: "{dead}", name: dead}}, {{url: "{upstream}", name: live}}], {passive}, retries: 1}}
  - match: {{path: /b}}
    upstream: {{targets: [{{url: "{checked}", name: checked}}], health: {{path: /status/200, interval: 1h}}}}
  - match: {{path: /c}}
    upstream: {{targets: [{{url: "{dead}", name: dead}}], {passive}}}
  - match: {{path: /plain}}
    upstream: {upstream}
"""
        async with running_gateway(config) as gw:
            for path, count, status in (("/a", 5, 200), ("/b", 3, 200), ("/c", 2, 503), ("/plain", 1, 200)):
                for _ in range(count):
                    async with client.get(gw.url + path) as response:
                        assert response.status == status, path
            stats = await call(client, "GET", gw.admin_url + "/stats", expect=200)
    assert stats["workers"] == 1
    none = {"5xx": 0, "connect": 0, "reset": 0, "timeout": 0}  # every kind, counted from 0
    assert stats["targets"] == [
        {"target": "dead", "url": dead, "routes": ["/a", "/c"], "checked": False, "healthy": None,
         "requests": 1, "errors": {**none, "connect": 1}, "ejections": 1},
        {"target": "live", "url": upstream, "routes": ["/a"], "checked": False, "healthy": None,
         "requests": 5, "errors": none, "ejections": 0},
        {"target": "checked", "url": checked, "routes": ["/b"], "checked": True, "healthy": 1,
         "requests": 3, "errors": none, "ejections": 0},
    ]
    counted = {(u["route"], u["reason"]): u["total"] for u in stats["unavailable"]}
    assert counted == {
        ("/a", "no_target"): 0, ("/a", "queue_full"): 0, ("/b", "no_target"): 0, ("/b", "queue_full"): 0,
        ("/c", "no_target"): 2, ("/c", "queue_full"): 0, ("/plain", "queue_full"): 0,
    }


async def test_stats_has_no_targets_without_a_pool(upstream, client):
    async with running_gateway(limits_config(upstream)) as gw:
        stats = await call(client, "GET", gw.admin_url + "/stats", expect=200)
    assert stats["targets"] == []
    assert {u["total"] for u in stats["unavailable"]} == {0}  # each route's queue_full, at 0
