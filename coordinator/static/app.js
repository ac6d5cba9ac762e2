"use strict";
// Polls /api/v1/state once a second and redraws; nothing here changes the swarm.
const COLORS = ["#2f6fdf", "#e8833a", "#2ca25f", "#a05195", "#d45087", "#00a3a3", "#8c6d31", "#665191"];
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "kB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}
function fmtSecs(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`
       : s >= 60 ? `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}
function short(id) { return id.length > 14 ? `…${id.slice(-10)}` : id; }
const STATES = ["joined", "serving", "standby", "lost"];
const HEALTHS = ["ok", "late", "silent", "left"];
function known(value, list) { return list.includes(value) ? value : "unknown"; }

// A number of the state: "–" when absent; non-finite ones arrive as strings ("NaN") and show as such.
function num(v, digits) { return typeof v === "number" ? v.toFixed(digits) : v === null ? "–" : String(v); }

function drawLoss(all, checkpoint, allVal) {
  const finite = (p) => typeof p[1] === "number";  // a "NaN" loss has no place on the chart
  const points = all.filter(finite), val = allVal.filter(finite);
  const svg = $("loss-chart");
  svg.replaceChildren();
  svg.dataset.points = String(points.length);
  svg.dataset.valPoints = String(val.length);
  if (points.length < 1) return;
  const W = 800, H = 220, L = 40, B = 20;
  const xs = points.map((p) => p[0]), ys = [...points, ...val].map((p) => p[1]);
  const mark = checkpoint && checkpoint.step >= Math.min(...xs) ? checkpoint.step : null;
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1, mark ?? 0), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-6);
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - 5), Y = (y) => 5 + (y1 - y) / (y1 - y0) * (H - B - 10);
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    svg.append(el("svg:line", { x1: L, x2: W, y1: Y(y), y2: Y(y), stroke: "#eef0f3" }));
    svg.append(el("svg:text", { x: 2, y: Y(y) + 4, "font-size": 11, fill: "#6b7684" }, y.toFixed(2)));
  }
  svg.append(el("svg:text", { x: W - 60, y: H - 4, "font-size": 11, fill: "#6b7684" }, `step ${x1}`));
  if (mark !== null) {  // the step a rollback would return to
    const x = X(mark);
    svg.append(el("svg:line", { x1: x, x2: x, y1: 0, y2: H - B, stroke: "#2ca25f", "stroke-dasharray": "4,3",
      class: "checkpoint-mark" }));
    const right = x > W - 80;  // label on the left of a mark near the right edge
    svg.append(el("svg:text", { x: right ? x - 3 : x + 3, y: H - B - 4, "font-size": 11, fill: "#2ca25f",
      "text-anchor": right ? "end" : "start" }, "checkpoint"));
  }
  const d = points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
  svg.append(el("svg:path", { d, fill: "none", stroke: "#2f6fdf", "stroke-width": 1.5, class: "loss-line" }));
  for (const [step, loss] of val) {  // validation loss after `step` steps: the point of step - 1
    svg.append(el("svg:circle", { cx: X(Math.max(step - 1, x0)), cy: Y(loss), r: 3.5, fill: "#e6550d",
      class: "val-point" }));
  }
}

function drawPlan(plan) {
  const svg = $("plan");
  svg.replaceChildren();
  if (!plan) { $("plan-note").textContent = "no plan yet"; return; }
  const W = 800, n = plan.num_ops, w = W / n;
  const maxF = Math.max(...plan.op_flops, 1);
  plan.stages.forEach((st, s) => {
    svg.append(el("svg:rect", { x: st.first_op * w, y: 70, width: (st.last_op - st.first_op + 1) * w, height: 18,
      fill: COLORS[s % COLORS.length], class: "stage-band", "data-stage": s }));
    svg.append(el("svg:text", { x: st.first_op * w + 4, y: 104, "font-size": 11 },
      `stage ${s}: ops ${st.first_op}–${st.last_op}, ${(st.flops / 1e6).toFixed(1)} MFLOP`));
  });
  plan.op_flops.forEach((f, i) => {
    const h = f > 0 ? 4 + 56 * Math.log1p(f) / Math.log1p(maxF) : 2;
    const s = plan.stages.findIndex((st) => i >= st.first_op && i <= st.last_op);
    svg.append(el("svg:rect", { x: i * w, y: 64 - h, width: Math.max(w - 0.5, 0.5), height: h,
      fill: COLORS[Math.max(s, 0) % COLORS.length], opacity: 0.6 }));
  });
  for (const c of plan.cuts) {
    const x = (c.after_op + 1) * w;
    svg.append(el("svg:line", { x1: x, x2: x, y1: 0, y2: 92, stroke: "#1b1f24", "stroke-dasharray": "3,2" }));
    svg.append(el("svg:text", { x: x + 3, y: 10, "font-size": 11 }, `${fmtBytes(c.bytes)}/mb · ${c.codec || "…"}`));
  }
  $("plan-note").textContent = `${n} operators in ${plan.stages.length} stages; bar height: FLOPs per op (log)`;
}

function renderRecovery(st) {
  const rec = st.recovery, ck = st.checkpoint;
  $("epoch").textContent = String(rec.epoch);
  $("failures").textContent = String(rec.failures);
  $("failures").className = rec.failures ? "bad" : "";
  $("rollbacks").textContent = String(rec.rollbacks);
  $("redone").textContent = String(rec.steps_redone);
  const c = $("checkpoint");
  c.textContent = ck ? `step ${ck.step} · ${fmtBytes(ck.bytes)} · ${fmtSecs(st.now - ck.at)} ago` : "none yet";
  c.title = ck ? `${ck.path} (written in ${ck.seconds} s)` : "";
}

function render(st) {
  $("run").textContent = st.run_id;
  $("phase").textContent = st.phase + (st.message ? `: ${st.message}` : "");
  const tr = st.training;
  $("step").textContent = `${tr.step} / ${tr.steps}`;
  $("loss").textContent = num(tr.loss, 4);
  $("val-loss").textContent = num(tr.val_loss, 4);
  $("tps").textContent = tr.tokens_per_s === null ? "–" : Math.round(tr.tokens_per_s).toLocaleString();
  $("elapsed").textContent = fmtSecs(tr.elapsed_s);
  $("eta").textContent = fmtSecs(tr.eta_s);
  const code = st.stages_as === "code";
  $("stages-as").textContent = st.stages_as ? (code ? "the model's Python" : "ATen programs") : "–";
  $("stages-as").title = code ? "peers import the model's code: only those who opted in with --allow-code serve"
    : "peers run programs of ATen operators and import no model code";
  $("stages-as").className = code ? "warn" : "";
  renderRecovery(st);
  drawLoss(tr.losses, st.checkpoint, tr.val_losses);
  drawPlan(st.plan);
  const peers = $("peers").querySelector("tbody");
  peers.replaceChildren(...st.peers.map((p) => {
    const state = known(p.state, STATES), health = known(p.health, HEALTHS);
    const tr = el("tr", { "data-peer": p.id, "data-stage": p.stage === null ? "" : p.stage, "data-state": state,
      class: `peer-${state}` });
    const speed = p.measured_flops === undefined ? num(p.flops / 1e9, 1)
      : `${num(p.flops / 1e9, 1)} (measured ${num(p.measured_flops / 1e9, 1)})`;
    const cells = [[short(p.id), { title: p.id }], [p.device],
      [p.claim_contradicted ? `${speed}: claim contradicted` : speed, { class: p.claim_contradicted ? "bad" : "" }],
      [`${p.up_mbps} / ${p.down_mbps}`], [p.connection], [state, { class: `state state-${state}` }],
      [p.stage === null ? "–" : p.stage], [p.replica === null ? "–" : p.replica],
      [`${fmtSecs(st.now - p.last_seen)} ago`], [health, { class: health }]];
    cells.forEach(([c, attrs]) => tr.append(el("td", attrs, String(c))));
    return tr;
  }));
  const links = $("links").querySelector("tbody");
  links.replaceChildren(...st.links.map((l) => {
    const tr = el("tr", { "data-boundary": l.boundary });
    [`${l.boundary} → ${l.boundary + 1}`, l.path, l.codec, l.mbps, fmtBytes(l.wire_bytes), fmtBytes(l.raw_bytes),
      `${l.ratio}x`]
      .forEach((c) => tr.append(el("td", {}, String(c))));
    return tr;
  }));
  const events = $("events");
  events.replaceChildren(...st.events.map((e) =>
    el("li", { class: e.kind }, `${new Date(e.t * 1000).toLocaleTimeString()} ${e.kind}: ${e.text}`)));
  events.scrollTop = events.scrollHeight;
}

async function poll() {
  try {
    const r = await fetch("/api/v1/state", { cache: "no-store" });
    if (r.ok) render(await r.json());
    else $("phase").textContent = `status ${r.status}`;
  } catch (e) {
    $("phase").textContent = "coordinator unreachable";
  }
  setTimeout(poll, 1000);
}
poll();
