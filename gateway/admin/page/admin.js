// The admin page: polls /stats, /readyz and /top-limited and shows them: status, charts of
// the last few minutes (charts.js), routes, upstream pool targets, limits and the top limited
// clients. Every value from the gateway reaches the DOM as textContent, never as markup.
"use strict";

const POLL_MS = 1000;
const RATE_WINDOW_S = 5; // rates are the change in each counter over about this long
const TOKEN_KEY = "gateway-admin-token";
const STATUS_CLASSES = ["2xx", "4xx", "5xx"];
const OTHER_DECISIONS = [
  "skipped", "shadow_limited", "delayed", "allowlisted", "concurrency_limited", "fail_open", "fail_closed", "fail_local",
];

const byId = (id) => document.getElementById(id);
const needsToken = document.documentElement.dataset.auth === "bearer";
const history = new History(HISTORY_S); // the charts' and the rates' polls, in this tab only
let timer = null;
let polling = false;

class Unauthorized extends Error {}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

async function getJSON(path, okStatuses = [200]) {
  const headers = {};
  if (token()) headers.Authorization = "Bearer " + token();
  const response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
  if (response.status === 401) throw new Unauthorized();
  if (!okStatuses.includes(response.status)) throw new Error(path + " answered " + response.status);
  return response.json();
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells, attributes = {}) {
  const tr = document.createElement("tr");
  for (const [name, value] of Object.entries(attributes)) tr.dataset[name] = value;
  for (const cell of cells) tr.append(cell);
  return tr;
}

function fill(tableId, rows, emptyText, columns) {
  const body = byId(tableId).tBodies[0];
  if (rows.length === 0) {
    const td = el("td", emptyText, "muted");
    td.colSpan = columns;
    rows = [row([td])];
  }
  body.replaceChildren(...rows);
}

// Green for true, red for false, plain for null.
function markState(node, good) {
  node.classList.toggle("good", good === true);
  node.classList.toggle("bad", good === false);
}

function setState(id, text, good) {
  const node = byId(id);
  node.textContent = text;
  markState(node, good);
}

function rateText(value) {
  if (value === null) return "–";
  return value >= 100 ? value.toFixed(0) : value >= 10 ? value.toFixed(1) : value.toFixed(2);
}

// Counters by one key string, summed over the labels left out of the key.
function totalsOf(stats) {
  const totals = new Map();
  const add = (key, value) => totals.set(key, (totals.get(key) || 0) + value);
  for (const r of stats.requests) {
    add("req\u0000" + r.route, r.total);
    add("req\u0000" + r.route + "\u0000" + r.status_class, r.total);
  }
  for (const d of stats.decisions) add("dec\u0000" + d.route + "\u0000" + d.limit + "\u0000" + d.decision, d.total);
  for (const t of stats.targets) {
    add("tgt\u0000" + t.target, t.requests);
    for (const count of Object.values(t.errors)) add("tgterr\u0000" + t.target, count);
  }
  return totals;
}

function remember(stats) {
  history.add({ time: stats.time, totals: totalsOf(stats), latency: stats.limiter_latency, breaker: stats.breaker });
}

// Per second over the last RATE_WINDOW_S (from the last poll at or before its start);
// null until two polls, or across a restart.
function rate(key) {
  const samples = history.samples;
  if (samples.length < 2) return null;
  const last = samples[samples.length - 1];
  let first = samples.length - 2;
  while (first > 0 && samples[first].time > last.time - RATE_WINDOW_S) first--;
  const seconds = last.time - samples[first].time;
  const change = (last.totals.get(key) || 0) - (samples[first].totals.get(key) || 0);
  if (seconds <= 0 || change < 0) return null;
  return change / seconds;
}

function total(key) {
  return history.samples.length ? history.samples[history.samples.length - 1].totals.get(key) || 0 : 0;
}

// The labels of the routes counted: those served now, then unmatched requests and routes a reload removed.
function routeLabels(stats) {
  const labels = stats.routes.map((r) => r.route);
  for (const r of stats.requests) if (!labels.includes(r.route)) labels.push(r.route);
  return labels;
}

function showCharts(stats) {
  const span = history.span;
  const counted = (key) => (sample) => sample.totals.get(key);
  const limits = [];
  for (const route of stats.routes) {
    for (const { name } of route.limits) {
      const key = "dec\u0000" + route.route + "\u0000" + name + "\u0000";
      // Refused by a rate limit (deny) or by a concurrency limit (concurrency_limited): a limit has only one of them.
      const limited = (s) => (s.totals.get(key + "deny") || 0) + (s.totals.get(key + "concurrency_limited") || 0);
      const series = [
        { name: "allowed", points: history.rates(counted(key + "allow")) },
        { name: "limited", points: history.rates(limited) },
      ];
      limits.push(chartCard(name + " on " + route.route, lineChart(series, span, "/s", 1),
        [["allowed", "allowed/s"], ["limited", "limited/s"]], { chart: "limit", route: route.route, limit: name }));
    }
  }
  byId("charts-limits").replaceChildren(...limits);
  const routes = routeLabels(stats).map((label) => {
    const series = STATUS_CLASSES.map((c) => ({ name: c, points: history.rates(counted("req\u0000" + label + "\u0000" + c)) }));
    const legend = STATUS_CLASSES.map((c) => [c, c + "/s"]);
    return chartCard(label, lineChart(series, span, "/s", 1), legend, { chart: "route", route: label });
  });
  byId("charts-routes").replaceChildren(...routes);
  const latency = [
    { name: "p50", points: history.latency(quantile(0.5)) },
    { name: "p99", points: history.latency(quantile(0.99)) },
    { name: "mean", points: history.latency(mean) },
  ];
  byId("charts-store").replaceChildren(
    chartCard("Limiter latency, store included", lineChart(latency, span, " ms", 1),
      [["p50", "p50"], ["p99", "p99"], ["mean", "mean"]], { chart: "latency" }),
    chartCard("Store circuit breaker", stateChart(history.samples, span),
      BREAKER_STATES.map((state) => [state, state]), { chart: "breaker" }),
  );
}

function showStatus(stats, ready) {
  byId("version").textContent = stats.version;
  setState("store-state", ready.store_state, ready.store_state === "ok");
  byId("store").textContent = ready.store;
  const states = Object.entries(stats.breaker).filter(([, count]) => count > 0);
  const workers = states.reduce((sum, [, count]) => sum + count, 0);
  let breaker;
  if (states.length === 0) breaker = ready.breaker;
  else if (states.length === 1) breaker = states[0][0] + (workers > 1 ? " (" + workers + " workers)" : "");
  else breaker = states.map(([state, count]) => state + " " + count).join(" · ");
  setState("breaker", breaker, breaker.startsWith("closed"));
  setState("ready", ready.ready ? "yes" : ready.draining ? "no (draining)" : "no", ready.ready);
  const last = stats.reload.last_success;
  if (last) {
    const when = new Date(last * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
    byId("reload-success").textContent = when + " (" + Math.max(0, Math.round(stats.time - last)) + " s ago)";
  } else {
    byId("reload-success").textContent = "none since start";
  }
  setState("reload-failures", String(stats.reload.failures), stats.reload.failures === 0);
  byId("in-flight").textContent = String(stats.in_flight);
  byId("shed").textContent = String(stats.shed);
}

function showRoutes(stats) {
  const labels = routeLabels(stats);
  const configured = new Map(stats.routes.map((r) => [r.route, r]));
  const rows = labels.map((label) => {
    const route = configured.get(label);
    const key = "req\u0000" + label;
    return row(
      [
        el("td", label, "route"),
        el("td", route ? route.upstream : "", "muted"),
        el("td", route ? route.limits.map((l) => l.name).join(", ") || "none" : ""),
        el("td", rateText(rate(key)), "num rate"),
        ...STATUS_CLASSES.map((c) => el("td", rateText(rate(key + "\u0000" + c)), "num rate-" + c)),
        el("td", total(key), "num total"),
      ],
      { route: label },
    );
  });
  fill("routes", rows, "No routes.", 8);
}

// A target's health as [text, good]: the workers whose checks see it healthy, with several.
function targetHealth(target, workers) {
  if (!target.checked) return ["not checked", null];
  if (target.healthy === null) return ["not checked yet", null];
  if (workers > 1) {
    const all = target.healthy === workers ? true : target.healthy === 0 ? false : null;
    return [target.healthy + " of " + workers + " workers see it healthy", all];
  }
  return target.healthy > 0 ? ["healthy", true] : ["unhealthy", false];
}

function showTargets(stats) {
  const rows = stats.targets.map((t) => {
    const [text, good] = targetHealth(t, stats.workers);
    const state = el("span", text, "state");
    markState(state, good);
    const stateCell = el("td", undefined, "health");
    stateCell.append(state);
    const kinds = Object.entries(t.errors).filter(([, count]) => count > 0).map(([kind, count]) => kind + " " + count);
    const errors = total("tgterr\u0000" + t.target);
    return row(
      [
        el("td", t.target, "target"),
        el("td", t.url, "muted"),
        el("td", t.routes.join(", "), "routes"),
        stateCell,
        el("td", rateText(rate("tgt\u0000" + t.target)), "num rate"),
        el("td", rateText(rate("tgterr\u0000" + t.target)), "num error-rate"),
        el("td", total("tgt\u0000" + t.target), "num total"),
        el("td", kinds.length ? errors + " (" + kinds.join(" · ") + ")" : errors, "num errors"),
        el("td", t.ejections, "num ejections"),
      ],
      { target: t.target },
    );
  });
  fill("targets", rows, "No pools configured.", 9);
  const refused = stats.unavailable.filter((u) => u.total > 0).map((u) => u.route + " " + u.reason + " " + u.total);
  byId("unavailable").textContent =
    "Answered 503 for want of a target in rotation (no_target) or a free upstream connection (queue_full): " +
    (refused.join(" · ") || "none") + ".";
}

function showLimits(stats) {
  const limits = new Map(stats.limits.map((l) => [l.name, l]));
  const rows = [];
  for (const route of stats.routes) {
    for (const { name, cost } of route.limits) {
      const limit = limits.get(name);
      const shape = limit.concurrency ? limit.concurrency + " in flight" : limit.rate + ", burst " + limit.burst;
      const policy = [shape, "by " + limit.key.join(" + ")];
      if (cost !== 1) policy.push("cost " + cost);
      policy.push("store down: " + limit.on_store_error);
      if (limit.shadow) policy.push("shadow");
      const key = (decision) => "dec\u0000" + route.route + "\u0000" + name + "\u0000" + decision;
      const others = OTHER_DECISIONS.filter((d) => total(key(d)) > 0).map((d) => d + " " + total(key(d)));
      rows.push(
        row(
          [
            el("td", route.route, "route"),
            el("td", name, "limit"),
            el("td", policy.join(", "), "muted"),
            el("td", rateText(rate(key("allow"))), "num allowed-rate"),
            el("td", rateText(rate(key("deny"))), "num limited-rate"),
            el("td", total(key("allow")), "num allowed"),
            el("td", total(key("deny")), "num limited"),
            el("td", others.join(" · "), "other"),
          ],
          { route: route.route, limit: name },
        ),
      );
    }
  }
  fill("limits", rows, "No route has a limit.", 8);
}

function showTop(top) {
  const rows = top.clients.map((c) =>
    row(
      [
        el("td", c.limit, "limit"),
        el("td", c.identity, "identity"),
        el("td", c.error ? c.denials + " (±" + c.error + ")" : c.denials, "num denials"),
      ],
      { limit: c.limit },
    ),
  );
  fill("top", rows, "No client was limited lately.", 3);
  byId("top-note").textContent =
    "Denied most by the worker that answered, over the last " + top.window_seconds + " to " +
    2 * top.window_seconds + " s; identities " + top.identities + ".";
}

function showProblem(text) {
  const node = byId("problem");
  node.textContent = text || "";
  node.hidden = !text;
}

function askForToken(refused) {
  sessionStorage.removeItem(TOKEN_KEY);
  history.clear();
  byId("data").hidden = true;
  byId("forget").hidden = true;
  byId("login").hidden = false;
  byId("updated").textContent = "waiting for the admin token";
  showProblem(refused ? "The token was refused." : "");
  byId("token").focus();
}

async function poll() {
  if (polling) return;
  polling = true;
  try {
    // Every request settles before the page decides: none is still on its way with a refused token.
    const answers = await Promise.allSettled([
      getJSON("stats"),
      getJSON("readyz", [200, 503]),
      getJSON("top-limited?n=10"),
    ]);
    const failed = answers.filter((answer) => answer.status === "rejected").map((answer) => answer.reason);
    if (failed.length) throw failed.find((reason) => reason instanceof Unauthorized) || failed[0];
    const [stats, ready, top] = answers.map((answer) => answer.value);
    if (needsToken && !token()) return; // forgotten while this poll was on its way
    remember(stats);
    showStatus(stats, ready);
    showCharts(stats);
    showRoutes(stats);
    showTargets(stats);
    showLimits(stats);
    showTop(top);
    showProblem("");
    byId("data").hidden = false;
    byId("forget").hidden = !token();
    byId("updated").textContent =
      "updated " + new Date(stats.time * 1000).toISOString().slice(11, 19) + " UTC, every " + POLL_MS / 1000 + " s";
    schedule();
  } catch (error) {
    if (error instanceof Unauthorized) {
      askForToken(true);
    } else {
      showProblem("The admin listener did not answer: " + error.message);
      schedule();
    }
  } finally {
    polling = false;
  }
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(poll, POLL_MS);
}

byId("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const given = byId("token").value.trim();
  if (!given) return;
  sessionStorage.setItem(TOKEN_KEY, given);
  byId("token").value = "";
  byId("login").hidden = true;
  showProblem("");
  byId("updated").textContent = "loading…";
  poll();
});

byId("forget").addEventListener("click", () => {
  clearTimeout(timer);
  askForToken(false);
});

if (needsToken && !token()) askForToken(false);
else poll();
