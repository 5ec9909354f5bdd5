// agl dashboard: plain JS over this server's JSON API, nothing fetched from anywhere else.
// Data from spans is only ever set as text (textContent, SVG attributes), never parsed as markup.
"use strict";

const TOKEN_KEY = "agl.token";
const PAGE_SIZE = 25;
const REFRESH_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fde", "#c2410c", "#0f8a83", "#6a4cc2", "#b26a00", "#be185d"];

const state = { offset: 0, status: "", selected: null, selectedSpan: null, seen: {}, timer: null, locked: false };

// ------------------------------------------------------------------ token and requests

function takeTokenFromUrl() {
  const params = new URLSearchParams(window.location.search);
  const token = params.get("token");
  if (token !== null) {
    sessionStorage.setItem(TOKEN_KEY, token);
    params.delete("token");
    const rest = params.toString();
    // out of the address bar and the history, so it is not copied or bookmarked with the URL
    history.replaceState(null, "", window.location.pathname + (rest ? "?" + rest : "") + window.location.hash);
  }
}

class NeedsToken extends Error {}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  const response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
  if (response.status === 401) throw new NeedsToken(token ? "the token was refused" : "");
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    const message = body && body.error && body.error.message ? body.error.message : response.statusText;
    throw new Error(`${path}: ${response.status} ${message}`);
  }
  return body;
}

function showTokenForm(problem) {
  state.locked = true;
  document.getElementById("token-panel").hidden = false;
  document.getElementById("main").hidden = true;
  document.getElementById("token-error").textContent = problem || "";
}

function hideTokenForm() {
  state.locked = false;
  document.getElementById("token-panel").hidden = true;
  document.getElementById("main").hidden = false;
}

function showError(err) {
  const box = document.getElementById("error");
  if (err instanceof NeedsToken) { showTokenForm(err.message); return; }
  box.textContent = err ? String(err.message || err) : "";
  box.hidden = !err;
}

// ------------------------------------------------------------------ small DOM helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmtNumber(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return v.toFixed(digits).replace(/0+$/, "").replace(/\.$/, "");
}

function fmtTime(seconds) {
  if (!seconds) return "–";
  const d = new Date(seconds * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fmtDuration(ns) {
  if (!(ns > 0)) return "";
  const ms = ns / 1e6;
  return ms < 1000 ? `${ms.toFixed(ms < 10 ? 1 : 0)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function changed(key, data) {
  const text = JSON.stringify(data);
  if (state.seen[key] === text) return false;
  state.seen[key] = text;
  return true;
}

// ------------------------------------------------------------------ rollouts

async function loadRollouts() {
  const params = new URLSearchParams({ limit: PAGE_SIZE, offset: state.offset });
  if (state.status) params.append("status", state.status);
  const page = await api("/v1/dashboard/rollouts?" + params);
  if (page.data.length === 0 && state.offset > 0 && page.total > 0) {  // the page emptied: go back to the first
    state.offset = 0;
    return loadRollouts();
  }
  if (!changed("rollouts", page)) return;
  const body = document.querySelector("#rollouts tbody");
  body.replaceChildren();
  for (const r of page.data) {
    const row = el("tr", { "data-rollout-id": r.id, class: r.id === state.selected ? "selected" : null, tabindex: 0,
                           onclick: () => selectRollout(r.id),
                           onkeydown: (ev) => { if (ev.key === "Enter") selectRollout(r.id); } },
      el("td", { text: fmtTime(r.start_time) }),
      el("td", { class: "task", text: r.task_id }),
      el("td", { class: "num", text: r.attempt }),
      el("td", {}, el("span", { class: "badge " + r.status, text: r.status })),
      el("td", { class: "num reward", text: fmtNumber(r.final_reward) }),
      el("td", { class: "num", text: r.spans }),
      el("td", { class: "err-text", title: r.error || null, text: r.error || "" }));
    body.append(row);
  }
  if (page.data.length === 0) {
    body.append(el("tr", {}, el("td", { colspan: 7, class: "hint",
      text: page.total === 0 && !state.status ? "no rollouts stored yet" : "no rollouts with this status" })));
  }
  const first = page.total === 0 ? 0 : state.offset + 1;
  document.getElementById("page-info").textContent =
    `${first}–${state.offset + page.data.length} of ${page.total}`;
  document.getElementById("prev").disabled = state.offset === 0;
  document.getElementById("next").disabled = state.offset + page.data.length >= page.total;
}

async function selectRollout(id) {
  state.selected = id;
  state.selectedSpan = null;
  delete state.seen.detail;
  for (const row of document.querySelectorAll("#rollouts tbody tr")) {
    row.classList.toggle("selected", row.dataset.rolloutId === id);
  }
  try {
    await loadDetail();
    showError(null);
  } catch (err) { showError(err); }
}

// ------------------------------------------------------------------ span tree

function attrs(span) { return span.attributes || {}; }

function spanKind(span) {
  const a = attrs(span);
  const op = a["gen_ai.operation.name"];
  if (op === "chat" || op === "text_completion" || op === "generate_content") return "llm";
  if (op === "execute_tool") return "tool";
  if (op === "invoke_agent" || op === "create_agent") return "agent";
  const kind = a["agl.span.kind"];
  if (kind === "reward" || kind === "rollout" || kind === "exception" || kind === "message") return kind;
  return "span";
}

function spanError(span) {
  const a = attrs(span);
  const tool = a["agl.tool.status"];
  if (span.status === "error") return span.status_message || a["error.type"] || "error";
  if (a["error.type"]) return String(a["error.type"]);
  if (tool && tool !== "ok") return "tool " + tool;
  if (spanKind(span) === "exception") return a["exception.message"] || a["exception.type"] || "exception";
  return null;
}

function spanLabel(span) {
  const a = attrs(span);
  switch (spanKind(span)) {
    case "agent": return a["gen_ai.agent.name"] || span.name;
    case "llm": return a["gen_ai.response.model"] || a["gen_ai.request.model"] || span.name;
    case "tool": return a["gen_ai.tool.name"] || span.name;
    case "reward": return a["agl.reward.name"] ? `reward ${a["agl.reward.name"]}` : "final reward";
    default: return span.name;
  }
}

function buildTree(spans) {
  const byId = new Map(spans.map((s) => [s.span_id, { span: s, children: [] }]));
  const roots = [];
  for (const node of byId.values()) {
    const parent = node.span.parent_id ? byId.get(node.span.parent_id) : null;
    if (parent && parent !== node) parent.children.push(node); else roots.push(node);
  }
  const order = (a, b) => (a.span.start_ns - b.span.start_ns);
  const sortAll = (nodes) => { nodes.sort(order); nodes.forEach((n) => sortAll(n.children)); };
  sortAll(roots);
  return roots;
}

function renderNode(node, rollout) {
  const s = node.span;
  const kind = spanKind(s);
  const error = spanError(s);
  const a = attrs(s);
  let reward = null;
  if (kind === "reward") reward = a["agl.reward.value"];
  else if (kind === "rollout" && rollout.final_reward !== null) reward = rollout.final_reward;
  const line = el("div", {
      class: `node k-${kind}${error ? " error" : ""}${state.selectedSpan === s.span_id ? " selected" : ""}`,
      "data-span-id": s.span_id, "data-kind": kind, tabindex: 0,
      onclick: (ev) => { ev.stopPropagation(); selectSpan(s, rollout); },
      onkeydown: (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); selectSpan(s, rollout); } } },
    el("span", { class: "kind", text: kind }),
    el("span", { class: "label", text: spanLabel(s) }),
    reward !== null && reward !== undefined ? el("span", { class: "reward", text: "reward " + fmtNumber(reward) }) : null,
    el("span", { class: "dur", text: fmtDuration(s.end_ns - s.start_ns) }),
    ...callSummary(s, kind, rollout),
    error ? el("span", { class: "errmsg", title: error, text: error }) : null);
  const item = el("li", {}, line);
  if (node.children.length) item.append(el("ul", {}, ...node.children.map((c) => renderNode(c, rollout))));
  return item;
}

function preview(text, limit = 60) {
  const flat = String(text).replace(/\s+/g, " ").trim();
  return flat.length > limit ? flat.slice(0, limit - 1) + "…" : flat;
}

function outputPreview(a) {
  const out = parseJson(a["gen_ai.output.messages"]);
  const parts = Array.isArray(out) && out.length && Array.isArray(out[0].parts) ? out[0].parts : [];
  const calls = parts.filter((p) => p && p.type === "tool_call")
    .map((p) => `${p.name}(${typeof p.arguments === "string" ? p.arguments : JSON.stringify(p.arguments ?? {})})`);
  if (calls.length) return calls.join(", ");
  const text = parts.filter((p) => p && p.type === "text").map((p) => p.content).join(" ");
  return text ? JSON.stringify(text) : null;
}

// What the page knows about an LLM or tool call beyond its span: tokens, output, its transition and rewards.
function callSummary(s, kind, rollout) {
  const a = attrs(s);
  const bits = [];
  if (kind === "llm") {
    const tin = a["gen_ai.usage.input_tokens"], tout = a["gen_ai.usage.output_tokens"];
    if (tin !== undefined || tout !== undefined) {
      bits.push(el("span", { class: "tokens", text: `${tin ?? "?"} in / ${tout ?? "?"} out tokens` }));
    }
    const out = outputPreview(a);
    if (out) bits.push(el("span", { class: "out", title: out, text: "→ " + preview(out) }));
    // a run of several policies: which one answered (or why the base model did)
    if (a["agl.llm.policy"]) bits.push(el("span", { class: "policy", text: "policy " + a["agl.llm.policy"] }));
    else if (a["agl.llm.policy_note"]) {
      bits.push(el("span", { class: "policy base", title: String(a["agl.llm.policy_note"]), text: "base model" }));
    }
    const t = rollout.transitionBySpan.get(s.span_id);
    if (t) {
      bits.push(el("span", { class: "transition", text: `transition #${t.index}` }));
      if (t.reward !== null && t.reward !== undefined) {
        bits.push(el("span", { class: t.reward < 0 ? "reward neg" : "reward", text: "reward " + fmtNumber(t.reward) }));
      }
      if (t.credited_reward !== null && t.credited_reward !== undefined) {
        bits.push(el("span", { class: "credited", text: "credited " + fmtNumber(t.credited_reward) }));
      }
    } else if (rollout.skippedBySpan.has(s.span_id)) {
      bits.push(el("span", { class: "skipped", text: "not trained: " + rollout.skippedBySpan.get(s.span_id) }));
    }
  } else if (kind === "tool") {
    const args = a["gen_ai.tool.call.arguments"], result = a["gen_ai.tool.call.result"];
    if (args !== undefined) bits.push(el("span", { class: "args", title: String(args), text: preview(args, 40) }));
    if (result !== undefined && !spanError(s)) {
      bits.push(el("span", { class: "out", title: String(result), text: "→ " + preview(result, 40) }));
    }
  }
  return bits;
}

async function loadDetail() {
  const id = state.selected;
  if (!id) return;
  const [rollout, trajectories] = await Promise.all([
    api("/v1/rollouts/" + encodeURIComponent(id)),
    api("/v1/trajectories?rollout_id=" + encodeURIComponent(id))]);
  if (state.selected !== id) return;  // another rollout was clicked meanwhile
  const trajectory = trajectories.trajectories[0] || { transitions: [], skipped: [] };
  rollout.transitionBySpan = new Map(trajectory.transitions.filter((t) => t.span_id).map((t) => [t.span_id, t]));
  rollout.skippedBySpan = new Map((trajectory.skipped || []).map((k) => [k.span_id, k.reason]));
  const finals = (rollout.rewards || []).filter((r) => r.name === null || r.name === undefined);
  rollout.final_reward = finals.length ? finals[finals.length - 1].value : null;
  if (!changed("detail", [rollout, trajectory])) return;
  document.getElementById("detail-title").textContent =
    `${rollout.task_id} · try ${rollout.attempt} · ${rollout.status}` +
    (rollout.final_reward !== null ? ` · reward ${fmtNumber(rollout.final_reward)}` : "") +
    (rollout.error ? ` · ${rollout.error}` : "");
  const tree = document.getElementById("tree");
  tree.replaceChildren(...buildTree(rollout.spans || []).map((n) => renderNode(n, rollout)));
  if (!(rollout.spans || []).length) tree.append(el("li", { class: "hint", text: "this rollout has no spans" }));
  const chosen = (rollout.spans || []).find((s) => s.span_id === state.selectedSpan);
  if (chosen) renderSpanDetail(chosen); else document.getElementById("span-detail").replaceChildren();
}

function selectSpan(span, rollout) {
  state.selectedSpan = span.span_id;
  for (const node of document.querySelectorAll("#tree .node")) {
    node.classList.toggle("selected", node.dataset.spanId === span.span_id);
  }
  renderSpanDetail(span);
}

function parseJson(value) {
  if (typeof value !== "string") return value;
  try { return JSON.parse(value); } catch (e) { return value; }
}

function renderMessages(title, value) {
  const messages = parseJson(value);
  if (!Array.isArray(messages)) return null;
  const box = el("div", { class: "messages" }, el("h3", { text: title }));
  for (const m of messages) {
    const role = (m && m.role) || "?";
    const parts = Array.isArray(m && m.parts) ? m.parts : [{ type: "text", content: m && m.content }];
    const texts = parts.map((p) => {
      if (!p || typeof p !== "object") return String(p);
      if (p.type === "text") return typeof p.content === "string" ? p.content : JSON.stringify(p.content);
      if (p.type === "tool_call") {
        const args = typeof p.arguments === "string" ? p.arguments : JSON.stringify(p.arguments);
        return `→ ${p.name}(${args ?? ""})`;
      }
      if (p.type === "tool_call_response") {
        return "← " + (typeof p.response === "string" ? p.response : JSON.stringify(p.response));
      }
      return JSON.stringify(p);
    });
    box.append(el("div", { class: "msg " + role }, el("div", { class: "role", text: role }),
      el("div", { text: texts.join("\n") })));
  }
  return box;
}

function renderSpanDetail(span) {
  const a = attrs(span);
  const panel = document.getElementById("span-detail");
  const rows = [["name", span.name], ["span_id", span.span_id], ["parent_id", span.parent_id || "–"],
    ["status", span.status + (span.status_message ? `: ${span.status_message}` : "")],
    ["duration", fmtDuration(span.end_ns - span.start_ns) || "–"]];
  const skip = new Set(["gen_ai.input.messages", "gen_ai.output.messages"]);
  for (const key of Object.keys(a).sort()) {
    if (skip.has(key)) continue;
    const v = a[key];
    rows.push([key, typeof v === "string" ? v : JSON.stringify(v)]);
  }
  for (const ev of span.events || []) rows.push([`event ${ev.name || ""}`, JSON.stringify(ev.attributes || {})]);
  const table = el("table", { class: "attrs" }, el("tbody", {},
    ...rows.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: v })))));
  panel.replaceChildren(el("h3", { text: `${spanKind(span)}: ${spanLabel(span)}` }),
    ...[renderMessages("input messages", a["gen_ai.input.messages"]),
        renderMessages("output messages", a["gen_ai.output.messages"])].filter(Boolean),
    table);
}

// ------------------------------------------------------------------ curves

function metricOrder(a, b) {
  const rank = (n) => (n.includes("reward") ? 0 : n.includes("loss") ? 1 : 2);
  return rank(a) - rank(b) || a.localeCompare(b);
}

function drawCurve(name, points, color) {
  const W = 300, H = 170, L = 44, R = 10, T = 22, B = 26;
  const chart = svg("svg", { class: "curve", width: W, height: H, viewBox: `0 0 ${W} ${H}`,
                             "data-metric": name, "data-points": points.length, role: "img",
                             "aria-label": `${name} per training step` });
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    chart.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: py(y), y2: py(y) }));
    chart.append(svg("text", { x: L - 4, y: py(y) + 3, "text-anchor": "end" }, fmtNumber(y, 2)));
  }
  chart.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  chart.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  chart.append(svg("text", { x: L, y: H - 8, "text-anchor": "start" }, `step ${fmtNumber(Math.min(...xs))}`));
  chart.append(svg("text", { x: W - R, y: H - 8, "text-anchor": "end" }, `step ${fmtNumber(Math.max(...xs))}`));
  const last = points[points.length - 1];
  chart.append(svg("text", { class: "title", x: L, y: 14 }, `${name}  (last ${fmtNumber(last[1])})`));
  chart.append(svg("polyline", { stroke: color, points: points.map((p) => `${px(p[0])},${py(p[1])}`).join(" ") }));
  for (const p of points.length <= 60 ? points : [last]) {
    const dot = svg("circle", { cx: px(p[0]), cy: py(p[1]), r: 2.5, fill: color });
    dot.append(svg("title", {}, `step ${p[0]}: ${p[1]}`));
    chart.append(dot);
  }
  return chart;
}

// Reward and loss curves unless "every metric" is ticked: a trainer records a dozen numbers a step.
// Names that end so (reward_mean, final_reward_mean, validation_reward_mean, loss); not the counts
// named after them (no_reward_rollouts).
const PRIMARY = /(reward|reward_mean|loss)$/i;

async function loadCurves() {
  const metrics = await api("/v1/metrics");
  const all = document.getElementById("all-metrics").checked;
  if (!changed("metrics", [metrics, all])) return;
  const series = new Map();
  for (const row of metrics.data) {
    for (const [name, value] of Object.entries(row.values)) {
      if (!series.has(name)) series.set(name, []);
      series.get(name).push([row.step, value]);
    }
  }
  renderSignal(metrics.data);
  const box = document.getElementById("curves");
  const every = [...series.keys()].sort(metricOrder);
  const primary = every.filter((n) => PRIMARY.test(n));
  const names = all || !primary.length ? every : primary;
  box.replaceChildren(...names.map((n, i) => drawCurve(n, series.get(n), COLORS[i % COLORS.length])));
  if (!names.length) {
    box.append(el("p", { class: "empty", text: "no training metrics yet: the trainer records them per step " +
      "(TrainerServer.record_metrics, or POST /v1/metrics)" }));
  }
  document.getElementById("curves-hint").textContent = metrics.data.length
    ? `${metrics.data.length} steps · ${names.length} of ${every.length} metrics` : "";
}

// ------------------------------------------------------------------ signal health

// The trainer's per-step health numbers (agl_trainer.signal_health); a row is marked when the trainer
// flagged its cause (warn_*), so the page never second-guesses the trainer's bounds.
const SIGNAL = [
  ["first-pass importance ratio", (v) => v.ratio_first_mean === undefined ? null :
    `${fmtNumber(v.ratio_first_mean)} (${fmtNumber(v.ratio_first_min)}–${fmtNumber(v.ratio_first_max)})`,
   "1: the sampler's logprobs are the trainer's", "warn_ratio_drift"],
  ["KL to the sampler", (v) => v.sampler_kl, "about 0", "warn_ratio_drift"],
  ["clip fraction", (v) => v.clip_fraction, "small", null],
  ["advantage mean / std", (v) => v.advantage_mean === undefined ? null :
    `${fmtNumber(v.advantage_mean)} / ${fmtNumber(v.advantage_std)}`, "about 0 / about 1", null],
  ["max |advantage|", (v) => v.advantage_max_abs, "at most sqrt(group size - 1)", "warn_large_advantages"],
  ["groups without spread", (v) => v.groups === undefined ? null : `${v.flat_groups} of ${v.groups}`,
   "few: they train on nothing", "warn_flat_groups"],
  ["rows truncated", (v) => v.truncated_rows, "0, or raise the length limits", null],
  ["prefix mismatches", (v) => v.prefix_mismatches, "0 in trajectory rows", null],
  ["rollouts without reward", (v) => v.no_reward_rollouts, "0", null],
];

function renderSignal(rows) {
  const body = document.querySelector("#signal tbody");
  const last = rows.length ? rows[rows.length - 1] : null;
  const values = last ? last.values : {};
  const shown = SIGNAL.map(([name, read, good, flag]) => [name, read(values), good, flag])
    .filter(([, value]) => value !== null && value !== undefined);
  body.replaceChildren(...shown.map(([name, value, good, flag]) => el("tr",
    { "data-signal": name, class: flag && values[flag] ? "signal-bad" : null },
    el("td", { text: name }), el("td", { class: "num", text: fmtNumber(value) }), el("td", { class: "hint", text: good }))));
  if (!shown.length) body.append(el("tr", {}, el("td", { colspan: 3, class: "hint", text: "no training step yet" })));
  const flagged = Object.keys(values).filter((k) => k.startsWith("warn_") && values[k]).length;
  document.getElementById("signal-hint").textContent = last
    ? `step ${last.step}` + (flagged ? ` · ${flagged} warning${flagged > 1 ? "s" : ""}: see the marked rows` : "")
    : "the last step's health, as the trainer measured it";
}

// ------------------------------------------------------------------ agent stats

async function loadStats() {
  const stats = await api("/v1/stats");
  if (!changed("stats", stats)) return;
  const body = document.querySelector("#stats tbody");
  const pct = (rate, errors) => el("td", { class: "num" + (rate > 0 ? " rate-bad" : ""),
    text: `${errors} (${(rate * 100).toFixed(rate > 0 && rate < 0.1 ? 1 : 0)}%)` });
  body.replaceChildren(...stats.agents.map((a) => el("tr", { "data-agent": a.agent ?? "" },
    el("td", { text: a.agent ?? "(no agent span)" }),
    el("td", { class: "num", text: a.rollouts }),
    el("td", { class: "num", text: a.llm_calls }),
    pct(a.llm_error_rate, a.llm_errors),
    el("td", { class: "num", text: a.tool_calls }),
    pct(a.tool_error_rate, a.tool_errors))));
  if (!stats.agents.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "hint", text: "no calls yet" })));
  const r = stats.rollouts, w = stats.window;
  document.getElementById("stats-hint").textContent =
    (r.total > w.rollouts ? `the newest ${w.rollouts} of ` : "") + `${r.total} rollouts` +
    (w.reward_mean !== null ? ` · mean reward ${fmtNumber(w.reward_mean)}` : "");
}

// ------------------------------------------------------------------ wiring

async function refresh() {
  if (state.locked) return;
  try {
    await Promise.all([loadRollouts(), loadCurves(), loadStats(), loadDetail()]);
    showError(null);
    document.body.dataset.loaded = "true";
  } catch (err) {
    showError(err);
  }
}

function schedule() {
  clearInterval(state.timer);
  state.timer = document.getElementById("auto-refresh").checked ? setInterval(refresh, REFRESH_MS) : null;
}

function start() {
  takeTokenFromUrl();
  document.getElementById("refresh").addEventListener("click", refresh);
  document.getElementById("auto-refresh").addEventListener("change", schedule);
  document.getElementById("all-metrics").addEventListener("change", () => loadCurves().catch(showError));
  document.getElementById("status-filter").addEventListener("change", (ev) => {
    state.status = ev.target.value;
    state.offset = 0;
    refresh();
  });
  document.getElementById("prev").addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - PAGE_SIZE);
    refresh();
  });
  document.getElementById("next").addEventListener("click", () => {
    state.offset += PAGE_SIZE;
    refresh();
  });
  document.getElementById("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = document.getElementById("token-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    document.getElementById("token-input").value = "";
    state.seen = {};
    hideTokenForm();
    refresh();
  });
  refresh();
  schedule();
}

start();
