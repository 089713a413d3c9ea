// The admin page's charts: the /stats answers of the last few minutes, kept in this tab
// (a bounded history, oldest dropped first), the per-second series computed from them,
// and small SVG line charts this script draws itself, since the page's policy lets no
// other script run. Values reach the SVG as numbers and text nodes, never as markup.
// Each drawn line carries its data as data-* attributes, which the page's test reads.
"use strict";

const HISTORY_S = 300; // five minutes of polls
const SHORTEST_SPAN_S = 30; // a page open for less than this still draws this much time
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { width: 360, height: 120, left: 44, right: 6, top: 8, bottom: 18 };
// Breaker states, the worst first: with several workers the strip shows the worst one.
const BREAKER_STATES = ["open", "half_open", "closed"];

class History {
  constructor(seconds) {
    this.seconds = seconds;
    this.samples = []; // [{time, totals: Map, latency, breaker}], oldest first
  }

  clear() {
    this.samples = [];
  }

  add(sample) {
    const last = this.samples[this.samples.length - 1];
    // The gateway's clock went back: its earlier answers cannot be placed against this one.
    if (last && sample.time <= last.time) this.clear();
    this.samples.push(sample);
    while (this.samples[0].time < sample.time - this.seconds) this.samples.shift();
  }

  // The time the charts span: the history kept, at least SHORTEST_SPAN_S, up to the last poll.
  get span() {
    const end = this.samples.length ? this.samples[this.samples.length - 1].time : 0;
    const first = this.samples.length ? this.samples[0].time : end;
    return { start: Math.min(first, end - SHORTEST_SPAN_S), end };
  }

  // For each interval between two polls: its end time, its length, the increase of the
  // counter `value(sample)` reads (a missing series counts 0), and that increase per second.
  // A counter that went down was reset (a restart): that interval has no rate, never a negative one.
  rates(value) {
    const points = [];
    for (let i = 1; i < this.samples.length; i++) {
      const before = this.samples[i - 1];
      const after = this.samples[i];
      const seconds = after.time - before.time;
      const increase = (value(after) || 0) - (value(before) || 0);
      const valid = increase >= 0 && seconds > 0;
      points.push({ time: after.time, seconds, increase: valid ? increase : null, value: valid ? increase / seconds : null });
    }
    return points;
  }

  // The limiter's latency in each interval, in milliseconds: `pick(change)` of the histogram's
  // change between two polls; no value where nothing was timed or the counts were reset.
  latency(pick) {
    const points = [];
    for (let i = 1; i < this.samples.length; i++) {
      const before = this.samples[i - 1].latency;
      const after = this.samples[i].latency;
      const count = after.count - before.count;
      const buckets = after.buckets.map(([bound, n], j) => [bound, n - (before.buckets[j] ? before.buckets[j][1] : 0)]);
      const valid = count > 0 && buckets.every(([, n]) => n >= 0);
      const value = valid ? pick({ count, sum: after.sum - before.sum, buckets }) : null;
      points.push({ time: this.samples[i].time, seconds: this.samples[i].time - this.samples[i - 1].time, value });
    }
    return points;
  }
}

// The q-quantile of a histogram's change, in ms, interpolated within its bucket as
// Prometheus's histogram_quantile does; past the last finite bound, that bound.
function quantile(q) {
  return ({ count, buckets }) => {
    const rank = q * count;
    let lower = 0;
    let below = 0;
    for (const [bound, cumulative] of buckets) {
      if (cumulative >= rank) {
        const share = cumulative > below ? (rank - below) / (cumulative - below) : 1;
        return 1000 * (lower + (bound - lower) * share);
      }
      lower = bound;
      below = cumulative;
    }
    return 1000 * lower;
  };
}

function mean({ count, sum }) {
  return (1000 * sum) / count;
}

function breakerState(counts) {
  return BREAKER_STATES.find((state) => (counts[state] || 0) > 0) || "unknown";
}

function svg(tag, attributes = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  return node;
}

// A round number at or above `value`, for the top of a chart's scale.
function niceCeiling(value) {
  const step = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 2.5, 5, 10].map((m) => m * step).find((top) => top >= value);
}

function scaleText(value, unit) {
  const digits = value >= 10 ? 0 : value >= 1 ? 1 : 2;
  return value.toFixed(digits) + unit;
}

function plotArea() {
  return {
    x0: CHART.left,
    x1: CHART.width - CHART.right,
    y0: CHART.top,
    y1: CHART.height - CHART.bottom,
  };
}

function spanText(seconds) {
  return seconds >= 120 ? "−" + Math.round(seconds / 60) + " min" : "−" + Math.round(seconds) + " s";
}

function frame(node, span, top, unit) {
  const area = plotArea();
  node.append(
    svg("rect", { class: "plot", x: area.x0, y: area.y0, width: area.x1 - area.x0, height: area.y1 - area.y0 }),
    svg("line", { class: "grid", x1: area.x0, x2: area.x1, y1: (area.y0 + area.y1) / 2, y2: (area.y0 + area.y1) / 2 }),
  );
  const label = (text, x, y, anchor) => {
    const t = svg("text", { x, y, "text-anchor": anchor });
    t.textContent = text;
    node.append(t);
  };
  if (top !== null) {
    label(scaleText(top, unit), area.x0 - 4, area.y0 + 8, "end");
    label("0", area.x0 - 4, area.y1, "end");
  }
  label(spanText(span.end - span.start), area.x0, CHART.height - 4, "start");
  label(span.end ? new Date(span.end * 1000).toISOString().slice(11, 19) + " UTC" : "", area.x1, CHART.height - 4, "end");
}

function xOf(time, span) {
  const area = plotArea();
  return area.x0 + ((time - span.start) / (span.end - span.start)) * (area.x1 - area.x0);
}

// A line chart of `series` ([{name, points}]) over `span`; a point without a value breaks its line.
function lineChart(series, span, unit, minimumTop) {
  const node = svg("svg", { viewBox: "0 0 " + CHART.width + " " + CHART.height, role: "img" });
  const highest = Math.max(0, ...series.flatMap((s) => s.points.map((p) => p.value || 0)));
  const top = niceCeiling(Math.max(highest, minimumTop));
  frame(node, span, top, unit);
  const area = plotArea();
  for (const s of series) {
    let d = "";
    let drawing = false;
    for (const p of s.points) {
      if (p.value === null) {
        drawing = false;
        continue;
      }
      const y = area.y1 - (p.value / top) * (area.y1 - area.y0);
      d += (drawing ? "L" : "M") + xOf(p.time, span).toFixed(1) + " " + y.toFixed(1);
      drawing = true;
    }
    const path = svg("path", { class: "line s-" + s.name, d: d || "M0 0" });
    path.dataset.series = s.name;
    path.dataset.times = s.points.map((p) => p.time).join(",");
    path.dataset.seconds = s.points.map((p) => p.seconds).join(",");
    path.dataset.values = s.points.map((p) => (p.value === null ? "" : p.value)).join(",");
    node.append(path);
  }
  return node;
}

// The breaker's state at each poll, as a strip of bands.
function stateChart(samples, span) {
  const node = svg("svg", { viewBox: "0 0 " + CHART.width + " " + CHART.height, role: "img" });
  frame(node, span, null, "");
  const area = plotArea();
  const strip = svg("g", { class: "states" });
  strip.dataset.times = samples.map((s) => s.time).join(",");
  strip.dataset.states = samples.map((s) => breakerState(s.breaker)).join(",");
  samples.forEach((sample, i) => {
    const x = xOf(i > 0 ? samples[i - 1].time : sample.time - 1, span);
    const width = Math.max(1, xOf(sample.time, span) - x);
    const state = breakerState(sample.breaker);
    strip.append(svg("rect", { class: "s-" + state, x: Math.max(area.x0, x), y: area.y0 + 20, width, height: 40 }));
  });
  node.append(strip);
  return node;
}

function chartCard(title, chart, legend, attributes) {
  const figure = document.createElement("figure");
  figure.className = "chart";
  for (const [name, value] of Object.entries(attributes)) figure.dataset[name] = value;
  const caption = document.createElement("figcaption");
  const heading = document.createElement("span");
  heading.className = "title";
  heading.textContent = title;
  caption.append(heading);
  for (const [name, text] of legend) {
    const key = document.createElement("span");
    key.className = "key s-" + name;
    key.textContent = text;
    caption.append(key);
  }
  figure.append(caption, chart);
  return figure;
}
