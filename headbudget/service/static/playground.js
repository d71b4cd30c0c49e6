// The playground: reads /v1/models once (labels, the budget grid, the accuracy curve), then posts /classify with
// the key, text and budget from the form. Relative URLs, so that it works behind a path prefix too.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";
let card = null; // the served checkpoint, from /v1/models
let marked = null; // the budget marked on the curve

const pct = (x, digits = 1) => `${(100 * x).toFixed(digits)}%`;
const ms = (x) => `${x.toFixed(x < 10 ? 2 : 1)} ms`;
const sliderBudget = () => Math.round(Number($("budget").value) * 100) / 100;

// The grid point nearest a budget (the grid is the sweep's budgets, or the service's).
function pointAt(budget) {
  if (!card || card.budgets.length === 0) return null;
  return card.budgets.reduce((a, b) => (Math.abs(b.budget - budget) < Math.abs(a.budget - budget) ? b : a));
}

function layersOf(point) {
  const run = point && point.layers_run !== null ? point.layers_run : card.n_layers;
  return `${run} of ${card.n_layers}`;
}

function describePlan() {
  if (!card) return;
  if ($("auto").checked) {
    const who = card.decider ? `its ${card.decider} decider picks` : "the checkpoint picks";
    $("plan").textContent = `auto: ${who} each text's budget`;
    return;
  }
  const b = sliderBudget();
  const p = pointAt(b);
  if (!p) return;
  const at = Math.abs(p.budget - b) < 1e-6 ? `at ${b.toFixed(2)}` : `nearest grid budget ${p.budget.toFixed(2)}`;
  const parts = [`${p.heads_active} of ${card.heads_total} heads`];
  if (p.neurons_active !== null) parts.push(`${p.neurons_active} neurons`);
  parts.push(`${layersOf(p)} layers`);
  if (p.accuracy !== null) parts.push(`offline accuracy ${pct(p.accuracy)}`);
  if (p.latency_ms !== null) {
    parts.push(`about ${ms(p.latency_ms)} per text` + (p.latency_tokens ? ` of ${p.latency_tokens} tokens` : ""));
  }
  $("plan").textContent = `${at}: ${parts.join(" · ")}`;
}

function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// An accuracy axis from lo to hi in at most 6 round steps (whole or half percents).
function niceRange(min, max) {
  const step = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2].find((s) => Math.ceil(max / s) - Math.floor(min / s) <= 6) || 0.2;
  const lo = Math.max(0, Math.floor(min / step) * step), hi = Math.min(1, Math.ceil(max / step) * step);
  return hi > lo ? { lo, hi, step } : { lo: Math.max(0, lo - step), hi: Math.min(1, hi + step), step };
}

function drawCurve() {
  const svg = $("curve");
  svg.replaceChildren();
  const pts = card ? card.budgets.filter((p) => p.accuracy !== null) : [];
  if (pts.length === 0) {
    $("curve-note").textContent = "This checkpoint has no sweep.json: no offline accuracy to draw.";
    return;
  }
  const W = 440, H = 300, L = 52, R = 14, T = 14, B = 40;
  const accs = pts.map((p) => p.accuracy).concat(card.dense_accuracy !== null ? [card.dense_accuracy] : []);
  const { lo, hi, step } = niceRange(Math.min(...accs), Math.max(...accs));
  const x = (b) => L + ((b - 0.1) / 0.9) * (W - L - R);
  const y = (a) => T + (1 - (a - lo) / (hi - lo)) * (H - T - B);
  for (let a = lo; a <= hi + step / 2; a += step) {
    svg.append(el("line", { class: "grid", x1: L, x2: W - R, y1: y(a), y2: y(a) }));
    svg.append(el("text", { x: L - 6, y: y(a) + 4, "text-anchor": "end" }, pct(a, step < 0.01 ? 1 : 0)));
  }
  for (let b = 0.1; b <= 1.0001; b += 0.1) {
    svg.append(el("text", { x: x(b), y: H - B + 16, "text-anchor": "middle" }, b.toFixed(1)));
  }
  svg.append(el("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  svg.append(el("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  svg.append(el("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "muted" }, "budget"));
  if (card.dense_accuracy !== null) {
    const yd = y(card.dense_accuracy);
    svg.append(el("line", { class: "dense", x1: L, x2: W - R, y1: yd, y2: yd }));
    svg.append(el("text", { x: W - R, y: yd - 4, "text-anchor": "end", class: "muted" }, "dense"));
  }
  svg.append(el("polyline", { class: "line", points: pts.map((p) => `${x(p.budget)},${y(p.accuracy)}`).join(" ") }));
  for (const p of pts) {
    const dot = el("circle", { class: "point", cx: x(p.budget), cy: y(p.accuracy), r: 3 });
    dot.append(el("title", {}, `budget ${p.budget.toFixed(2)}: ${pct(p.accuracy)}`));
    svg.append(dot);
  }
  if (marked !== null) {
    const p = pointAt(marked);
    const g = el("g", { id: "marker", "data-budget": marked.toFixed(2) });
    g.append(el("line", { class: "marker", x1: x(marked), x2: x(marked), y1: T, y2: H - B }));
    if (p && p.accuracy !== null && Math.abs(p.budget - marked) < 1e-6) {
      g.append(el("circle", { class: "marker-dot", cx: x(marked), cy: y(p.accuracy), r: 5 }));
    }
    const right = x(marked) > W - 90;
    g.append(el("text", { x: x(marked) + (right ? -6 : 6), y: T + 24, "text-anchor": right ? "end" : "start" },
      `b = ${marked.toFixed(2)}`));
    svg.append(g);
  }
  const dense = card.dense_accuracy !== null ? `; dashed: the dense model, ${pct(card.dense_accuracy)}` : "";
  $("curve-note").textContent = `Offline accuracy of ${pts.length} budgets from the checkpoint's sweep${dense}. ` +
    "Red: the budget on the slider, or the one the last answer ran at.";
}

function mark(budget) {
  marked = budget;
  if (card) drawCurve();
}

async function loadModel() {
  let r, body;
  try {
    r = await fetch("v1/models");
    body = await r.json();
  } catch (e) {
    $("model").textContent = `could not read /v1/models: ${e.message}`;
    return;
  }
  if (r.status === 503) { // still loading: try again shortly
    setTimeout(loadModel, 2000);
    return;
  }
  if (!r.ok) {
    $("model").textContent = `/v1/models answered ${r.status}: ${errorMessage(body)}`;
    return;
  }
  card = body.data[0];
  $("model").textContent = `${card.id} · labels: ${card.labels.join(", ")} · ${card.n_layers} layers × ` +
    `${card.n_heads} heads · max ${card.max_length} tokens`;
  if (!card.supports_auto && !card.decider) {
    $("auto").disabled = true;
    $("auto").parentElement.title = "this checkpoint has no auto (no decider, no budget of its own)";
  }
  describePlan();
  mark(sliderBudget());
}

function errorMessage(body) {
  const e = body && body.error;
  return e ? `${e.code}: ${e.message}` : "no error message in the answer";
}

function showError(text) {
  $("result").hidden = true;
  $("error").textContent = text;
  $("error").hidden = false;
}

function addFact(name, value, id) {
  const dt = document.createElement("dt");
  const dd = document.createElement("dd");
  dt.textContent = name;
  dd.textContent = value;
  if (id) dd.id = id;
  $("facts").append(dt, dd);
}

function showScores(scores) {
  const rows = Object.entries(scores).sort((a, b) => b[1] - a[1]).map(([label, p]) => {
    const row = document.createElement("div");
    row.className = "score";
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = label;
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.width = pct(p);
    bar.append(fill);
    const num = document.createElement("span");
    num.className = "num";
    num.textContent = p.toFixed(3);
    row.append(name, bar, num);
    return row;
  });
  $("scores").replaceChildren(...rows);
}

function showResult(body, roundTripMs) {
  const res = body.results[0];
  $("error").hidden = true;
  $("label").textContent = res.label;
  showScores(res.scores);
  $("facts").replaceChildren();
  const attention = res.attention_cost !== null ? ` (attention: ${pct(res.attention_cost)})` : "";
  addFact("cost", `${pct(res.cost)} of the dense model's multiply-adds${attention}`, "cost");
  let budget = `${res.budget_requested === "auto" ? "auto" : res.budget_requested.toFixed(2)} asked, ` +
    `${res.budget_applied.toFixed(2)} applied`;
  if (res.passes) budget += `, passes ${res.passes.map((b) => b.toFixed(2)).join(" → ")}`;
  else if (res.budget_chosen !== null) budget += `, ${res.budget_chosen.toFixed(2)} chosen`;
  if (res.degraded) budget += " (degraded to meet the tier's latency target)";
  addFact("budget", `${budget} · from ${body.budget_source}`, "budget-applied");
  addFact("heads", `${res.heads_active} of ${res.heads_total}`, "heads");
  if (res.neurons_active !== null) addFact("neurons", `${res.neurons_active} of ${res.neurons_total}`, "neurons");
  if (card) addFact("layers", layersOf(pointAt(res.budget_applied)), "layers");
  addFact("tokens", `${res.n_tokens}${res.truncated ? " (truncated)" : ""}`);
  addFact("latency", `forward ${ms(res.latency_ms)} · server ${ms(body.latency_ms)} (queue ${ms(body.queue_ms)}) · ` +
    `round trip ${ms(roundTripMs)}`, "latency");
  addFact("tier", body.tier);
  addFact("request id", body.request_id);
  $("result").hidden = false;
  mark(res.budget_applied);
}

async function classify(event) {
  event.preventDefault();
  const headers = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) headers["X-API-Key"] = key;
  const budget = $("auto").checked ? "auto" : sliderBudget();
  $("classify").disabled = true;
  try {
    const t0 = performance.now();
    const r = await fetch("classify", { method: "POST", headers, body: JSON.stringify({ text: $("text").value, budget }) });
    const body = await r.json().catch(() => null);
    const roundTrip = performance.now() - t0;
    if (r.ok) showResult(body, roundTrip);
    else showError(`${r.status} ${errorMessage(body)}`);
  } catch (e) {
    showError(`the request failed: ${e.message}`);
  } finally {
    $("classify").disabled = false;
  }
}

function onBudgetInput() {
  $("budget-value").textContent = $("auto").checked ? "auto" : sliderBudget().toFixed(2);
  $("budget").disabled = $("auto").checked;
  describePlan();
  if (!$("auto").checked) mark(sliderBudget());
}

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", classify);
  $("budget").addEventListener("input", onBudgetInput);
  $("auto").addEventListener("change", onBudgetInput);
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("form").requestSubmit();
  });
  onBudgetInput();
  loadModel();
});
