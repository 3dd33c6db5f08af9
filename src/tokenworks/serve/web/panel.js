// The engine panel: /engine/state once a second, each figure with a sparkline of its last
// minute. Counts since start become rates between two polls.

import { api, errorText, el } from "/ui/api.js";

const SVG = "http://www.w3.org/2000/svg";
const KEEP = 60;
const history = new Map(); // figure key -> recent values
let previous = null;

function sparkline(values) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 60 16");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "spark");
  svg.setAttribute("aria-hidden", "true");
  const finite = values.filter((v) => Number.isFinite(v));
  if (finite.length > 1) {
    const hi = Math.max(...finite), lo = Math.min(0, ...finite);
    const span = hi - lo || 1;
    const points = values.map((v, i) => {
      const x = 60 - (60 * (values.length - 1 - i)) / (KEEP - 1); // the newest at the right
      const y = 15 - (14 * ((Number.isFinite(v) ? v : lo) - lo)) / span;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", points.join(" "));
    svg.append(line);
  }
  return svg;
}

function figure(key, label, value, shown) {
  const values = history.get(key) || [];
  values.push(value);
  while (values.length > KEEP) values.shift();
  history.set(key, values);
  return el("div", { class: "figure", "data-figure": key },
    el("span", { class: "label", text: label }),
    el("span", { class: "value", text: shown !== undefined ? shown : (Number.isFinite(value) ? String(value) : "–") }),
    sparkline(values));
}

const pct = (x) => (Number.isFinite(x) ? (100 * x).toFixed(0) + "%" : "–");

function engineFigures(e, before, dt) {
  const k = e.model + "/" + e.engine + "/";
  const out = [el("h3", { text: e.model + (e.engine ? " · engine " + e.engine : "") })];
  out.push(figure(k + "running", "requests running", e.running));
  out.push(figure(k + "waiting", "requests waiting", e.waiting));
  const rate = before && dt > 0 ? Math.max(0, (e.generation_tokens - before.generation_tokens) / dt) : NaN;
  out.push(figure(k + "tok_s", "tokens a second", rate, Number.isFinite(rate) ? rate.toFixed(1) : "–"));
  if (e.kv) {
    out.push(figure(k + "kv", "KV blocks used", e.kv.used, e.kv.used + " of " + e.kv.blocks + " (" + e.kv.free + " free)"));
    e.kv.groups.forEach((g, i) => {
      const label = "  group " + i + (g.window ? " (window " + g.window + ")" : " (whole context)");
      out.push(figure(k + "kv" + i, label, g.blocks, g.blocks + " blocks"));
    });
  }
  if (e.prefix) {
    const p = e.prefix, b = before && before.prefix;
    const asked = b ? p.queried_tokens - b.queried_tokens : 0;
    const hit = asked > 0 ? (p.hit_tokens - b.hit_tokens) / asked : NaN;
    const total = p.queried_tokens ? p.hit_tokens / p.queried_tokens : NaN;
    out.push(figure(k + "prefix", "prefix cache hits", hit, pct(total) + " of prompt tokens"));
    const reasons = Object.entries(p.misses).map(([r, n]) => r + " " + n).join(", ");
    out.push(el("div", { class: "figure misses", "data-figure": k + "misses" },
      el("span", { class: "label", text: "misses by reason" }), el("span", { class: "value", text: reasons || "none" })));
  }
  if (e.speculation) {
    const s = e.speculation;
    out.push(figure(k + "accept", "guesses accepted", s.acceptance_rate, pct(s.acceptance_rate)));
    out.push(figure(k + "proposing", "sequences guessing", s.proposing, s.proposing + " (" + s.held_back + " held back" + (s.guessing_loses ? ", guessing loses" : "") + ")"));
  }
  return out;
}

export function startPanel(box, status) {
  async function poll() {
    try {
      const response = await api("/engine/state");
      if (!response.ok) throw new Error(await errorText(response));
      const state = await response.json();
      const dt = previous ? state.at - previous.at : 0;
      const before = new Map((previous ? previous.engines : []).map((e) => [e.model + "/" + e.engine, e]));
      box.replaceChildren(...state.engines.flatMap((e) => engineFigures(e, before.get(e.model + "/" + e.engine), dt)));
      previous = state;
      status.textContent = "";
    } catch (e) {
      status.textContent = "engine state: " + e.message;
    }
    setTimeout(poll, 1000);
  }
  poll();
}
