"""The admin listener: /metrics, /healthz, /readyz, the admin API and its page. Never
served on the public listener; bind it to a private address (the default is 127.0.0.1:9090).

Trusts whoever can reach it, unless `admin_token_env` names a bearer token (app.py).
Against DNS rebinding, only a Host that names the listener by address, `localhost` or a
name in `admin_hosts` is answered, and a foreign Origin cannot change state (hosts.py).

The admin API (JSON; errors as problem+json):
- `GET /buckets/{limit}?value=V[&source=S][&tier=T]`: the bucket of one client, named
  by its raw identity value, which is hashed as on a request. `source` picks which of
  the limit's key sources the value came from; it may be left out when there is one.
  A composite source (`header:X-API-Key+path`) takes one `value` per part, in order; a
  global one none. `tier` picks a tier's bucket; by default, the tier a key file gives
  the value, else the default tier.
- `DELETE /buckets/{limit}?value=V[&source=S]`: reset that bucket to full, in the
  store and in the denial cache of this process and of its sibling workers
  (`gateway.limiter.worker_resets`).
- Both for a concurrency limit: the client's live leases (`in_flight`, counted by the
  store's clock, so a dead gateway's expired leases count for nothing) and their
  expiries; DELETE drops them, so the client is admitted again while the requests that
  held them go on (`Concurrency.reset` says what their renewals do then).
- `GET /top-limited?n=N`: the clients this process denied most over the last one to
  two minutes (`gateway.limiter.top_limited`), hashed unless `admin_raw_identities`.
  These and the bucket routes are buckets.py.
- `GET /config`: the config in force as the YAML spells it, defaults listed and every
  secret replaced by "***" (config_view.py).
- `GET /stats`: the routes and limits served now, the pool targets with their routes,
  and the gateway's counter totals (summed over the workers; a target's health gauge
  counts the workers that see it healthy), for the page, which computes rates from the
  change between polls (stats.py).

The page (`/`, with `/admin.js`, `/charts.js` and `/admin.css`, from page/) holds no data: it is
served without the token, and its script asks for the token and sends it on every
fetch of the data paths above, which still answer 401 without it.
"""

from gateway.admin.app import AdminApi, admin_app

__all__ = ["AdminApi", "admin_app"]
