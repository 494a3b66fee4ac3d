// The page of `specdecode serve`: a chat with the loaded model that shows how speculation
// committed each token. Plain JavaScript, no build step. It speaks the server's OpenAI API
// with the `speculative.trace` extension: each streamed chunk then carries
// `speculation_trace` = {runs: [{text, by}], step: {k, accepted, by}, note}, where `by` is
// the drafter whose accepted draft gave that text (null: the target's own token).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: null, info: null, abort: null, steps: [], lastRate: null };

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (state.key) headers.Authorization = "Bearer " + state.key;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) {
    $("keybox").hidden = false;
    let message = "this server needs an API key";
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error("401: " + message);
  }
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = response.status + ": " + (await response.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

function kindOf(by) {
  if (!by) return "target";
  if (by === "ngram" || by === "suffix" || by === "prediction" || by === "heads") return by;
  return "model";
}

function legend() {
  const names = ["target"].concat((state.info && state.info.drafters) || []);
  $("legend").innerHTML = "";
  for (const name of names) {
    const span = document.createElement("span");
    span.className = "by-" + kindOf(name === "target" ? null : name);
    span.textContent = name === "target" ? "target's own token" : "accepted draft: " + name;
    $("legend").appendChild(span);
  }
}

async function loadInfo() {
  const info = await (await api("/v1/specdecode/info")).json();
  state.info = info;
  $("model").textContent = info.model + " · draft " + info.draft;
  $("runs-on").textContent = info.runs_on ? "runs: " + info.runs_on : "";
  const select = $("draft");
  for (const name of info.drafters) {
    if (![...select.options].some((o) => o.value === name)) select.add(new Option(name, name));
  }
  legend();
  showError("");
  $("keybox").hidden = true;
}

function requestBody(plain) {
  const body = {
    model: state.info ? state.info.model : undefined,
    messages: [],
    max_tokens: parseInt($("max_tokens").value, 10) || 256,
    temperature: parseFloat($("temperature").value) || 0,
    top_p: parseFloat($("top_p").value) || 1,
    stream: true,
    stream_options: { include_usage: true },
    speculative: { trace: true },
  };
  if ($("system").value.trim()) body.messages.push({ role: "system", content: $("system").value });
  body.messages.push({ role: "user", content: $("prompt").value });
  if ($("seed").value !== "") body.seed = parseInt($("seed").value, 10);
  if (plain) {
    body.speculative.draft = "none";
    return body;
  }
  if ($("draft").value !== "auto") body.speculative.draft = $("draft").value;
  const k = $("k").value.trim();
  if (k && k !== "auto") body.speculative.num_speculative_tokens = parseInt(k, 10);
  if ($("max_tree_nodes").value !== "") body.speculative.max_tree_nodes = parseInt($("max_tree_nodes").value, 10);
  if ($("prediction").value) body.prediction = { type: "content", content: $("prediction").value };
  return body;
}

function addRuns(runs) {
  const answer = $("answer");
  for (const run of runs) {
    const span = document.createElement("span");
    span.className = "by-" + kindOf(run.by) + (run.by ? "" : " tok-target");
    span.dataset.by = run.by || "target";
    span.textContent = run.text;
    answer.appendChild(span);
  }
}

function drawSteps() {
  const canvas = $("kchart");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const steps = state.steps;
  if (!steps.length) return;
  const kmax = Math.max(4, ...steps.map((s) => s.k));
  const w = Math.max(1, Math.min(12, canvas.width / steps.length));
  const h = canvas.height - 14;
  steps.forEach((s, i) => {
    const x = i * w;
    ctx.fillStyle = "#d5d9e0";
    ctx.fillRect(x, h - (s.k / kmax) * h, w - 1, (s.k / kmax) * h);
    ctx.fillStyle = "#3a9a4e";
    ctx.fillRect(x, h - (s.accepted / kmax) * h, w - 1, (s.accepted / kmax) * h);
  });
  ctx.fillStyle = "#4a5368";
  ctx.font = "11px sans-serif";
  ctx.fillText("K drafted (grey) and accepted (green) per step, up to " + kmax, 4, canvas.height - 2);
}

function showStats(stats, elapsed) {
  const rate = stats ? stats.decode_tokens_per_s : null;
  $("s-rate").textContent = rate != null ? rate.toFixed(2) : (elapsed ? (state.tokens / elapsed).toFixed(2) : "-");
  $("s-tokens").textContent = stats ? stats.completion_tokens : state.tokens;
  const drafted = stats ? stats.drafted : state.steps.reduce((a, s) => a + s.k, 0);
  const accepted = stats ? stats.accepted : state.steps.reduce((a, s) => a + s.accepted, 0);
  $("s-accept").textContent = drafted ? (accepted / drafted).toFixed(3) : "-";
  $("s-len").textContent = stats ? stats.mean_accepted_length.toFixed(2)
    : (state.steps.length ? (state.tokens / state.steps.length).toFixed(2) : "-");
  $("s-steps").textContent = stats ? stats.target_forward_passes : state.steps.length;
}

// One streamed request; resolves to its final statistics (the `speculation` object).
async function run(plain, render) {
  state.abort = new AbortController();
  $("stop").disabled = false;
  const started = performance.now();
  let stats = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(requestBody(plain)), signal: state.abort.signal });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.speculation) stats = chunk.speculation;
          if (render) renderChunk(chunk, (performance.now() - started) / 1000);
        }
      }
    }
  } finally {
    $("stop").disabled = true;
    state.abort = null;
  }
  return stats;
}

function renderChunk(chunk, elapsed) {
  const trace = chunk.speculation_trace;
  const choice = chunk.choices && chunk.choices[0];
  const text = choice && choice.delta ? choice.delta.content : null;
  if (trace && trace.runs && trace.runs.length) addRuns(trace.runs);
  else if (text) addRuns([{ text, by: null }]);
  if (trace && trace.step) {
    state.steps.push(trace.step);
    state.tokens += trace.step.committed;
    drawSteps();
  }
  if (trace && trace.note) $("reason").textContent = "controller: " + trace.note;
  showStats(chunk.speculation || null, elapsed);
  const spec = chunk.speculation;
  if (spec && spec.controller_note) {
    $("reason").textContent = "controller: " + spec.controller_note;
  } else if (spec) {  // no cost-aware controller: the drafter and K are fixed
    $("reason").textContent = spec.draft === "none" || !spec.drafted ? "no drafts: plain decoding"
      : "fixed: " + spec.draft + " drafts K = " + spec.num_speculative_tokens + " tokens every step (no controller)";
  }
}

function reset() {
  $("answer").innerHTML = "";
  $("reason").textContent = "";
  state.steps = [];
  state.tokens = 0;
  drawSteps();
  showStats(null, 0);
  showError("");
}

async function send() {
  reset();
  $("comparison").hidden = true;
  try {
    const stats = await run(false, true);
    state.lastRate = stats ? stats.decode_tokens_per_s : null;
    $("answer").dataset.done = "true";
    return stats;
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
    return null;
  }
}

async function compare() {
  const spec = await send();
  if (!spec) return;
  const out = $("comparison");
  out.hidden = false;
  out.textContent = "running the same request with speculation off...";
  try {
    const plain = await run(true, false);
    const a = spec.decode_tokens_per_s, b = plain.decode_tokens_per_s;
    out.dataset.speculative = a;
    out.dataset.plain = b;
    out.textContent = "speculative " + a.toFixed(2) + " tok/s, plain " + b.toFixed(2) + " tok/s: "
      + (b > 0 ? (a / b).toFixed(2) + "x" : "-");
  } catch (e) {
    out.textContent = "";
    showError(e.message);
  }
}

async function showCosts() {
  try {
    const costs = await (await api("/v1/specdecode/costs")).json();
    drawCosts(costs);
  } catch (e) {
    showError(e.message);
  }
}

function drawCosts(costs) {
  const canvas = $("costchart");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const t = costs.target;
  const lines = [];
  if (!t) {
    $("costtext").textContent = costs.note || "no cost curve: this server plans no speculation";
    return;
  }
  const pad = 40, W = canvas.width - 2 * pad, H = canvas.height - 2 * pad;
  const nmax = Math.max(...t.ns), smax = Math.max(...t.seconds, ...(t.observed || []).map((p) => p[1]));
  const X = (n) => pad + (n / nmax) * W, Y = (s) => canvas.height - pad - (s / smax) * H;
  ctx.strokeStyle = "#888"; ctx.strokeRect(pad, pad, W, H);
  ctx.strokeStyle = "#2d5fb8"; ctx.lineWidth = 2; ctx.beginPath();
  t.ns.forEach((n, i) => (i ? ctx.lineTo(X(n), Y(t.seconds[i])) : ctx.moveTo(X(n), Y(t.seconds[i]))));
  ctx.stroke();
  ctx.fillStyle = "#e0702a";
  for (const [n, s] of t.observed || []) { ctx.beginPath(); ctx.arc(X(n), Y(s), 3, 0, 7); ctx.fill(); }
  const t1 = t.seconds[0];
  const ceiling = t.ns.map((n, i) => (n * t1) / t.seconds[i]);
  const cmax = Math.max(...ceiling);
  ctx.strokeStyle = "#3a9a4e"; ctx.setLineDash([5, 4]); ctx.beginPath();
  t.ns.forEach((n, i) => {
    const y = canvas.height - pad - (ceiling[i] / cmax) * H;
    i ? ctx.lineTo(X(n), y) : ctx.moveTo(X(n), y);
  });
  ctx.stroke(); ctx.setLineDash([]);
  ctx.fillStyle = "#1d2430"; ctx.font = "12px sans-serif";
  ctx.fillText("T(n), seconds (blue; dots observed), up to " + smax.toFixed(3) + " s", pad, pad - 8);
  ctx.fillText("n tokens per forward, up to " + nmax, pad, canvas.height - 12);
  ctx.fillText("n T(1)/T(n), up to " + cmax.toFixed(1) + "x (green)", pad + W / 2, pad - 8);
  lines.push("target " + costs.model + ": T(1) = " + (t1 * 1000).toFixed(1) + " ms; copy limit L = 33 T(1)/T(33) = "
    + (costs.copy_limit != null ? costs.copy_limit.toFixed(2) + "x" : "-"));
  for (const [n, s] of t.ns.map((n, i) => [n, t.seconds[i]])) {
    lines.push("  T(" + n + ") = " + (s * 1000).toFixed(1) + " ms, " + ((s / n) * 1000).toFixed(1) + " ms per token");
  }
  for (const d of costs.drafters || []) {
    lines.push("draft " + d.name + ": " + (d.seconds_per_token * 1000).toFixed(2) + " ms per drafted token");
  }
  $("costtext").textContent = lines.join("\n");
}

function tabs(which) {
  $("view-chat").hidden = which !== "chat";
  $("view-costs").hidden = which !== "costs";
  $("tab-chat").classList.toggle("active", which === "chat");
  $("tab-costs").classList.toggle("active", which === "costs");
  if (which === "costs") showCosts();
}

async function start() {
  $("send").onclick = send;
  $("compare").onclick = compare;
  $("stop").onclick = () => state.abort && state.abort.abort();
  $("tab-chat").onclick = () => tabs("chat");
  $("tab-costs").onclick = () => tabs("costs");
  $("keyset").onclick = async () => {
    state.key = $("apikey").value;
    try { await loadInfo(); } catch (e) { showError(e.message); }
  };
  const params = new URLSearchParams(location.search);
  if (params.get("prompt") !== null) $("prompt").value = params.get("prompt");
  if (params.get("max_tokens") !== null) $("max_tokens").value = params.get("max_tokens");
  if (params.get("system") !== null) $("system").value = params.get("system");
  try {
    await loadInfo();
  } catch (e) {
    showError(e.message);
    return;
  }
  if (params.get("prompt")) send();
}

start();
