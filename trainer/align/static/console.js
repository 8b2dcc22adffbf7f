// dlrl align console: polls GET /api/state every 2 s and renders it; actions POST with the admin token.
// Everything shown is set with textContent (event lines and user text are never parsed as HTML).
"use strict";
const $ = (id) => document.getElementById(id);
const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%");
const num = (x, d = 3) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
let state = null;

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tbody, items, build) {
  tbody.replaceChildren(...items.map((item) => { const tr = document.createElement("tr"); build(tr, item); return tr; }));
}

function renderReplicas(s) {
  fill($("replicas").tBodies[0], s.replicas, (tr, r) => {
    tr.className = "replica";
    tr.dataset.url = r.url;
    tr.dataset.version = r.version;
    cell(tr, r.url);
    cell(tr, r.version < 0 ? "down" : String(r.version), r.version < 0 ? "down" : r.version !== r.target ? "lag" : "");
    cell(tr, String(r.target));
  });
}

function gateCell(tr, ok, text) { cell(tr, text, ok === false ? "fail" : ""); }

function renderCandidates(s) {
  const t = s.thresholds;
  fill($("candidates").tBodies[0], s.candidates, (tr, c) => {
    const sc = c.scores;
    tr.className = "candidate";
    tr.dataset.version = c.version;
    tr.dataset.status = c.status;
    cell(tr, String(c.version));
    cell(tr, String(c.step));
    const st = cell(tr, "");
    const badge = document.createElement("span");
    badge.className = "st st-" + c.status;
    badge.textContent = c.status;
    st.appendChild(badge);
    const accOk = sc.accuracy === null || sc.serving_accuracy === null ? null
      : sc.accuracy >= sc.serving_accuracy - t.tolerance - 1e-9;
    gateCell(tr, accOk, `${pct(sc.accuracy)} (vs ${pct(sc.serving_accuracy)}, -${t.tolerance})`);
    gateCell(tr, sc.kl === null ? null : sc.kl <= t.kl_budget, `${num(sc.kl, 4)} (≤ ${t.kl_budget})`);
    cell(tr, num(sc.mean_length, 2));
    cell(tr, num(sc.stop_rate, 2));
    gateCell(tr, sc.empty_frac === null ? null : sc.empty_frac <= t.max_empty_frac, `${num(sc.empty_frac, 2)} (≤ ${t.max_empty_frac})`);
    gateCell(tr, sc.degenerate_frac === null ? null : sc.degenerate_frac <= t.max_degenerate_frac,
             `${num(sc.degenerate_frac, 2)} (≤ ${t.max_degenerate_frac})`);
    cell(tr, String(c.feedback));
    cell(tr, c.reasons.join("; "), c.reasons.length ? "fail" : "");
  });
}

function svgEl(name, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

function axes(svg, X, Y, t0, t1, yMax, yFormat) {
  // y: 0, half, max on the left; x: the first, middle and last time (wall clock) at the bottom
  svg.appendChild(svgEl("polyline", { points: `${X(t0)},${Y(yMax)} ${X(t0)},${Y(0)} ${X(t1)},${Y(0)}`, fill: "none",
                                      stroke: "#9aa3af", "stroke-width": 1 }));
  for (const y of [0, yMax / 2, yMax]) {
    const label = svgEl("text", { x: X(t0) - 4, y: Y(y) + 3, "text-anchor": "end", class: "axis y" });
    label.textContent = yFormat(y);
    svg.appendChild(label);
  }
  [[t0, "start"], [(t0 + t1) / 2, "middle"], [t1, "end"]].forEach(([t, anchor]) => {
    const label = svgEl("text", { x: X(t), y: 156, "text-anchor": anchor, class: "axis x" });
    label.textContent = clock(t);
    svg.appendChild(label);
  });
}

function chart(svg, series, yMax, yFormat) {
  // series: [{points: [[t, y]], color, dots}]; x: time (axis: wall clock), y: 0..yMax (axis: yFormat)
  const all = series.flatMap((s) => s.points);
  svg.replaceChildren();
  if (!all.length) return;
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]), t0 + 1);
  const X = (t) => 46 + (346 * (t - t0)) / (t1 - t0), Y = (y) => 140 - (132 * y) / (yMax || 1);
  axes(svg, X, Y, t0, t1, yMax || 1, yFormat || ((y) => num(y, 2)));
  for (const s of series) {
    if (s.dots) {
      for (const [t, y, color] of s.points) svg.appendChild(svgEl("circle", { cx: X(t), cy: Y(y), r: 3, fill: color || s.color }));
    } else if (s.points.length) {
      svg.appendChild(svgEl("polyline", { points: s.points.map(([t, y]) => `${X(t)},${Y(y)}`).join(" "),
                                          fill: "none", stroke: s.color, "stroke-width": 2 }));
    }
  }
}

function renderCharts(s) {
  const served = new Set(["serving", "retired", "rolled_back"]);
  const dots = s.accuracy.map((a) => [a.time, a.accuracy, served.has(a.status) ? "#1b7f3b" : a.status === "gated_out" ? "#b3261e" : "#3566c9"]);
  const line = s.history.filter((h) => h.serving_accuracy !== undefined).map((h) => [h.time, h.serving_accuracy]);
  chart($("accuracy-chart"), [{ points: line, color: "#1d2330" }, { points: dots, dots: true, color: "#3566c9" }], 1,
        (y) => `${Math.round(100 * y)}%`);
  const rate = s.history.filter((h) => h.feedback_rate !== undefined).map((h) => [h.time, h.feedback_rate]);
  const used = s.history.filter((h) => h.feedback_used !== undefined).map((h) => [h.time, h.feedback_used]);
  const yMax = Math.max(1, ...rate.map((p) => p[1]), ...used.map((p) => p[1]));
  chart($("feedback-chart"), [{ points: rate, color: "#3566c9" }, { points: used, color: "#1b7f3b" }], yMax,
        (y) => num(y, y < 10 ? 1 : 0));
  const f = s.feedback;
  $("feedback-counts").textContent = `blue: records/s arriving (${num(s.feedback_rate, 2)} now); green: records trained on per step. ` +
    `received ${f.received || 0}, trained on ${f.used || 0}, stale ${f.stale || 0}, invalid ${f.invalid || 0}`;
}

function renderEvents(s) {
  $("events").replaceChildren(...s.events.map((e) => {
    const li = document.createElement("li");
    li.className = "event ev-" + e.kind;
    li.textContent = e.line;
    return li;
  }));
}

function renderRated(s) {
  $("rated-section").hidden = !s.show_text;
  if (!s.show_text) return;
  fill($("rated").tBodies[0], s.rated || [], (tr, r) => {
    cell(tr, String(r.version)); cell(tr, String(r.reward)); cell(tr, r.prompt || ""); cell(tr, r.answer || "");
  });
}

function render(s) {
  state = s;
  $("serving-version").textContent = s.serving_version ?? "-";
  $("trainer-version").textContent = s.trainer_version;
  $("canary-version").textContent = s.canary_version || "none";
  $("paused").textContent = s.promotion_paused ? "PROMOTION PAUSED" : "";
  $("updated").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
  const f2s = s.feedback_to_serving;
  $("f2s").textContent = f2s.count ? `mean ${num(f2s.mean_s, 0)} s over ${f2s.count} records` +
    (f2s.last ? `; last promotion median ${num(f2s.last.median_s, 0)} s` : "") : "no promotion trained on feedback yet";
  renderReplicas(s); renderCandidates(s); renderCharts(s); renderEvents(s); renderRated(s);
  const sel = $("rollback-version"), keep = sel.value;
  sel.replaceChildren(...s.kept.slice().reverse().map((v) => { const o = document.createElement("option"); o.value = o.textContent = v; return o; }));
  if (s.kept.map(String).includes(keep)) sel.value = keep;
  updateButtons();
}

function updateButtons() {
  const has = $("token").value.length > 0;
  $("mode").textContent = has ? "(admin)" : "(read-only: enter the admin token to act)";
  $("rollback").disabled = !has || !$("rollback-version").value;
  $("pause").disabled = !has || (state && state.promotion_paused);
  $("resume").disabled = !has || (state && !state.promotion_paused);
}

async function act(path, body) {
  $("action-result").textContent = "…";
  $("action-result").dataset.status = "pending";
  $("action-result").dataset.action = path;
  try {
    const r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json", Authorization: "Bearer " + $("token").value },
                                  body: JSON.stringify(body || {}) });
    const data = await r.json();
    $("action-result").textContent = `${r.status}: ${JSON.stringify(data)}`;
    $("action-result").dataset.status = r.status;
  } catch (e) {
    $("action-result").textContent = "failed: " + e;
  }
  poll();
}

async function poll() {
  try {
    const r = await fetch("/api/state", { cache: "no-store" });
    if (r.ok) render(await r.json());
  } catch (e) { $("updated").textContent = "console unreachable: " + e; }
}

$("token").addEventListener("input", updateButtons);
$("rollback").addEventListener("click", () => act("/api/rollback", { version: Number($("rollback-version").value) }));
$("pause").addEventListener("click", () => act("/api/pause"));
$("resume").addEventListener("click", () => act("/api/resume"));
poll();
setInterval(poll, 2000);
