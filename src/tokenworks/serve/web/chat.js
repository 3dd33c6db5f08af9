// The chat page: conversations kept in this browser's storage, each answer streamed from
// /v1/chat/completions and shown as it arrives (reasoning folded apart, tool calls and
// JSON shown as such), with its token counts and time to first token.

import { api, errorText, el } from "/ui/api.js";
import { render } from "/ui/markdown.js";
import { startPanel } from "/ui/panel.js";

const STORE = "tokenworks.conversations";
const SETTINGS = "tokenworks.settings";
const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "stop", "format", "schema", "tools", "extra"];
const $ = (id) => document.getElementById(id);

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null;
let controller = null; // the answer being streamed, to stop it

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch (e) {
    $("panel-status").textContent = "could not keep the conversation: " + e.message;
  }
}

function newConversation() {
  if (current && !current.messages.length) return; // the empty one open is the new one
  current = { id: String(Date.now()), title: "new chat", messages: [], created: Date.now() };
  conversations.unshift(current);
  showList();
  showMessages();
}

function showList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const c of conversations) {
    const open = el("button", { type: "button", class: "open", text: c.title });
    open.addEventListener("click", () => {
      current = c;
      showList();
      showMessages();
    });
    const drop = el("button", { type: "button", class: "drop", title: "delete", text: "×" });
    drop.addEventListener("click", () => {
      conversations = conversations.filter((x) => x !== c);
      if (current === c) current = conversations[0] || null;
      save();
      if (!current) newConversation();
      showList();
      showMessages();
    });
    list.append(el("li", { class: c === current ? "current" : "" }, open, drop));
  }
}

// One message's view; an assistant's is redrawn as its answer grows.
function messageView(msg) {
  const item = el("li", { class: "message " + msg.role, "data-role": msg.role });
  if (msg.role === "user") {
    item.append(el("div", { class: "content", text: msg.content }));
    return item;
  }
  const reasoning = el("details", { class: "reasoning" }, el("summary", { text: "reasoning" }), el("div", { class: "reasoning-text" }));
  const content = el("div", { class: "content" });
  const tools = el("div", { class: "tool-calls" });
  const stats = el("div", { class: "stats" });
  item.append(reasoning, content, tools, stats);
  item.redraw = () => drawAssistant(item, msg);
  item.redraw();
  return item;
}

function drawAssistant(item, msg) {
  const [reasoning, content, tools, stats] = item.children;
  item.dataset.state = msg.state || "done";
  reasoning.hidden = !msg.reasoning;
  reasoning.querySelector(".reasoning-text").textContent = msg.reasoning || "";
  if (msg.format && msg.format !== "text") {
    // structured output: the JSON itself, laid out when it parses
    let shown = msg.content || "";
    try {
      if (msg.state !== "streaming") shown = JSON.stringify(JSON.parse(shown), null, 2);
    } catch (_) { /* shown as it came */ }
    content.replaceChildren(el("pre", { class: "json" }, el("code", { text: shown })));
  } else {
    content.replaceChildren(render(msg.content || ""));
  }
  tools.replaceChildren();
  for (const call of msg.tool_calls || []) {
    let args = call.function.arguments || "";
    try {
      if (msg.state !== "streaming") args = JSON.stringify(JSON.parse(args), null, 2);
    } catch (_) { /* as it came */ }
    tools.append(el("div", { class: "tool-call" }, el("span", { class: "tool-name", text: "tool call: " + (call.function.name || "") }), el("pre", {}, el("code", { text: args }))));
  }
  const s = msg.stats || {};
  const parts = [];
  if (msg.error) parts.push("error: " + msg.error);
  if (s.prompt_tokens !== undefined) parts.push(s.prompt_tokens + " prompt tokens");
  if (s.completion_tokens !== undefined) parts.push(s.completion_tokens + " generated");
  if (s.ttft_ms !== undefined) parts.push("first token " + s.ttft_ms.toFixed(0) + " ms");
  if (s.tok_s !== undefined) parts.push(s.tok_s.toFixed(1) + " tok/s");
  if (s.finish_reason) parts.push("finished: " + s.finish_reason);
  stats.textContent = parts.join(" · ");
  stats.classList.toggle("error", Boolean(msg.error));
}

function showMessages() {
  const list = $("messages");
  list.replaceChildren(...(current ? current.messages.map(messageView) : []));
  list.scrollTop = list.scrollHeight;
}

function readSettings() {
  const s = {};
  for (const f of FIELDS) s[f] = $(f).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
  return s;
}

function parseJSON(text, what) {
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(what + " is not valid JSON: " + e.message);
  }
}

// The request body for the conversation so far, from the settings.
function requestBody(s) {
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of current.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (!m.error) {
      const out = { role: "assistant", content: m.content || "" };
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    }
  }
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  // a field left empty is left to the server's default
  for (const f of ["temperature", "top_p", "max_tokens", "seed"]) {
    if (s[f].trim()) body[f] = Number(s[f]);
  }
  const stop = s.stop.split("\n").filter((x) => x.length);
  if (stop.length) body.stop = stop;
  if (s.format === "json_object") body.response_format = { type: "json_object" };
  if (s.format === "json_schema") {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parseJSON(s.schema, "the JSON schema") } };
  }
  if (s.tools.trim()) body.tools = parseJSON(s.tools, "tools");
  if (s.extra.trim()) Object.assign(body, parseJSON(s.extra, "the request fields"));
  return body;
}

// Server-sent events from a fetch body: each "data:" payload, in order.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  const t0 = performance.now(); // send pressed: where the page's time to first token starts
  let settings, body;
  $("settings-error").textContent = "";
  try {
    settings = readSettings();
    current.messages.push({ role: "user", content: text });
    body = requestBody(settings);
  } catch (e) {
    current.messages.pop();
    $("settings-error").textContent = e.message;
    $("settings").hidden = false;
    return;
  }
  if (current.messages.length === 1) current.title = text.slice(0, 40);
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming", format: settings.format, stats: {} };
  current.messages.push(msg);
  save();
  showList();
  const list = $("messages");
  list.append(messageView(current.messages[current.messages.length - 2]));
  const view = messageView(msg);
  list.append(view);
  let first = null;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      view.redraw();
      list.scrollTop = list.scrollHeight;
    });
  };
  controller = new AbortController();
  $("send").hidden = true;
  $("stop-button").hidden = false;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) {
        msg.stats.prompt_tokens = chunk.usage.prompt_tokens;
        msg.stats.completion_tokens = chunk.usage.completion_tokens;
      }
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const d = choice.delta || {};
      const grew = d.content || d.reasoning_content || d.reasoning || d.tool_calls;
      if (grew && first === null) {
        first = performance.now();
        msg.stats.ttft_ms = first - t0;
        // the first token on the page now, not at the next frame: what TTFT measures
        msg.content += d.content || "";
        msg.reasoning += d.reasoning_content || d.reasoning || "";
        view.redraw();
        view.dataset.firstTokenMs = String(msg.stats.ttft_ms);
      } else {
        msg.content += d.content || "";
        msg.reasoning += d.reasoning_content || d.reasoning || "";
      }
      for (const t of d.tool_calls || []) {
        const call = (msg.tool_calls[t.index || 0] = msg.tool_calls[t.index || 0] || { id: t.id, type: "function", function: { name: "", arguments: "" } });
        if (t.id) call.id = t.id;
        if (t.function && t.function.name) call.function.name += t.function.name;
        if (t.function && t.function.arguments) call.function.arguments += t.function.arguments;
      }
      if (choice.finish_reason) msg.stats.finish_reason = choice.finish_reason;
      redraw();
    }
  } catch (e) {
    if (e.name !== "AbortError") msg.error = e.message;
    else msg.stats.finish_reason = "stopped";
  }
  const seconds = (performance.now() - (first || t0)) / 1000;
  if (msg.stats.completion_tokens > 1 && seconds > 0) msg.stats.tok_s = (msg.stats.completion_tokens - 1) / seconds;
  msg.state = msg.error ? "error" : "done";
  controller = null;
  $("send").hidden = false;
  $("stop-button").hidden = true;
  save();
  view.redraw();
}

async function loadModels() {
  const select = $("model");
  const response = await api("/v1/models");
  if (!response.ok) {
    $("panel-status").textContent = "models: " + (await errorText(response));
    return;
  }
  const models = (await response.json()).data || [];
  select.replaceChildren(...models.map((m) => el("option", { value: m.id, text: m.parent ? m.id + " (adapter of " + m.parent + ")" : m.id })));
}

function restoreSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const f of FIELDS) if (saved[f] !== undefined) $(f).value = saved[f];
}

function init() {
  restoreSettings();
  $("toggle-settings").addEventListener("click", () => {
    const form = $("settings");
    form.hidden = !form.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!form.hidden));
  });
  $("settings").addEventListener("change", () => readSettings());
  $("new-chat").addEventListener("click", newConversation);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => controller && controller.abort());
  current = conversations[0] || null;
  if (!current) newConversation();
  showList();
  showMessages();
  loadModels().then(() => startPanel($("engine-figures"), $("panel-status")));
}

init();
