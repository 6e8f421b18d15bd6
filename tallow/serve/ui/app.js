// tallow's chat page: a client of the server's own /v1/chat/completions (streamed) and /stats.
// Conversations and settings live in localStorage; an API key only in sessionStorage.
import { render } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "tallow.conversations", SETTINGS = "tallow.settings", KEY = "tallow.apiKey", THEME = "tallow.theme";

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null;      // the conversation shown
let controller = null;   // the AbortController of the reply streaming now
let modelName = null;

function save() { localStorage.setItem(STORE, JSON.stringify(conversations)); }
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// ---- API key -------------------------------------------------------------------------------
function askKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-form").onsubmit = () => {
      sessionStorage.setItem(KEY, $("key-input").value.trim());
      $("key-input").value = "";
      resolve();
    };
    if (!dialog.open) dialog.showModal();
  });
}

async function loadModel() {
  for (;;) {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) { await askKey(); continue; }
    if (!r.ok) { setTimeout(loadModel, 1000); return; }  // still loading
    const card = (await r.json()).data[0];
    modelName = card.id;
    $("model-name").textContent = card.id;
    // the server's defaults for a field left out (serve/plan.py), shown in the empty fields
    $("set-temperature").placeholder = "1";
    $("set-top-p").placeholder = "1";
    $("set-max-tokens").placeholder = `up to ${card.max_model_len}`;
    $("set-seed").placeholder = "random";
    $("model-defaults").textContent = `temperature 1, top-p 1, max tokens: what the ${card.max_model_len}-token context leaves, seed random`;
    return;
  }
}

// ---- settings ------------------------------------------------------------------------------
const FIELDS = { system: "set-system", temperature: "set-temperature", top_p: "set-top-p",
                 max_tokens: "set-max-tokens", seed: "set-seed", tools: "set-tools" };
function loadSettings() {
  const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const [k, id] of Object.entries(FIELDS)) $(id).value = s[k] ?? "";
}
function settings() {
  const s = {};
  for (const [k, id] of Object.entries(FIELDS)) s[k] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
  return s;
}

// ---- conversations -------------------------------------------------------------------------
function newConversation() {
  current = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  conversations.unshift(current);
  save();
  drawList();
  drawMessages();
}

function drawList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.textContent = c.title;
    li.className = c === current ? "active" : "";
    li.onclick = () => { if (!controller) { current = c; drawList(); drawMessages(); } };
    const del = document.createElement("button");
    del.textContent = "×";
    del.title = "delete";
    del.onclick = (e) => {
      e.stopPropagation();
      if (controller) return;
      conversations = conversations.filter((x) => x !== c);
      save();
      if (current === c) { conversations.length ? (current = conversations[0]) : newConversation(); }
      drawList(); drawMessages();
    };
    li.append(del);
    ul.append(li);
  }
}

function drawMessages() {
  const box = $("messages");
  box.replaceChildren(...current.messages.map((m, i) => drawMessage(m, i)));
  box.scrollTop = box.scrollHeight;
}

function drawMessage(m, index) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  if (m.reasoning) {
    const det = document.createElement("details");
    det.className = "reasoning";
    det.open = !!m.streaming;
    const sum = document.createElement("summary");
    sum.textContent = m.streaming && !m.content ? "Thinking…" : "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    body.textContent = m.reasoning.trim();
    det.append(sum, body);
    div.append(det);
  }
  const content = document.createElement("div");
  content.className = "content";
  if (m.role === "user") content.textContent = m.content; else content.append(render(m.content || ""));
  div.append(content);
  for (const call of m.tool_calls || []) {
    const card = document.createElement("div");
    card.className = "tool-call";
    const name = document.createElement("div");
    name.className = "tool-name";
    name.textContent = "🔧 " + (call.function.name || "");
    const args = document.createElement("pre");
    let text = call.function.arguments || "";
    try { text = JSON.stringify(JSON.parse(text), null, 2); } catch { /* still streaming */ }
    args.textContent = text;
    card.append(name, args);
    div.append(card);
  }
  if (m.error) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = m.error;
    div.append(err);
  }
  const meta = document.createElement("div");
  meta.className = "meta";
  if (m.stats) {
    const s = m.stats;
    const parts = [];
    if (s.prompt != null) parts.push(`prompt ${s.prompt}`, `cached ${s.cached ?? 0}`, `completion ${s.completion}`);
    if (s.ttft != null) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
    if (s.tps != null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    if (s.finish) parts.push(s.finish);
    meta.textContent = parts.join(" · ");
  }
  if (!controller) {
    if (m.role === "user") meta.append(button("Edit", () => edit(index)));
    if (m.role === "assistant" && index === current.messages.length - 1) meta.append(button("Regenerate", regenerate));
  }
  div.append(meta);
  return div;
}

function button(label, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.className = "action";
  b.onclick = onclick;
  return b;
}

function edit(index) {
  $("input").value = current.messages[index].content;
  current.messages.splice(index);
  save();
  drawMessages();
  $("input").focus();
}

function regenerate() {
  current.messages.pop();
  save();
  reply();
}

// ---- sending and streaming -----------------------------------------------------------------
async function send(text) {
  if (!text.trim() || controller) return;
  if (!current.messages.length) { current.title = text.slice(0, 40); drawList(); }
  current.messages.push({ role: "user", content: text });
  save();
  await reply();
}

function requestBody() {
  const s = settings();
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of current.messages) {
    if (!m.streaming) messages.push({ role: m.role, content: m.content || "" });  // not the reply being made
  }
  const body = { model: modelName || "default", messages, stream: true, stream_options: { include_usage: true } };
  for (const k of ["temperature", "top_p", "max_tokens", "seed"]) {
    if (s[k] !== "") body[k] = Number(s[k]);
  }
  if (s.tools.trim()) body.tools = JSON.parse(s.tools);
  return body;
}

async function reply() {
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], streaming: true, stats: {} };
  current.messages.push(msg);
  controller = new AbortController();
  setBusy(true);
  drawMessages();
  const t0 = performance.now();
  let tFirst = null, chunks = 0, pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; drawMessages(); });
  };
  try {
    let body;
    try { body = requestBody(); } catch (e) { throw new Error("settings: tools is not valid JSON: " + e.message); }
    let r;
    for (;;) {
      r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
      if (r.status !== 401) break;
      await askKey();
    }
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error(`${r.status}: ${e.error?.message || r.statusText}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) {
            msg.stats.prompt = chunk.usage.prompt_tokens;
            msg.stats.cached = chunk.usage.prompt_tokens_details?.cached_tokens ?? 0;
            msg.stats.completion = chunk.usage.completion_tokens;
          }
          const choice = chunk.choices?.[0];
          if (!choice) continue;
          const d = choice.delta || {};
          const got = d.content || d.reasoning_content || d.tool_calls;
          if (got) { tFirst ??= performance.now(); chunks++; }
          if (d.reasoning_content) msg.reasoning += d.reasoning_content;
          if (d.content) msg.content += d.content;
          for (const tc of d.tool_calls || []) {
            const slot = (msg.tool_calls[tc.index ?? 0] ??= { id: tc.id, type: "function", function: { name: "", arguments: "" } });
            if (tc.function?.name) slot.function.name += tc.function.name;
            if (tc.function?.arguments) slot.function.arguments += tc.function.arguments;
          }
          if (choice.finish_reason) msg.stats.finish = choice.finish_reason;
          redraw();
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stats.finish = "stopped";
    else msg.error = String(e.message || e);
  } finally {
    const t1 = performance.now();
    if (tFirst != null) {
      msg.stats.ttft = tFirst - t0;
      const n = msg.stats.completion ?? chunks;
      if (n > 1 && t1 > tFirst) msg.stats.tps = (n - 1) / ((t1 - tFirst) / 1000);
    }
    delete msg.streaming;
    if (!msg.tool_calls.length) delete msg.tool_calls;
    controller = null;
    setBusy(false);
    save();
    drawMessages();
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ---- server state --------------------------------------------------------------------------
async function pollStats() {
  try {
    const r = await fetch("/stats");
    if (r.ok) {
      const s = (await r.json()).engine;
      $("stat-running").textContent = s.running;
      $("stat-waiting").textContent = s.waiting;
      $("stat-kv").textContent = (100 * s.kv_cache_usage).toFixed(1) + "%";
    }
  } catch { /* server restarting */ }
  setTimeout(pollStats, 1000);
}

// ---- wiring --------------------------------------------------------------------------------
function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  localStorage.setItem(THEME, theme);
}

$("composer").onsubmit = (e) => {
  e.preventDefault();
  const text = $("input").value;
  $("input").value = "";
  send(text);
};
$("input").onkeydown = (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
};
$("stop").onclick = () => controller?.abort();
$("new-chat").onclick = () => { if (!controller) newConversation(); };
$("settings-toggle").onclick = () => { $("settings").hidden = !$("settings").hidden; };
$("theme-toggle").onclick = () => setTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark");

setTheme(localStorage.getItem(THEME) || (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
loadSettings();
if (conversations.length) current = conversations[0]; else newConversation();
drawList();
drawMessages();
pollStats();
loadModel();
